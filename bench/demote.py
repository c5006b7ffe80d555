"""Puts into a full host tier over nvme (the daemon's default layout) against their floor.

``kvtier bench demote [--json F] [--dir D] [--chunks 2] [--host-mib 256] [--repeat 15]``

The store is the embedded default configuration with its data directory set, as
``kvtier serve`` builds it: a host tier (here ``--host-mib`` MiB, so that it fills) over
an nvme tier under ``<data_dir>/nvme`` (``durability = "sync"``, O_DIRECT where the
filesystem allows it). Once the host tier is full, every put of a fresh run of
``--chunks`` chunks (the default model's 32 MiB each) first moves as many of the host
tier's coldest chunks into nvme, then copies its own values in.

The floor is the same work done alone, timed in the same run, interleaved round by
round: a ``numpy.copyto`` of the put's bytes into a pre-faulted buffer (the copy into the
host tier) plus a put of the same bytes, from page-aligned memory, into a store whose
only tier is an identical nvme tier (the disk write of the demotion, with its checksums
and journal). Ratio = (copy + nvme put) / demoting put, medians; 1.0 means the demotion
costs nothing beyond its copy and its disk write. After the timed rounds, the first
timed run (in nvme by then) and the last (in the host tier) are read back and compared
byte for byte.

Every file goes into a temporary directory under ``--dir`` (default: the system's
temporary folder), removed afterwards: never the user's data directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import mmap
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.bench.common import envelope, interleaved, write_json
from kvtier.config import load_config
from kvtier.factory import build_store
from kvtier.keys import ChunkKey
from kvtier.service.server import with_data_dir, with_nvme_under
from kvtier.store import TieredStore
from kvtier.tiers.nvme.tier import NVMeTier

MiB = 1 << 20


def _keys(run: int, n: int) -> list[ChunkKey]:
    return [ChunkKey(run.to_bytes(8, "little") + j.to_bytes(8, "little")) for j in range(n)]


def _aligned(nbytes: int) -> npt.NDArray[np.uint8]:
    """Page-aligned memory (an anonymous map), faulted in: the nvme tier writes it directly."""
    arr = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    arr[:] = 1
    return arr


def _stamp(src: npt.NDArray[np.uint8], run: int, chunk_bytes: int) -> None:
    """Mark every chunk of ``src`` with the run's number, so a read-back tells runs apart."""
    for k in range(src.nbytes // chunk_bytes):
        src[k * chunk_bytes : k * chunk_bytes + 8] = np.frombuffer(
            run.to_bytes(8, "little"), dtype=np.uint8
        )


def run(base: Path, chunks: int, host_mib: int, repeat: int) -> dict[str, Any]:
    cfg = load_config(
        None,
        env={},
        overrides=[f"service.data_dir={base / 'demote'}", f"tiers.0.capacity_bytes={host_mib}MiB"],
    )
    demoting = build_store(with_data_dir(cfg)).store
    alone_cfg = with_nvme_under(
        dataclasses.replace(cfg, tiers=()), base / "alone" / "nvme", cfg.service.data_capacity_bytes
    )
    alone = build_store(alone_cfg).store
    try:
        return _rounds(demoting, alone, chunks, repeat)
    finally:
        demoting.close()
        alone.close()


def _rounds(demoting: TieredStore, alone: TieredStore, chunks: int, repeat: int) -> dict[str, Any]:
    host, nvme = demoting.tiers[0], demoting.tiers[1]
    chunk_bytes = host.slot_bytes
    nbytes = chunks * chunk_bytes
    rng = np.random.default_rng(0)
    src = _aligned(nbytes)
    src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ring = _aligned(8 * nbytes)  # the copy's destination rotates, as slots of an arena do
    at = [0]
    runs = {"demote": 1000, "alone": 1_000_000}
    # Fill the host tier (untimed): from here on every put demotes.
    for _ in range(host.capacity_slots // chunks + 1):
        assert demoting.put(_keys(runs["demote"], chunks), src).result().stored == chunks
        runs["demote"] += 1
    first_timed = runs["demote"] + 2  # after interleaved()'s two warm-up rounds

    def demote() -> None:
        _stamp(src, runs["demote"], chunk_bytes)
        assert demoting.put(_keys(runs["demote"], chunks), src).result().stored == chunks
        runs["demote"] += 1

    def copy() -> None:
        at[0] = (at[0] + 1) % 8
        np.copyto(ring[at[0] * nbytes : (at[0] + 1) * nbytes], src)

    def nvme_alone() -> None:
        assert alone.put(_keys(runs["alone"], chunks), src).result().stored == chunks
        runs["alone"] += 1

    cpu: dict[str, list[float]] = {"demote": [], "copy": [], "nvme": []}

    def on_cpu(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        # The process's CPU time (every thread's) over one call: the contenders run one
        # at a time, so it is that call's CPU, whatever the disk's speed.
        def timed() -> None:
            t = time.process_time()
            fn()
            cpu[name].append(time.process_time() - t)

        return timed

    s = interleaved(
        {
            "demote": on_cpu("demote", demote),
            "copy": on_cpu("copy", copy),
            "nvme": on_cpu("nvme", nvme_alone),
        },
        repeat=repeat,
    )
    cpu_ms = {k: statistics.median(v[-repeat:]) * 1e3 for k, v in cpu.items()}
    last = runs["demote"] - 1
    verified = True
    out = np.empty(nbytes, dtype=np.uint8)
    for r in (first_timed, last):
        got = demoting.get(_keys(r, chunks), out).result()
        want = src.copy()
        _stamp(want, r, chunk_bytes)
        verified &= got.chunks == chunks and bool(np.array_equal(out, want))
    floor = s["copy"].median_s + s["nvme"].median_s
    return {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "host_capacity_bytes": host.capacity_slots * chunk_bytes,
        "nvme_direct": isinstance(nvme, NVMeTier) and bool(nvme.engine.direct[0]),
        "demoted_chunks": demoting.stats().demoted_chunks,
        "demote_ms": s["demote"].median_s * 1e3,
        "copy_ms": s["copy"].median_s * 1e3,
        "nvme_alone_ms": s["nvme"].median_s * 1e3,
        "demote_GBps": nbytes / s["demote"].median_s / 1e9,
        "ratio": floor / s["demote"].median_s,
        "cpu_ms": cpu_ms,
        "cpu_ratio": (cpu_ms["copy"] + cpu_ms["nvme"]) / cpu_ms["demote"],
        "raw": {k: dataclasses.asdict(v) for k, v in s.items()},
        "verified": verified,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench demote", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent of the scratch folder (default: temp dir)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks per put (default 2)")
    ap.add_argument("--host-mib", type=int, default=256, help="host tier size (default 256)")
    ap.add_argument("--repeat", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.host_mib < 1 or args.repeat < 1:
        ap.error("--chunks, --host-mib and --repeat must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-demote-", dir=args.dir))
    try:
        row = run(base, args.chunks, args.host_mib, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mib = row["chunks"] * row["chunk_bytes"] // MiB
    print(
        f"put of {row['chunks']} x {row['chunk_bytes'] // MiB} MiB into a full "
        f"{row['host_capacity_bytes'] // MiB} MiB host tier over nvme "
        f"(O_DIRECT: {row['nvme_direct']}), median of {args.repeat}"
    )
    print(f"  demoting put      {row['demote_ms']:8.1f} ms  ({row['demote_GBps']:.2f} GB/s)")
    print(f"  copy of {mib} MiB   {row['copy_ms']:8.1f} ms")
    print(f"  nvme put alone    {row['nvme_alone_ms']:8.1f} ms")
    print(f"  ratio (copy + nvme alone) / demoting put: {row['ratio']:.2f}")
    c = row["cpu_ms"]
    print(
        f"  CPU ms per put (every thread): demoting {c['demote']:.1f}, copy {c['copy']:.1f},"
        f" nvme alone {c['nvme']:.1f}; ratio {row['cpu_ratio']:.2f}"
    )
    print(f"  bytes verified: {row['verified']}")
    write_json(args.json, envelope("demote", [row]))
    return 0 if row["verified"] else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
