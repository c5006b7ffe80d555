"""NVMe tier on a GPU host: kvikio (GDS or compat mode) against a pinned-host bounce and dd.

``kvtier bench nvme_gpu --json F [--dir D] [--sizes 4,16,64,256] [--repeat 5]``

Per size, interleaved run by run, on the same filesystem:

* ``kvikio``: a CUDA buffer written to (read from) the tier's slab through the kvikio
  engine, then ``fdatasync`` (the data path a GPU connector would use; no checksum);
* ``kvikio-host``: the tier's own write/read (checksummed, journaled) through the
  kvikio engine from host memory;
* ``posix-bounce``: GPU -> pinned host copy, then the posix tier's write (and the
  reverse for reads): what a host-staged connector does;
* ``dd``: ``oflag=direct conv=notrunc,fdatasync`` / ``iflag=direct`` of the same bytes.

Reports whether cuFile ran GDS or compat mode, and what it said about why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import optional, scratch_dir
from kvtier.tiers.base import TierGeometry

MiB = 1 << 20


def _sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def _dd(args: list[str]) -> float:
    from kvtier.bench.nvme import _dd as dd

    return float(dd(args))


def environment(root: Path) -> dict[str, Any]:
    env: dict[str, Any] = {
        "gpu": _sh("nvidia-smi -L"),
        "driver": _sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"),
        "kernel": platform.release(),
        "filesystem": _sh(f"df -T {root} | tail -1"),
        "block_devices": _sh("lsblk -o NAME,TYPE,TRAN,MODEL,SIZE 2>/dev/null | head -20"),
        "nvidia_fs_module": _sh(
            "lsmod 2>/dev/null | grep -i nvidia_fs"
            " || cat /proc/driver/nvidia-fs/version 2>&1 | head -2"
        ),
        "cufile_json": _sh("ls -la /etc/cufile.json 2>&1"),
    }
    try:
        import kvikio
        import kvikio.cufile_driver as drv
        import kvikio.defaults as d

        env["kvikio"] = getattr(kvikio, "__version__", "?")
        env["compat_mode"] = str(d.get("compat_mode"))
        env["compat_mode_preferred"] = bool(d.is_compat_mode_preferred())
        for k in (
            "thread_pool_nthreads",
            "task_size",
            "gds_threshold",
            "bounce_buffer_size",
            "auto_direct_io_read",
            "auto_direct_io_write",
        ):
            try:
                env[f"kvikio_{k}"] = d.get(k)
            except Exception as exc:
                env[f"kvikio_{k}"] = f"error: {exc}"
        for k in ("is_gds_available", "allow_compat_mode", "major_version", "minor_version"):
            try:
                env[f"cufile_{k}"] = drv.get(k)
            except Exception as exc:
                env[f"cufile_{k}"] = f"error: {exc}"
        try:
            env["libcufile_version"] = drv.libcufile_version()
        except Exception as exc:
            env["libcufile_version"] = f"error: {exc}"
    except Exception as exc:
        env["kvikio"] = f"import failed: {exc}"
    return env


def forced_gds_probe(path: Path) -> str:
    """Open a file with compat mode OFF: succeeds only where cuFile can do real GDS."""
    try:
        import cupy
        import kvikio
        import kvikio.defaults as d

        # The setting takes kvikio.CompatMode, not a string (a string raises TypeError,
        # and the probe would then prove nothing).
        with d.set("compat_mode", kvikio.CompatMode.OFF):
            f = kvikio.CuFile(str(path), "r+")
            buf = cupy.arange(MiB, dtype=cupy.uint8)
            n = f.pwrite(buf, MiB, 0).get()
            f.close()
        return f"compat_mode=OFF worked: wrote {n} B through cuFile (GDS)"
    except Exception as exc:
        return f"compat_mode=OFF refused: {type(exc).__name__}: {exc}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench nvme_gpu")
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--sizes", default="4,16,64,256")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="auto", help="cuda, cpu (a dry run on a CPU host), or auto")
    a = p.parse_args(argv)
    torch = optional("torch", "every nvme_gpu row", "pip install torch")
    if torch is None:
        return 0

    dev = a.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cpu":
            print("no CUDA here: the GPU rows are skipped, the rest run as a CPU dry run")

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    from kvtier.keys import ChunkKey
    from kvtier.tiers.base import SlotRun
    from kvtier.tiers.nvme import EngineKind, Options
    from kvtier.tiers.nvme.engine import IORequest
    from kvtier.tiers.nvme.tier import NVMeTier

    root = scratch_dir("kvtier-nvme-gpu-", a.dir)
    sizes = [int(s) * MiB for s in a.sizes.split(",")]
    cap = 2 * max(sizes)
    slot = 2 * MiB
    env = environment(root)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    (root / "kv").mkdir()
    (root / "px").mkdir()
    tiers: dict[str, Any] = {}
    try:
        if dev != "cuda":
            raise RuntimeError("dry run without CUDA")
        tiers["kvikio"] = NVMeTier(
            TierGeometry("kv", cap, slot, 1 << 40),
            Options(dir=str(root / "kv"), engine=EngineKind.KVIKIO),
        )
        env["engine_compat_mode"] = tiers["kvikio"].engine.compat_mode
        env["engine_gds_available"] = tiers["kvikio"].engine.gds_available
    except Exception as exc:
        errors.append(f"kvikio tier: {type(exc).__name__}: {exc}")
    tiers["posix"] = NVMeTier(
        TierGeometry("px", cap, slot, 1 << 40),
        Options(dir=str(root / "px"), engine=EngineKind.POSIX),
    )
    env["posix_direct"] = all(tiers["posix"].engine.direct)
    env["forced_gds_probe"] = (
        forced_gds_probe(root / "px" / "px.slab0") if "kvikio" in tiers else "skipped"
    )
    src_file, dd_file = root / "dd-src.bin", root / "dd-dst.bin"

    def run_size(nbytes: int) -> None:
        n = nbytes // slot
        gen = torch.Generator(device=dev).manual_seed(nbytes)
        gpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)
        gpu_back = torch.empty_like(gpu)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev == "cuda")
        host = gpu.cpu().numpy()
        src_file.write_bytes(host.tobytes())
        runs = {}
        for name, t in tiers.items():
            (ext,) = t.allocate(n)
            runs[name] = SlotRun(
                ext.offset,
                tuple(ChunkKey((nbytes + i).to_bytes(16, "little")) for i in range(n)),
                slot,
            )

        def kv_write() -> None:
            t = tiers["kvikio"]
            t.engine.write([IORequest(0, runs["kvikio"].offset * slot, nbytes, buffer=gpu)])
            t.engine.sync()

        def kv_read() -> None:
            t = tiers["kvikio"]
            t.engine.read([IORequest(0, runs["kvikio"].offset * slot, nbytes, buffer=gpu_back)])
            sync()

        def kvh_write() -> None:
            tiers["kvikio"].write(runs["kvikio"], host.data)

        host_back = np.empty_like(host)

        def kvh_read() -> None:
            tiers["kvikio"].read(runs["kvikio"], host_back.data)

        def px_write() -> None:
            pinned.copy_(gpu)
            sync()
            tiers["posix"].write(runs["posix"], pinned.numpy().data)

        def px_read() -> None:
            tiers["posix"].read(runs["posix"], pinned.numpy().data)
            gpu_back.copy_(pinned)
            sync()

        def dd_write() -> float:
            from kvtier.bench.nvme import dd_write

            return float(dd_write(src_file, dd_file, nbytes))

        def dd_read() -> float:
            return _dd([f"if={dd_file}", "of=/dev/null", f"bs={nbytes}", "count=1", "iflag=direct"])

        plan: dict[str, Any] = {"posix-bounce:write": px_write, "posix-bounce:read": px_read}
        if "kvikio" in tiers:
            plan.update(
                {
                    "kvikio:write": kv_write,
                    "kvikio:read": kv_read,
                    "kvikio-host:write": kvh_write,
                    "kvikio-host:read": kvh_read,
                }
            )
        times: dict[str, list[float]] = {k: [] for k in [*plan, "dd:write", "dd:read"]}
        for rep in range(a.repeat + 1):
            for op in ("write", "read"):
                d = dd_write() if op == "write" else dd_read()
                if rep:
                    times[f"dd:{op}"].append(d)
                for name, fn in plan.items():
                    if not name.endswith(op):
                        continue
                    try:
                        sync()
                        t0 = time.perf_counter()
                        fn()
                        dt = time.perf_counter() - t0
                    except Exception as exc:
                        errors.append(f"{name} {nbytes}: {type(exc).__name__}: {exc}")
                        continue
                    if rep:
                        times[name].append(dt)
                    if op == "read":  # verify what came back
                        if name.startswith("kvikio-host"):
                            ok = np.array_equal(host_back, host)
                        else:
                            ok = bool(torch.equal(gpu_back, gpu))
                        if not ok:
                            errors.append(f"{name} {nbytes}: bytes differ")
                        gpu_back.zero_()
        for name, ts in times.items():
            if name.startswith("dd") or not ts:
                continue
            path, op = name.split(":")
            base = times[f"dd:{op}"]
            tg = nbytes / float(np.median(ts)) / 1e9
            bg = nbytes / float(np.median(base)) / 1e9
            rows.append(
                {
                    "engine": path,
                    "op": op,
                    "size_bytes": nbytes,
                    "tier_GBps": round(tg, 3),
                    "baseline_GBps": round(bg, 3),
                    "ratio": round(tg / bg, 3),
                    "tier_s": {"median": float(np.median(ts)), "min": min(ts), "max": max(ts)},
                    "baseline_s": {
                        "median": float(np.median(base)),
                        "min": min(base),
                        "max": max(base),
                    },
                    "runs": len(ts),
                }
            )

    try:
        for nbytes in sizes:
            run_size(nbytes)
    finally:
        for t in tiers.values():
            t.close()
        _sh(f"rm -rf {root}")
    print(json.dumps(env, indent=1, default=str))
    for e in errors[:20]:
        print("ERROR", e)
    print(f"{'path':13} {'op':6} {'MiB':>5} {'GB/s':>7} {'dd GB/s':>8} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['engine']:13} {r['op']:6} {r['size_bytes'] // MiB:5d} {r['tier_GBps']:7.3f} "
            f"{r['baseline_GBps']:8.3f} {r['ratio']:6.2f}"
        )
    if a.json:
        from kvtier.bench.common import envelope, write_json

        write_json(
            a.json,
            envelope(
                "nvme_gpu",
                rows,
                environment=env,
                errors=errors,
                slot_bytes=slot,
                host=platform.node(),
                pid=os.getpid(),
            ),
        )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
