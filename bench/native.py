"""The native core (``kvtier._core``) against the Python reference, in one run.

``kvtier._core`` is optional: where it is not built, the Python allocator, store index
and host tier copies serve instead. This benchmark measures what it buys, both ways in
the same run on the same machine:

* **store** (host tier): two child processes build the same store, one with the native
  core as built, one with ``kvtier._core`` made unimportable (what a machine without a C
  compiler runs; ``kvtier._speedups``, the older C copy helper, stays in both). They take
  turns on the same requests (``--rounds`` turns each, who goes first swapped every
  time; the figures are medians over the turns): the fixed cost of one put, get and delete of a 4 KiB value
  (``bench/host.py``'s ``fixed_costs``: through the I/O thread and inline, warm and with
  the caches evicted first), then put and get of 2-64 MiB at queue depth 1 and 4 against
  a memcpy of the same bytes measured in the same child (``bench/host.py``'s
  ``one_size``, bytes random and verified). Each side's ratio to its own memcpy, and the
  ratio of the two sides, are printed;
* **allocator**: in this process, the native and the reference buddy allocator run the
  same random sequence of run allocations and frees (sizes 1-64 units, 90% occupancy
  churn), interleaved; the extents each hands out must be equal.

Each side's arena is ``--arena-mib`` (512 MiB) and its memcpy baseline rotates over half
as much, so both children fit in a small machine's memory together.

Usage: ``kvtier bench native [--json F] [--repeat N] [--rounds N] [--fixed-rounds N]
[--sizes 2,4,...]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import LineChild, envelope, scratch_dir, write_json

MARK = "@native "
ARENA_MIB = 512
SIZES_MIB = (2, 4, 8, 16, 32, 64)

# The child's first lines: the Python side hides kvtier._core before kvtier is imported.
_HIDE_CORE = "import sys; sys.modules['kvtier._core'] = None\n"
_RUN_CHILD = "from kvtier.bench.native import child; child({arena_mib})\n"


def child(arena_mib: int = ARENA_MIB) -> None:
    """Serve requests from stdin, one JSON line each, on a host-tier store of
    ``arena_mib`` MiB (the memcpy baseline rotates over half as much)."""
    import numpy as np

    from kvtier.alloc import NativeBuddyAllocator
    from kvtier.bench.host import CHUNK, cache_flusher, fixed_costs, one_size
    from kvtier.enums import Switch
    from kvtier.store import TieredStore
    from kvtier.store.native import NativeStoreIndex
    from kvtier.tiers.base import TierGeometry
    from kvtier.tiers.host import HostTier, Options

    def answer(obj: object) -> None:
        print(MARK + json.dumps(obj), flush=True)

    tier = HostTier(
        TierGeometry("host", arena_mib << 20, CHUNK, arena_mib << 20),
        Options(pin=Switch.AUTO, prefault=True),
    )
    store = TieredStore([tier], io_threads=1)
    small = HostTier(TierGeometry("host", 64 << 20, CHUNK, 64 << 20), Options(pin=Switch.OFF))
    inline = TieredStore([small], io_threads=0)
    big = np.empty(arena_mib << 19, dtype=np.uint8)
    big[::4096] = 1  # fault every page in, as the arena is
    flush, _ = cache_flusher()
    rng = np.random.default_rng(0)
    info = {
        "native": NativeStoreIndex is not None and NativeBuddyAllocator is not None,
        "copy_threads": tier.copy_threads,
        "pinned": tier.arena.pinned,
    }
    try:
        answer(info)  # ready
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "info":
                answer(info)
            elif req["op"] == "fixed":
                answer(fixed_costs(store, inline, req["rounds"], flush))
            else:
                rows, ok = one_size(store, big, rng, req["mib"], req["repeat"], flush)
                answer({"rows": rows, "verified": ok})
    finally:
        store.close()
        inline.close()


def _trace(ops: int, capacity: int, seed: int) -> list[tuple[str, int]]:
    """A churn of run allocations (``("a", units)``) and frees (``("f", index)``: the
    index-th live run, counted at that point) that holds the arena near 90% full."""
    rnd = random.Random(seed)
    out: list[tuple[str, int]] = []
    live: list[int] = []
    used = 0
    for _ in range(ops):
        n = rnd.randint(1, 64)
        if live and (used + n > 0.9 * capacity or rnd.random() < 0.4):
            i = rnd.randrange(len(live))
            used -= live.pop(i)
            out.append(("f", i))
        else:
            live.append(n)
            used += n
            out.append(("a", n))
    return out


def _replay(alloc: Any, trace: list[tuple[str, int]]) -> list[Any]:
    """Run ``trace`` on ``alloc``; every run it handed out (None where refused)."""
    live: list[list[Any]] = []
    handed: list[Any] = []
    for op, arg in trace:
        if op == "a":
            run = alloc.allocate_run(arg)
            handed.append(run)
            live.append(run or [])
        else:
            for ext in live.pop(arg):
                alloc.free(ext.offset, ext.units)
    return handed


def allocator_rows(repeat: int, ops: int = 20000) -> tuple[list[dict[str, Any]], bool]:
    """Native against reference allocator on the same churn: seconds per operation."""
    from kvtier.alloc import NativeBuddyAllocator, make_allocator

    if NativeBuddyAllocator is None:
        return [], True
    capacity, max_order = 1 << 14, 6
    trace = _trace(ops, capacity, seed=7)
    same = _replay(make_allocator(capacity, max_order, native=True), trace) == _replay(
        make_allocator(capacity, max_order, native=False), trace
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for native in (True, False):
            alloc = make_allocator(capacity, max_order, native=native)
            t0 = time.perf_counter()
            _replay(alloc, trace)
            times[native].append((time.perf_counter() - t0) / len(trace))
    n_us = statistics.median(times[True]) * 1e6
    p_us = statistics.median(times[False]) * 1e6
    rows = [
        {
            "what": "allocator",
            "ops": len(trace),
            "native_us_per_op": n_us,
            "python_us_per_op": p_us,
            "speedup": p_us / n_us,
            "native_min_us": min(times[True]) * 1e6,
            "native_max_us": max(times[True]) * 1e6,
            "python_min_us": min(times[False]) * 1e6,
            "python_max_us": max(times[False]) * 1e6,
        }
    ]
    return rows, same


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench native")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=9, help="timed runs per store row")
    ap.add_argument("--fixed-rounds", type=int, default=300, help="operations per fixed cost")
    ap.add_argument(
        "--rounds", type=int, default=3, help="turns of each side per request (median taken)"
    )
    ap.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES_MIB)),
        help="comma-separated value sizes in MiB (default: 2 to 64)",
    )
    ap.add_argument(
        "--arena-mib",
        type=int,
        default=ARENA_MIB,
        help="each side's host tier in MiB (at least 5x the largest size: 4 puts in flight)",
    )
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes and 5 * max(sizes) > args.arena_mib:
        ap.error(f"--arena-mib {args.arena_mib} holds no 5 runs of {max(sizes)} MiB")

    alloc, alloc_same = allocator_rows(max(args.repeat, 5))
    if not alloc:
        print("kvtier._core is not built here: nothing to compare (pip install needs a C compiler)")
        return 0

    logs = scratch_dir("kvtier-bench-native-")
    prelude = {"native": "", "python": _HIDE_CORE}
    kids = {
        side: LineChild(
            [sys.executable, "-c", prelude[side] + _RUN_CHILD.format(arena_mib=args.arena_mib)],
            logs / f"{side}.log",
            MARK,
            f"the {side} store",
        )
        for side in ("native", "python")
    }
    try:
        info = {side: kid.ask({"op": "info"}) for side, kid in kids.items()}
        # A side that is not what it claims would make every ratio meaningless.
        assert info["native"]["native"] and not info["python"]["native"], info
        # The sides take turns, several rounds of each request, who goes first swapped
        # every time: drift on a shared machine then hits both alike.
        order = ["native", "python"]
        fixed: dict[str, list[list[dict[str, Any]]]] = {"native": [], "python": []}
        for _ in range(args.rounds):
            order.reverse()
            for side in order:
                fixed[side].append(kids[side].ask({"op": "fixed", "rounds": args.fixed_rounds}))
        sized: dict[str, dict[int, list[dict[str, Any]]]] = {"native": {}, "python": {}}
        for mib in sizes:
            for _ in range(args.rounds):
                order.reverse()
                for side in order:
                    ask = {"op": "size", "mib": mib, "repeat": args.repeat}
                    sized[side].setdefault(mib, []).append(kids[side].ask(ask))
    finally:
        for kid in kids.values():
            kid.close()

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    rows: list[dict[str, Any]] = []
    ok = alloc_same
    for mib in sizes:
        ok &= all(r["verified"] for side in sized.values() for r in side[mib])
        # Row j of every round is the same (op, depth); its medians over the rounds.
        n_rounds = [r["rows"] for r in sized["native"][mib]]
        p_rounds = [r["rows"] for r in sized["python"][mib]]
        for j, first in enumerate(n_rounds[0]):
            n = [rr[j] for rr in n_rounds]
            p = [rr[j] for rr in p_rounds]
            rows.append(
                {
                    "op": first["op"],
                    "queue_depth": first["queue_depth"],
                    "size_bytes": first["size_bytes"],
                    "native_vs_memcpy": med(n, "ratio"),
                    "python_vs_memcpy": med(p, "ratio"),
                    "native_vs_python": med(n, "tier_GBps") / med(p, "tier_GBps"),
                    "native_GBps": [r["tier_GBps"] for r in n],
                    "python_GBps": [r["tier_GBps"] for r in p],
                    "native_memcpy_GBps": [r["baseline_GBps"] for r in n],
                    "python_memcpy_GBps": [r["baseline_GBps"] for r in p],
                }
            )
    fixed_rows = []
    for j, first in enumerate(fixed["native"][0]):
        n = [rr[j] for rr in fixed["native"]]
        p = [rr[j] for rr in fixed["python"]]
        row: dict[str, Any] = {"op": first["op"], "value_bytes": first["value_bytes"]}
        for way in ("io_thread_us", "inline_us", "io_thread_cold_us", "inline_cold_us"):
            row[f"native_{way}"] = med(n, way)
            row[f"python_{way}"] = med(p, way)
            row[f"speedup_{way[:-3]}"] = med(p, way) / med(n, way)
        fixed_rows.append(row)

    print(
        f"native core vs Python reference, host tier through the store "
        f"(median of {args.rounds} turns of {args.repeat} runs each, caches evicted before each, "
        "memcpy measured in each side)"
    )
    print(
        f"{'op':<4} {'qd':>3} {'size':>7} {'native/memcpy':>14} {'python/memcpy':>14} {'native/python':>14}"
    )
    for r in rows:
        print(
            f"{r['op']:<4} {r['queue_depth']:>3} {r['size_bytes'] >> 20:>4} MiB "
            f"{r['native_vs_memcpy']:>14.2f} {r['python_vs_memcpy']:>14.2f} {r['native_vs_python']:>14.2f}"
        )
    print(
        f"fixed cost of one 4 KiB operation (median of {args.rounds} turns of "
        f"{args.fixed_rounds}), microseconds; speedup = python / native"
    )
    print(f"{'op':<7} {'way':<15} {'native':>8} {'python':>8} {'speedup':>8}")
    for f in fixed_rows:
        for way in ("inline", "io_thread", "inline_cold", "io_thread_cold"):
            print(
                f"{f['op']:<7} {way:<15} {f[f'native_{way}_us']:>8.1f} "
                f"{f[f'python_{way}_us']:>8.1f} {f[f'speedup_{way}']:>8.2f}"
            )
    a = alloc[0]
    print(
        f"allocator, {a['ops']} run allocations and frees: native {a['native_us_per_op']:.2f} us/op, "
        f"python {a['python_us_per_op']:.2f} us/op, speedup {a['speedup']:.1f}x; same extents: {alloc_same}"
    )
    worst = min(r["native_vs_memcpy"] for r in rows) if rows else float("nan")
    print(f"verified: {ok}; worst native/memcpy {worst:.2f} (target >= 0.8)")
    write_json(
        args.json,
        envelope(
            "native",
            rows,
            verified=ok,
            fixed_costs=fixed_rows,
            allocator=alloc,
            allocator_same_extents=alloc_same,
            worst_native_vs_memcpy=worst,
            arena_bytes=args.arena_mib << 20,
            children=info,
        ),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
