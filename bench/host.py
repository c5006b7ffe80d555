"""Host tier put/get through the store against a plain memcpy of the same bytes.

For each extent size (2-64 MiB: one run of 2 MiB chunks, a power of two so it is one
extent), we time ``store.put`` and ``store.get`` (index work, thread hand-off,
allocation and the copy) against ``numpy.copyto`` of the same bytes to or from rotating
places in a large pre-faulted buffer, interleaved in the same run.

Two depths: ``qd1`` waits for each operation before the next (latency-bound: the
hand-off to the I/O thread is not hidden), ``qd4`` keeps four operations in flight, as a
connector saving a request's extents does, against four back-to-back memcpys. The store
runs ONE I/O thread, so qd4 hides hand-off latency but gains no extra cores. Bytes are
random and verified.

Usage: ``kvtier bench host [--json F] [--repeat N]``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.bench.common import envelope, interleaved, write_json
from kvtier.enums import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.host import HostTier, Options

CHUNK = 2 << 20
QD = 4
SIZES_MIB = (2, 4, 8, 16, 32, 64)


def one_size(
    store: TieredStore, big: npt.NDArray[Any], rng: np.random.Generator, mib: int, repeat: int
) -> tuple[list[dict[str, Any]], bool]:
    """Measure put/get of one extent size against memcpy; returns rows and whether bytes verified."""
    rows: list[dict[str, Any]] = []
    ok = True
    n = mib * (1 << 20) // CHUNK
    src = rng.integers(0, 256, size=mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1
    # The baseline copies to and from rotating places in a large pre-faulted
    # buffer, as the tier does in its arena: a copy into one small hot buffer
    # would measure cache bandwidth, not memory bandwidth.
    span = big.size // src.nbytes
    pos = [0]

    def memcpy_in() -> None:
        pos[0] = (pos[0] + 1) % span
        np.copyto(big[pos[0] * src.nbytes : (pos[0] + 1) * src.nbytes], src)

    def memcpy_out() -> None:
        pos[0] = (pos[0] + 1) % span
        np.copyto(dst, big[pos[0] * src.nbytes : (pos[0] + 1) * src.nbytes])

    # Fresh keys for every put, made up front so only the store's work is timed.
    batches = [
        [ChunkKey(b.to_bytes(8, "little") + i.to_bytes(8, "little")) for i in range(n)]
        for b in range(mib * 1000, mib * 1000 + (repeat + 4) * (QD + 1))
    ]
    dsts = [np.ones_like(src) for _ in range(QD)]
    keys: list[ChunkKey] = []

    def put() -> None:
        store.delete(keys)  # a dict pop per key: keeps the arena from filling
        keys[:] = batches.pop()
        r = store.put(keys, src).result()
        assert r.stored == n

    def get() -> None:
        r = store.get(keys, dst).result()
        assert r.chunks == n

    def put4() -> None:
        sets = [batches.pop() for _ in range(QD)]
        futs = [store.put(ks, src) for ks in sets]
        assert all(f.result().stored == n for f in futs)
        store.delete(keys + [k for ks in sets[:-1] for k in ks])
        keys[:] = sets[-1]

    def get4() -> None:
        futs = [store.get(keys, dsts[i]) for i in range(QD)]
        res = [f.result() for f in futs]
        assert all(r.chunks == n for r in res), (res, store.lookup(keys), n)

    def memcpy_in4() -> None:
        for _ in range(QD):
            memcpy_in()

    def memcpy_out4() -> None:
        for i in range(QD):
            pos[0] = (pos[0] + 1) % span
            np.copyto(dsts[i], big[pos[0] * src.nbytes : (pos[0] + 1) * src.nbytes])

    put()
    s = interleaved(
        {
            "put": put,
            "memcpy_in": memcpy_in,
            "get": get,
            "memcpy_out": memcpy_out,
            "put4": put4,
            "memcpy_in4": memcpy_in4,
            "get4": get4,
            "memcpy_out4": memcpy_out4,
        },
        repeat=repeat,
    )
    get()
    ok &= bool(np.array_equal(dst, src))
    get4()  # the memcpy baseline overwrote dsts; load them again to verify
    ok &= all(bool(np.array_equal(d, src)) for d in dsts)
    for b in range(mib * 1000, mib * 1000 + (repeat + 4) * (QD + 1)):
        store.delete(
            [ChunkKey(b.to_bytes(8, "little") + i.to_bytes(8, "little")) for i in range(n)]
        )
    for op, base, depth in (
        ("put", "memcpy_in", 1),
        ("get", "memcpy_out", 1),
        ("put4", "memcpy_in4", QD),
        ("get4", "memcpy_out4", QD),
    ):
        rate = s[op].rate(src.nbytes * depth)
        mem = s[base].rate(src.nbytes * depth)
        rows.append(
            {
                "op": op.rstrip("4"),
                "queue_depth": depth,
                "size_bytes": src.nbytes,
                "tier_GBps": rate / 1e9,
                "baseline_GBps": mem / 1e9,
                "ratio": rate / mem,
                "tier_min_s": s[op].min_s,
                "tier_max_s": s[op].max_s,
                "baseline_min_s": s[base].min_s,
                "baseline_max_s": s[base].max_s,
            }
        )
    return rows, ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench host")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)

    # Prefaulted like the baseline's buffer below: the comparison is of steady-state
    # copies. The arena's default (prefault = false) pays each page's first fault on
    # its first put instead, which this benchmark does not set out to measure.
    tier = HostTier(
        TierGeometry("host", 1 << 30, CHUNK, 1 << 30), Options(pin=Switch.AUTO, prefault=True)
    )
    store = TieredStore([tier], io_threads=1)
    rng = np.random.default_rng(0)
    big = np.empty(1 << 30, dtype=np.uint8)
    big[::4096] = 1  # fault every page in, as the arena is
    rows = []
    ok = True
    try:
        for mib in SIZES_MIB:
            size_rows, size_ok = one_size(store, big, rng, mib, args.repeat)
            rows.extend(size_rows)
            ok &= size_ok
    finally:
        store.close()
    print(
        f"host tier through the store vs numpy memcpy (median of {args.repeat}, interleaved; pinned={tier.arena.pinned})"
    )
    print(f"{'op':<4} {'qd':>3} {'size':>8} {'tier GB/s':>10} {'memcpy GB/s':>12} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['op']:<4} {r['queue_depth']:>3} {r['size_bytes'] >> 20:>5} MiB {r['tier_GBps']:>10.2f} "
            f"{r['baseline_GBps']:>12.2f} {r['ratio']:>6.2f}"
        )
    worst = min(r["ratio"] for r in rows)
    print(
        f"bytes verified: {ok}; worst ratio {worst:.2f} (target >= 0.8: {'PASS' if worst >= 0.8 else 'MISS'})"
    )
    write_json(args.json, envelope("host", rows, verified=ok, worst_ratio=worst, target=0.8))
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
