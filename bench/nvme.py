"""NVMe tier throughput against ``dd`` with O_DIRECT and against aiofiles, and recovery time.

``kvtier bench nvme --json F [--dir D] [--sizes 4,16,64] [--repeat 5]
[--engines posix,kvikio,aiofiles]``

For each transfer size (MiB) the tier writes one run of random chunks (``--slot-mib``
each) and reads it back (bytes verified); ``dd`` moves the same number of bytes with
``oflag=direct conv=notrunc,fdatasync`` / ``iflag=direct`` on the same filesystem,
interleaved run by run so drift on a shared machine hits both alike. The tier writes
with ``durability = "sync"`` (data and journal flushed), the matching dd baseline
flushes too (``conv=fdatasync``). dd's own elapsed time is used (no process start-up).

The ``aiofiles`` row is the straightforward asyncio way, and how LMCache's local disk
backend stores: one file per chunk, ``async with aiofiles.open(...)``, all chunks of a
run gathered at once. To compare like with like it fsyncs each file (the tier's
durability) and its pages are dropped from the page cache before it is read back (the
tier's reads are O_DIRECT). ``vs_aiofiles`` is the tier's speed over that row's.

An engine or baseline whose optional package is missing (kvikio, aiofiles) is skipped
with the reason printed; the rest still run.

Recovery: a tier holding ``--recover-chunks`` small chunks is closed and reopened;
the time to a ready store is reported with and without the start-up verification,
against ``dd`` reading the same slab bytes (the floor of the verifying start-up).

Put ``--dir`` on the real disk (not tmpfs): the point is the device.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import envelope, missing, write_json
from kvtier.keys import ChunkKey
from kvtier.tiers.base import SlotRun, TierGeometry

MiB = 1 << 20
PAR = 4  # parallel dd streams of the second baseline: the tier's io_threads
_DD_RE = re.compile(r"copied, ([0-9.e+-]+) s")


def _dd(args: list[str]) -> float:
    """Run dd; return its own elapsed seconds."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = _DD_RE.search(out.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {out.stderr!r}")
    return float(m.group(1))


def dd_write(src: Path, dst: Path, nbytes: int) -> float:
    """dd's own seconds to write ``nbytes`` of ``src`` into ``dst``, O_DIRECT and flushed."""
    args = [f"if={src}", f"of={dst}", f"bs={nbytes}", "count=1", "oflag=direct"]
    return _dd([*args, "conv=notrunc,fdatasync"])


def _dd_parallel(k: int, make_args: Any) -> float:
    """Run ``k`` dd processes at once (``make_args(i)`` each); the slowest one's own time.

    The fairer disk ceiling for a tier that keeps ``k`` transfers in flight: one dd has
    a single request stream. Process start-up is excluded, which favours dd.
    """
    procs = [
        subprocess.Popen(["dd", *make_args(i)], stderr=subprocess.PIPE, text=True) for i in range(k)
    ]
    worst = 0.0
    for pr in procs:
        _, err = pr.communicate()
        m = _DD_RE.search(err)
        if pr.returncode or not m:
            raise RuntimeError(f"dd failed: {err!r}")
        worst = max(worst, float(m.group(1)))
    return worst


def _keys(base: int, n: int) -> tuple[ChunkKey, ...]:
    return tuple(ChunkKey((base + i).to_bytes(16, "little")) for i in range(n))


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _tier(root: Path, name: str, capacity: int, slot: int, engine: str, **opts: Any) -> Any:
    from kvtier.tiers.nvme import EngineKind, Options
    from kvtier.tiers.nvme.tier import NVMeTier

    d = root / name
    d.mkdir(exist_ok=True)
    return NVMeTier(
        TierGeometry(name, capacity, slot, 1 << 40),
        Options(dir=str(d), engine=EngineKind(engine), **opts),
    )


class AiofilesBaseline:
    """One file per chunk through aiofiles, every chunk of a run gathered at once."""

    def __init__(self, root: Path, slot: int) -> None:
        import aiofiles

        self._aiofiles = aiofiles
        self.root = root
        self.root.mkdir(exist_ok=True)
        self.slot = slot
        self.direct = (False,)  # page cache, dropped before reads (see the module doc)
        self._loop = asyncio.new_event_loop()

    def _paths(self, run: SlotRun) -> list[Path]:
        return [self.root / f"{k.hex()}.bin" for k in run.keys]

    def write(self, run: SlotRun, src: memoryview) -> None:
        self._loop.run_until_complete(self._write(self._paths(run), src))

    async def _write(self, paths: list[Path], src: memoryview) -> None:
        async def one(path: Path, chunk: memoryview) -> None:
            async with self._aiofiles.open(path, "wb") as f:
                await f.write(chunk)
                await f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())

        s = self.slot
        await asyncio.gather(*(one(p, src[i * s : (i + 1) * s]) for i, p in enumerate(paths)))

    def drop_cache(self, run: SlotRun) -> None:
        """Evict the run's files from the page cache, so reads come from the device."""
        for path in self._paths(run):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def read(self, run: SlotRun, dst: memoryview) -> None:
        self._loop.run_until_complete(self._read(self._paths(run), dst))

    async def _read(self, paths: list[Path], dst: memoryview) -> None:
        async def one(i: int, path: Path) -> None:
            async with self._aiofiles.open(path, "rb") as f:
                data = await f.read()
            dst[i * self.slot : (i + 1) * self.slot] = data

        await asyncio.gather(*(one(i, p) for i, p in enumerate(paths)))

    def close(self) -> None:
        self._loop.close()


def _contenders(root: Path, cap: int, slot: int, names: list[str]) -> dict[str, Any]:
    """The tiers (one per engine) and baselines that can run here; the others are skipped
    with their reason printed."""
    from kvtier.tiers.nvme.engine import kvikio_importable, libcuda_loads

    out: dict[str, Any] = {}
    for name in names:
        if name == "kvikio" and not (kvikio_importable() and libcuda_loads()):
            why = "kvikio needs the kvikio package and libcuda (pip install 'kvtier[gds]')"
            print(f"skipping {name}: {why}")
        elif name == "aiofiles":
            if not missing("aiofiles", "the aiofiles rows", "pip install aiofiles"):
                out[name] = AiofilesBaseline(root / "tp-aiofiles", slot)
        elif name == "posix+aes":  # sealed with AES-256-GCM ([encryption]); slots grow
            if not missing("cryptography", "the posix+aes rows", "pip install 'kvtier[crypto]'"):
                from kvtier.crypto import load_master_key

                key_file = root / "master_key"
                load_master_key(key_file, create=True)
                out[name] = _tier(
                    root, "tp-aes", cap * 2, slot + 4096, "posix", encryption_key_file=str(key_file)
                )
        else:
            out[name] = _tier(root, f"tp-{name}", cap, slot, name)
    return out


def throughput(
    root: Path, sizes_mib: list[int], slot: int, repeat: int, engines: list[str]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    cap = max(sizes_mib) * MiB * 2
    tiers = _contenders(root, cap, slot, engines)
    src_file = root / "dd-src.bin"
    dd_file = root / "dd-dst.bin"
    rows: list[dict[str, Any]] = []
    try:
        for size_mib in sizes_mib:
            nbytes = size_mib * MiB
            n = nbytes // slot
            data = rng.integers(0, 256, nbytes, dtype=np.uint8)
            src_file.write_bytes(data.tobytes())  # page-cached source for dd's writes
            dd_write(src_file, dd_file, nbytes)
            runs = {}
            for e, t in tiers.items():
                offset = 0  # the aiofiles baseline names its files by key
                if not isinstance(t, AiofilesBaseline):
                    exts = t.allocate(n)
                    assert exts is not None and len(exts) == 1, "one extent per run"
                    offset = exts[0].offset
                runs[e] = SlotRun(offset, _keys(size_mib << 20, n), slot)
            times: dict[str, list[float]] = {}
            out = np.empty_like(data)
            for rep in range(repeat + 1):  # the first round is a warm-up
                sample: dict[str, float] = {}
                sample["dd:write"] = dd_write(src_file, dd_file, nbytes)
                part = nbytes // PAR
                sample["dd4:write"] = _dd_parallel(
                    PAR,
                    lambda i, part=part: [
                        f"if={src_file}",
                        f"of={dd_file}",
                        f"bs={part}",
                        "count=1",
                        f"skip={i}",
                        f"seek={i}",
                        "oflag=direct",
                        "conv=notrunc,fdatasync",
                    ],
                )
                for e, t in tiers.items():
                    t0 = time.perf_counter()
                    t.write(runs[e], data.data)
                    sample[f"{e}:write"] = time.perf_counter() - t0
                    if isinstance(t, AiofilesBaseline):
                        t.drop_cache(runs[e])
                sample["dd:read"] = _dd(
                    [f"if={dd_file}", "of=/dev/null", f"bs={nbytes}", "count=1", "iflag=direct"]
                )
                sample["dd4:read"] = _dd_parallel(
                    PAR,
                    lambda i, part=part: [
                        f"if={dd_file}",
                        "of=/dev/null",
                        f"bs={part}",
                        "count=1",
                        f"skip={i}",
                        "iflag=direct",
                    ],
                )
                for e, t in tiers.items():
                    out[:] = 0
                    t0 = time.perf_counter()
                    t.read(runs[e], out.data)
                    sample[f"{e}:read"] = time.perf_counter() - t0
                    if not np.array_equal(out, data):
                        raise RuntimeError(f"{e}: bytes read back differ")
                if rep:
                    for k, v in sample.items():
                        times.setdefault(k, []).append(v)
            for e in tiers:
                for op in ("write", "read"):
                    tier_s, base_s = times[f"{e}:{op}"], times[f"dd:{op}"]
                    par_s = times[f"dd4:{op}"]
                    tg, bg = nbytes / _median(tier_s) / 1e9, nbytes / _median(base_s) / 1e9
                    pg = nbytes / _median(par_s) / 1e9
                    rows.append(
                        {
                            "engine": e,
                            "op": op,
                            "size_bytes": nbytes,
                            "tier_GBps": round(tg, 3),
                            "baseline_GBps": round(bg, 3),
                            "ratio": round(tg / bg, 3),
                            "baseline4_GBps": round(pg, 3),
                            "ratio4": round(tg / pg, 3),
                            "baseline4_s": {
                                "median": _median(par_s),
                                "min": min(par_s),
                                "max": max(par_s),
                            },
                            "tier_s": {
                                "median": _median(tier_s),
                                "min": min(tier_s),
                                "max": max(tier_s),
                            },
                            "baseline_s": {
                                "median": _median(base_s),
                                "min": min(base_s),
                                "max": max(base_s),
                            },
                            "runs": repeat,
                            "slot_bytes": slot,
                            "direct": all(_direct(tiers[e])),
                        }
                    )
                    if e == "posix+aes" and "posix" in tiers:
                        plain = nbytes / _median(times[f"posix:{op}"]) / 1e9
                        rows[-1]["vs_posix"] = round(tg / plain, 3)
                    if "aiofiles" in tiers and e != "aiofiles":
                        af = nbytes / _median(times[f"aiofiles:{op}"]) / 1e9
                        rows[-1]["vs_aiofiles"] = round(tg / af, 3)
    finally:
        for t in tiers.values():
            t.close()
        src_file.unlink(missing_ok=True)
        dd_file.unlink(missing_ok=True)
    return rows


def recovery(root: Path, chunks: int, slot: int, repeat: int) -> dict[str, Any]:
    from kvtier.store import TieredStore
    from kvtier.tiers.nvme import Durability

    cap = chunks * slot
    rng = np.random.default_rng(2)
    t = _tier(root, "rec", cap, slot, "posix", durability=Durability.NONE)
    batch = 1024
    try:
        for i in range(0, chunks, batch):
            n = min(batch, chunks - i)
            exts = t.allocate(n)
            assert exts is not None
            pos = 0
            data = rng.integers(0, 256, n * slot, dtype=np.uint8)
            for ext in exts:
                run = SlotRun(ext.offset, _keys(i + pos, ext.units), slot)
                t.write(run, data[pos * slot : (pos + ext.units) * slot].data)
                pos += ext.units
        t.flush()
    finally:
        t.close()
    slab = root / "rec" / "rec.slab0"
    out: dict[str, Any] = {"chunks": chunks, "slot_bytes": slot}
    for verify in (True, False):
        ts: list[float] = []
        got = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            tier = _tier(root, "rec", cap, slot, "posix", verify_on_recover=verify)
            store = TieredStore([tier], io_threads=1)
            ts.append(time.perf_counter() - t0)
            got = store.stats().chunks
            store.close()
        if got != chunks:
            raise RuntimeError(f"recovered {got} of {chunks} chunks")
        out["verify" if verify else "no_verify"] = {
            "median_s": _median(ts),
            "min_s": min(ts),
            "max_s": max(ts),
        }
    dd_s = [
        _dd([f"if={slab}", "of=/dev/null", f"bs={4 * MiB}", "iflag=direct"]) for _ in range(repeat)
    ]
    out["dd_read_slab_s"] = {"median_s": _median(dd_s), "min_s": min(dd_s), "max_s": max(dd_s)}
    out["ratio_verify_vs_dd"] = round(_median(dd_s) / out["verify"]["median_s"], 3)
    return out


def codec_figures(chunk_bytes: int, repeat: int) -> list[dict[str, Any]]:
    """lz4 byte-plane shuffle vs plain lz4 on synthetic KV-like chunks (ratio and speed).

    Synthetic: normal(0, 1) values rounded to bf16 / fp16. No real model KV is
    available on this machine; real KV has more structure (per-channel outliers), so
    these ratios are a floor for bf16, not a promise.
    """
    import lz4.block

    from kvtier import codec

    out = []
    rng = np.random.default_rng(3)
    f32 = rng.normal(0.0, 1.0, chunk_bytes // 2).astype(np.float32)
    samples = {
        "bf16": (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
        "fp16": f32.astype(np.float16).view(np.uint8),
        "random": rng.integers(0, 256, chunk_bytes, dtype=np.uint8),
    }
    for name, data in samples.items():
        plain = len(lz4.block.compress(data.tobytes(), store_size=False))
        enc_s, dec_s = [], []
        enc = codec.encode(data, min_ratio=0.0)
        back = np.empty_like(data)
        for _ in range(repeat):
            t0 = time.perf_counter()
            enc = codec.encode(data, min_ratio=0.0)
            enc_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            codec.decode(enc.codec, enc.payload, back)
            dec_s.append(time.perf_counter() - t0)
        if not np.array_equal(back, data):
            raise RuntimeError("codec round trip differs")
        memcpy = [0.0] * repeat
        for i in range(repeat):
            t0 = time.perf_counter()
            back[:] = data
            memcpy[i] = time.perf_counter() - t0
        out.append(
            {
                "data": name,
                "chunk_bytes": chunk_bytes,
                "ratio_shuffle_lz4": round(data.nbytes / len(enc.payload), 3),
                "ratio_plain_lz4": round(data.nbytes / plain, 3),
                "encode_GBps": round(data.nbytes / _median(enc_s) / 1e9, 3),
                "decode_GBps": round(data.nbytes / _median(dec_s) / 1e9, 3),
                "memcpy_GBps": round(data.nbytes / _median(memcpy) / 1e9, 3),
            }
        )
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench nvme", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default="/var/tmp", help="parent of the bench directory (real disk)")
    p.add_argument("--sizes", default="4,16,64", help="transfer sizes in MiB")
    p.add_argument("--slot-mib", type=float, default=2.0, help="chunk size in MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--engines",
        default="posix,posix+aes,kvikio,aiofiles",
        help="tier engines (posix+aes: posix with encryption at rest), and the aiofiles baseline",
    )
    p.add_argument("--recover-chunks", type=int, default=100_000)
    p.add_argument("--recover-slot", type=int, default=4096)
    p.add_argument("--skip-recovery", action="store_true")
    a = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=a.dir))
    fs = subprocess.run(
        ["df", "-T", str(root)], capture_output=True, text=True
    ).stdout.splitlines()[-1]
    try:
        rows = throughput(
            root,
            [int(s) for s in a.sizes.split(",")],
            int(a.slot_mib * MiB),
            a.repeat,
            a.engines.split(","),
        )
        codec_rows = (
            []
            if missing("lz4", "the codec rows", "pip install 'kvtier[nvme]'")
            else codec_figures(int(a.slot_mib * MiB), a.repeat)
        )
        rec = (
            None
            if a.skip_recovery
            else recovery(root, a.recover_chunks, a.recover_slot, max(3, a.repeat // 2))
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"filesystem: {fs}")
    print(
        f"{'engine':8} {'op':6} {'MiB':>5} {'GB/s':>8} {'dd GB/s':>8} {'ratio':>6}"
        f" {'dd x4 GB/s':>11} {'ratio4':>7} {'vs aiofiles':>11}"
    )
    for r in rows:
        vs = f"{r['vs_aiofiles']:11.2f}" if "vs_aiofiles" in r else f"{'-':>11}"
        if "vs_posix" in r:
            vs += f"  ({r['vs_posix']:.3f}x posix)"
        print(
            f"{r['engine']:8} {r['op']:6} {r['size_bytes'] // MiB:5d} {r['tier_GBps']:8.3f} "
            f"{r['baseline_GBps']:8.3f} {r['ratio']:6.2f} "
            f"{r['baseline4_GBps']:11.3f} {r['ratio4']:7.2f} {vs}"
        )
    if rec:
        print(
            f"recovery of {rec['chunks']} chunks of {rec['slot_bytes']} B: "
            f"{rec['verify']['median_s']:.3f} s verified, "
            f"{rec['no_verify']['median_s']:.3f} s unverified; "
            f"dd reads the slab in {rec['dd_read_slab_s']['median_s']:.3f} s"
        )
    for c in codec_rows:
        print(
            f"codec {c['data']:6}: lz4-shuffle {c['ratio_shuffle_lz4']:.3f}x "
            f"(plain lz4 {c['ratio_plain_lz4']:.3f}x), encode {c['encode_GBps']:.2f} GB/s, "
            f"decode {c['decode_GBps']:.2f} GB/s, memcpy {c['memcpy_GBps']:.2f} GB/s"
        )
    write_json(
        a.json,
        envelope("nvme", rows, recovery=rec, codec=codec_rows, filesystem=fs, shared_machine=True),
    )
    return 0


def _direct(contender: Any) -> tuple[bool, ...]:
    return tuple(
        contender.direct if isinstance(contender, AiofilesBaseline) else contender.engine.direct
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
