"""NVMe tier through the page cache against plain threaded file I/O of the same bytes.

``kvtier bench nvme_cached [--json F] [--dir D] [--chunks 2] [--chunk-mib 32] [--repeat 21]``

The tier with ``o_direct = "off"`` and ``durability = "none"`` (how a file backend without
fsync stores: LMCache's ``LocalDiskBackend`` and ``fs`` connector), one store with four I/O
threads. A get reads a run of ``--chunks`` chunks of ``--chunk-mib`` MiB from the page
cache into one buffer and checks each chunk's xxh3; a put writes a fresh run (the last
one deleted first). The baseline is what LocalDiskBackend does: one file per chunk,
``readinto`` (or ``write``) on one thread per chunk, no checksum. Both work on files
whose pages are in the page cache, in the same temporary directory, interleaved run by
run; the CPU caches are evicted before every timed call (a read of twice the last-level
cache). After the timed runs, each contender's last get and last put are read back and
compared byte for byte (outside the timing: a compare would cost as much as the read).

So the ratio is what the tier's index, engine and checksum cost over bare reads and
writes of the same bytes from memory. Put ``--dir`` anywhere but the user's data
directory (default: a temporary directory, removed afterwards).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import envelope, interleaved, write_json
from kvtier.bench.host import cache_flusher
from kvtier.enums import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.nvme import EngineKind, Options
from kvtier.tiers.nvme.journal import Durability
from kvtier.tiers.nvme.tier import NVMeTier

MiB = 1 << 20


def run(directory: Path, chunks: int, chunk_bytes: int, repeat: int) -> list[dict[str, Any]]:
    total = chunks * chunk_bytes
    opts = Options(
        dir=str(directory),
        engine=EngineKind.POSIX,
        o_direct=Switch.OFF,
        durability=Durability.NONE,
    )
    tier = NVMeTier(TierGeometry("nvme", 8 * total, chunk_bytes, 1 << 30), opts)
    store = TieredStore([tier], io_threads=4, promote_on_hit=False)
    pool = ThreadPoolExecutor(max_workers=chunks, thread_name_prefix="bench-files")
    try:
        src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        dst = np.empty_like(src)
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(chunks)]
        assert store.put(keys, src).result().stored == chunks
        (directory / "files").mkdir()
        paths = [directory / "files" / f"chunk{i}.bin" for i in range(chunks)]
        for i, p in enumerate(paths):
            p.write_bytes(src[i * chunk_bytes : (i + 1) * chunk_bytes].tobytes())
        batches = itertools.count(1 << 20)
        fresh: list[list[ChunkKey]] = [[]]  # the last put's keys

        def read_file(i: int) -> None:
            with open(paths[i], "rb") as f:
                f.readinto(dst[i * chunk_bytes : (i + 1) * chunk_bytes].data)

        def write_file(i: int) -> None:
            with open(paths[i], "wb") as f:
                f.write(src[i * chunk_bytes : (i + 1) * chunk_bytes].data)

        def tier_get() -> None:
            got = store.get(keys, dst).result()
            assert got.chunks == chunks

        def tier_put() -> None:
            store.delete(fresh[0])
            b = next(batches)
            fresh[0] = [ChunkKey((b * 64 + i).to_bytes(16, "little")) for i in range(chunks)]
            assert store.put(fresh[0], src).result().stored == chunks

        def files_get() -> None:
            list(pool.map(read_file, range(chunks)))

        def files_put() -> None:
            list(pool.map(write_file, range(chunks)))

        flush, _ = cache_flusher()
        rows = []
        for op, mine, theirs in (("get", tier_get, files_get), ("put", tier_put, files_put)):
            s = interleaved({"tier": mine, "files": theirs}, repeat=repeat, warmup=2, before=flush)
            dst[:] = 0
            if op == "get":
                tier_get()
            else:  # what the last timed put left in the tier
                assert store.get(fresh[0], dst).result().chunks == chunks
            verified = bool(np.array_equal(dst, src))
            dst[:] = 0
            files_get()  # after files_put: what it wrote
            verified &= bool(np.array_equal(dst, src))
            rows.append(
                {
                    "op": op,
                    "chunks": chunks,
                    "chunk_bytes": chunk_bytes,
                    "tier_GBps": s["tier"].rate(total) / 1e9,
                    "files_GBps": s["files"].rate(total) / 1e9,
                    "ratio": s["files"].median_s / s["tier"].median_s,
                    "tier_ms": {"median": s["tier"].median_s * 1e3, "min": s["tier"].min_s * 1e3},
                    "files_ms": {
                        "median": s["files"].median_s * 1e3,
                        "min": s["files"].min_s * 1e3,
                    },
                    "verified": verified,
                }
            )
        return rows
    finally:
        pool.shutdown()
        store.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench nvme_cached", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dir", type=Path, help="where the files go (default: a temporary dir)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks per run (default 2)")
    ap.add_argument("--chunk-mib", type=int, default=32, help="MiB per chunk (default 32)")
    ap.add_argument("--repeat", type=int, default=21, help="timed runs per contender")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.chunk_mib < 1 or args.repeat < 1:
        ap.error("--chunks, --chunk-mib and --repeat must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-cached-", dir=args.dir))
    try:
        rows = run(base, args.chunks, args.chunk_mib * MiB, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"nvme tier (page cache, o_direct off, checksums) vs one file per chunk on "
        f"{args.chunks} threads, {args.chunks} x {args.chunk_mib} MiB, median of {args.repeat}"
    )
    print(f"{'op':<4} {'tier GB/s':>10} {'files GB/s':>11} {'ratio':>6} {'verified':>9}")
    for r in rows:
        print(
            f"{r['op']:<4} {r['tier_GBps']:>10.2f} {r['files_GBps']:>11.2f} {r['ratio']:>6.2f}"
            f" {r['verified']!s:>9}"
        )
    write_json(args.json, envelope("nvme_cached", rows))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
