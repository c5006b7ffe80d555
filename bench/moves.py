"""Moves between a host tier and the nvme tier under it, against the floor of their parts.

``kvtier bench moves [--json F] [--dir D] [--chunks 2] [--host-mib 256] [--repeat 15]``

The store is the embedded default configuration with its data directory set, as
``kvtier serve`` builds it: a host tier (here ``--host-mib`` MiB, so that it fills) over
an nvme tier under ``<data_dir>/nvme`` (``durability = "sync"``, O_DIRECT where the
filesystem allows it). Two rows, each timed against its floor in the same run, the
rounds interleaved:

* ``demote``: once the host tier is full, every put of a fresh run of ``--chunks``
  chunks (the default model's 32 MiB each) first moves as many of the host tier's
  coldest chunks into nvme, then copies its own values in. Floor: a ``numpy.copyto`` of
  the put's bytes into a pre-faulted buffer (the copy into the host tier) plus a put of
  the same bytes, from page-aligned memory, into a store whose only tier is an
  identical nvme tier (the demotion's disk write, with its checksums and journal).
* ``promote``: a get of a run that lies in nvme, then ``drain()`` while the store moves
  it up into the full host tier, which first moves as many chunks down. A store with
  ``placement = "keep"`` (the default ``cost`` placement does not promote after one
  hit). Floor: a get of as many bytes from the nvme-only store, plus the ``demote``
  floor (the promotion's own copy into the host tier and the demotion it forces).

Ratio = floor / the row's median; 1.0 means a move costs nothing beyond its copies and
disk transfers. Each row also gives the process's CPU time per round (every thread) and
the same ratio over CPU time, which the disk's speed does not blur. After the timed
rounds, runs are read back and compared byte for byte.

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
from collections.abc import Callable, Iterable
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


def _store(base: Path, name: str, host_mib: int, *extra: str) -> TieredStore:
    cfg = load_config(
        None,
        env={},
        overrides=[
            f"service.data_dir={base / name}",
            f"tiers.0.capacity_bytes={host_mib}MiB",
            *extra,
        ],
    )
    return build_store(with_data_dir(cfg)).store


def _alone(base: Path) -> TieredStore:
    """A store whose only tier is the nvme tier ``kvtier serve`` adds (same options)."""
    cfg = load_config(None, env={})
    alone = with_nvme_under(
        dataclasses.replace(cfg, tiers=()), base / "alone" / "nvme", cfg.service.data_capacity_bytes
    )
    return build_store(alone).store


def run(base: Path, chunks: int, host_mib: int, repeat: int) -> list[dict[str, Any]]:
    stores = [
        _store(base, "demote", host_mib),
        _store(base, "promote", host_mib, "store.placement=keep"),
        _alone(base),
    ]
    try:
        return _rounds(*stores, chunks=chunks, repeat=repeat)
    finally:
        for st in stores:
            st.close()


def _on_cpu(cpu: list[float], fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, noting the process's CPU time (every thread's) over each call: contenders
    run one at a time, so that is the call's CPU, whatever the disk's speed."""

    def timed() -> None:
        t = time.process_time()
        fn()
        cpu.append(time.process_time() - t)

    return timed


def _rounds(
    demoting: TieredStore, promoting: TieredStore, alone: TieredStore, *, chunks: int, repeat: int
) -> list[dict[str, Any]]:
    host = demoting.tiers[0]
    chunk_bytes = host.slot_bytes
    nbytes = chunks * chunk_bytes
    src = _aligned(nbytes)
    src[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    ring = _aligned(8 * nbytes)  # the copy's destination rotates, as slots of an arena do
    dst = _aligned(nbytes)
    at = [0]
    # Untimed: fill both host tiers, and put into the promoting store as many runs below
    # them as its rounds will bring up (the two warm-up rounds included).
    host_runs = host.capacity_slots // chunks
    runs = {"demote": 0, "promote": 0, "alone": 0}
    for _ in range(host_runs + 1):
        assert demoting.put(_keys(runs["demote"], chunks), src).result().stored == chunks
        runs["demote"] += 1
    for r in range(host_runs + repeat + 3):
        _stamp(src, r, chunk_bytes)
        assert promoting.put(_keys(r, chunks), src).result().stored == chunks
    first_timed = runs["demote"] + 2  # after interleaved()'s two warm-up rounds

    def demote() -> None:
        _stamp(src, runs["demote"], chunk_bytes)
        assert demoting.put(_keys(runs["demote"], chunks), src).result().stored == chunks
        runs["demote"] += 1

    def promote() -> None:
        got = promoting.get(_keys(runs["promote"], chunks), dst).result()
        assert got.chunks == chunks and "nvme" in got.tiers, got
        promoting.drain()  # the promotion, and the demotion it forces
        runs["promote"] += 1

    def copy() -> None:
        at[0] = (at[0] + 1) % 8
        np.copyto(ring[at[0] * nbytes : (at[0] + 1) * nbytes], src)

    def nvme_put() -> None:
        assert alone.put(_keys(runs["alone"], chunks), src).result().stored == chunks
        runs["alone"] += 1

    def nvme_get() -> None:
        assert alone.get(_keys(runs["alone"] - 1, chunks), dst).result().chunks == chunks

    cpu: dict[str, list[float]] = {k: [] for k in ("demote", "promote", "copy", "put", "get")}
    s = interleaved(
        {
            "demote": _on_cpu(cpu["demote"], demote),
            "promote": _on_cpu(cpu["promote"], promote),
            "copy": _on_cpu(cpu["copy"], copy),
            "put": _on_cpu(cpu["put"], nvme_put),
            "get": _on_cpu(cpu["get"], nvme_get),
        },
        repeat=repeat,
    )
    wall = {k: v.median_s * 1e3 for k, v in s.items()}
    cpu_ms = {k: statistics.median(v[-repeat:]) * 1e3 for k, v in cpu.items()}
    floors = {
        "demote": ("copy", "put"),
        "promote": ("get", "copy", "put"),
    }

    def verified(store: TieredStore, which: Iterable[int]) -> bool:
        """Runs ``which`` read back from ``store`` equal what was put (stamped ``src``)."""
        ok = True
        for r in which:
            got = store.get(_keys(r, chunks), dst).result()
            want = src.copy()
            _stamp(want, r, chunk_bytes)
            ok &= got.chunks == chunks and bool(np.array_equal(dst, want))
        return ok

    checks = {
        # one run in nvme by now, one in host
        "demote": verified(demoting, (first_timed, runs["demote"] - 1)),
        # the promoted ones (in host now) and any sent back down since
        "promote": verified(promoting, range(runs["promote"])),
    }
    nvme = demoting.tiers[1]
    rows = []
    for op, parts in floors.items():
        stats = (demoting if op == "demote" else promoting).stats()
        rows.append(
            {
                "op": op,
                "chunks": chunks,
                "chunk_bytes": chunk_bytes,
                "host_capacity_bytes": host.capacity_slots * chunk_bytes,
                "nvme_direct": isinstance(nvme, NVMeTier) and bool(nvme.engine.direct[0]),
                "moved_chunks": {
                    "demoted": stats.demoted_chunks,
                    "promoted": stats.promoted_chunks,
                },
                "ms": wall[op],
                "floor_ms": {p: wall[p] for p in parts},
                "ratio": sum(wall[p] for p in parts) / wall[op],
                "cpu_ms": cpu_ms[op],
                "floor_cpu_ms": {p: cpu_ms[p] for p in parts},
                "cpu_ratio": sum(cpu_ms[p] for p in parts) / cpu_ms[op],
                "raw": {p: dataclasses.asdict(s[p]) for p in (op, *parts)},
                "verified": checks[op],
            }
        )
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench moves", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent of the scratch folder (default: temp dir)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks per run (default 2)")
    ap.add_argument("--host-mib", type=int, default=256, help="host tier size (default 256)")
    ap.add_argument("--repeat", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.host_mib < 1 or args.repeat < 1:
        ap.error("--chunks, --host-mib and --repeat must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-moves-", dir=args.dir))
    try:
        rows = run(base, args.chunks, args.host_mib, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    r0 = rows[0]
    print(
        f"runs of {r0['chunks']} x {r0['chunk_bytes'] // MiB} MiB, a full "
        f"{r0['host_capacity_bytes'] // MiB} MiB host tier over nvme "
        f"(O_DIRECT: {r0['nvme_direct']}), median of {args.repeat}"
    )
    print(
        f"{'op':<8} {'ms':>7} {'floor ms':>9} {'ratio':>6} {'CPU ms':>7} {'floor CPU':>10} {'ratio':>6}  verified"
    )
    for r in rows:
        print(
            f"{r['op']:<8} {r['ms']:>7.1f} {sum(r['floor_ms'].values()):>9.1f} {r['ratio']:>6.2f}"
            f" {r['cpu_ms']:>7.1f} {sum(r['floor_cpu_ms'].values()):>10.1f} {r['cpu_ratio']:>6.2f}"
            f"  {r['verified']}"
        )
    write_json(args.json, envelope("moves", rows))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
