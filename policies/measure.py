"""Measure this machine into a hardware profile (``kvtier info --profile F``).

Two measurements, each the median of repeats after a warm-up, with random data:

* host memory: numpy copies between two large pre-faulted buffers at transfer sizes
  64 KiB .. 16 MiB, fitted to ``peak * n / (n + half)``. On a GPU host this is not the
  PCIe path (that needs CUDA copies); it is what a CPU-only host's memory tier moves.
* disk: O_DIRECT sequential writes and reads of 16 MiB pieces in a directory (the
  nvme tier's I/O shape), falling back to buffered I/O with ``fdatasync`` where
  O_DIRECT is refused (reported).

Endurance, price and power cannot be measured: they come from the nearest preset and
the TOML says so in a comment. The GPU section is the H200 preset.
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.tiers.economics import DDR5_HOST, NVME_GEN5_TLC

from .profiles import H200

SIZES = (64 << 10, 256 << 10, 2 << 20, 16 << 20)
PIECE = 16 << 20


@dataclass(frozen=True, slots=True)
class Measured:
    """What was measured (bytes/second by transfer size) and the fitted curves."""

    memory_Bps: dict[int, float]
    memory_peak_Bps: float
    memory_half_bytes: float
    disk_write_Bps: float
    disk_read_Bps: float
    disk_o_direct: bool
    disk_dir: str


def run_times(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` timed calls of ``fn``, after ``warmup`` untimed ones.

    Also the benchmarks' timing loop (``kvtier.bench.common.measure``).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_memory(total_bytes: int = 256 << 20, repeat: int = 5) -> dict[int, float]:
    """Bytes/second of numpy copies at each size in :data:`SIZES`."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    out: dict[int, float] = {}
    for size in SIZES:
        n = total_bytes // size

        def run(size: int = size, n: int = n) -> None:
            for i in range(n):
                dst[i * size : (i + 1) * size] = src[i * size : (i + 1) * size]

        out[size] = n * size / statistics.median(run_times(run, repeat))
    if not np.array_equal(src[: 1 << 20], dst[: 1 << 20]):
        raise RuntimeError("memory copy verification failed")
    return out


def fit(curve: dict[int, float]) -> tuple[float, float]:
    """Least squares fit of ``time(n) = (n + half) / peak`` (linear in n): (peak, half)."""
    ns = np.array(sorted(curve), dtype=np.float64)
    ts = np.array([n / curve[int(n)] for n in ns])
    slope, intercept = np.polyfit(ns, ts, 1)
    peak = 1.0 / slope
    return float(peak), float(max(intercept * peak, 0.0))


def measure_disk(directory: Path, total_bytes: int = 256 << 20) -> tuple[float, float, bool]:
    """(write, read) bytes/second of sequential 16 MiB pieces, and whether O_DIRECT worked."""
    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).integers(0, 256, PIECE, dtype=np.uint8).tobytes())
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "probe"
        direct = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            direct = False
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.perf_counter()
            try:
                for i in range(total_bytes // PIECE):
                    os.pwritev(fd, [buf], i * PIECE)
            except OSError:  # O_DIRECT refused by the filesystem at write time
                os.close(fd)
                direct = False
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                t0 = time.perf_counter()
                for i in range(total_bytes // PIECE):
                    os.pwritev(fd, [buf], i * PIECE)
            os.fdatasync(fd)
            write = total_bytes / (time.perf_counter() - t0)
            rbuf = mmap.mmap(-1, PIECE)
            t0 = time.perf_counter()
            for i in range(total_bytes // PIECE):
                os.preadv(fd, [rbuf], i * PIECE)
            read = total_bytes / (time.perf_counter() - t0)
            if rbuf[:4096] != buf[:4096]:
                raise RuntimeError("disk read-back verification failed")
        finally:
            os.close(fd)
    return write, read, direct


def measure(disk_dir: Path) -> Measured:
    """Run both measurements (a few seconds)."""
    mem = measure_memory()
    peak, half = fit(mem)
    w, r, direct = measure_disk(disk_dir)
    return Measured(mem, peak, half, w, r, direct, str(disk_dir))


def to_toml(m: Measured, name: str = "local") -> str:
    """A hardware TOML for ``kvtier calc --hardware``."""
    return f"""# Measured by `kvtier info --profile` on this machine ({time.strftime("%Y-%m-%d")}).
# Bandwidths are measured; latencies, prices, endurance and power come from the presets
# (ddr5, nvme-tlc): they cannot be measured here. Edit them for your hardware.
# memory copies by size (B/s): {", ".join(f"{k}: {v:.3g}" for k, v in m.memory_Bps.items())}
# disk in {m.disk_dir}: O_DIRECT {"yes" if m.disk_o_direct else "no (buffered + fdatasync)"}
name = "{name}"

[gpu]
name = "{H200.name} (preset)"

[[tiers]]
preset = "ddr5"
bandwidth_Bps = {m.memory_peak_Bps:.4g}
half_bandwidth_bytes = {m.memory_half_bytes:.4g}
cost_per_gb_month = {DDR5_HOST.cost_per_gb_month}

[[tiers]]
preset = "nvme-tlc"
bandwidth_Bps = {min(m.disk_read_Bps, m.disk_write_Bps):.4g}
endurance_dwpd = {NVME_GEN5_TLC.endurance_dwpd}
"""
