"""Where a cold store operation spends its time (``kvtier bench host --profile``).

The small rows of ``kvtier bench host`` miss their target by the store's own work, run
with the CPU caches evicted (as after a large copy elsewhere). A sampling profiler
cannot see an operation this short, and a tracing one (cProfile) costs more per call than
the calls themselves, so this wraps a fixed list of the store's functions with a timer
each and runs single-chunk puts, gets and deletes on an inline store (``io_threads=0``:
every call on this thread), evicting the caches before each operation.

Figures are inclusive: a function's time contains that of the functions it calls. The
wrappers add their own cold cost (a few microseconds per call), so an operation's total
here exceeds the fixed cost that ``kvtier bench host`` prints; compare functions with
each other, not sums with that table.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import kvtier.store.store as store_mod
import kvtier.tiers.host as host_mod
from kvtier.enums import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.index import StoreIndex
from kvtier.store.mover import Mover
from kvtier.store.native import NativeStoreIndex
from kvtier.tiers.base import Tier, TierGeometry
from kvtier.tiers.host import HostTier, Options

# The index class the store builds: its hot verbs are C methods where the native core is
# built, so the reference's would never be called there.
INDEX: type[StoreIndex] = StoreIndex if NativeStoreIndex is None else NativeStoreIndex
# The host tier's copies: one native call per run where the core is built (HostTier's
# write and read), else Tier's write and read and the numpy copies.
_COPIES = ((host_mod, "_copy_slots"),) if getattr(host_mod, "_copy_slots", None) else ()

# (owner, attribute), per operation, outermost first. Module functions are looked up by
# their callers at call time, so wrapping the module's attribute reaches those calls.
PROFILED: dict[str, tuple[tuple[Any, str], ...]] = {
    "put": (
        (TieredStore, "put"),
        (store_mod, "check_keys"),
        (store_mod, "_values_of"),
        (Mover, "put"),
        (INDEX, "prepare_store"),
        (Mover, "make_room"),
        (Tier, "allocate"),
        (Mover, "_write_new"),
        (HostTier, "write"),
        (Tier, "write"),
        (host_mod, "copy_in"),
        *_COPIES,
        (INDEX, "add_stored"),
        (INDEX, "complete_store"),
    ),
    "get": (
        (TieredStore, "get"),
        (TieredStore, "_hold_for"),
        (INDEX, "prepare_load"),
        (Mover, "get"),
        (HostTier, "read"),
        (Tier, "read"),
        (host_mod, "copy_out"),
        *_COPIES,
        (INDEX, "complete_load"),
    ),
    "delete": (
        (TieredStore, "delete"),
        (INDEX, "remove"),
        (StoreIndex, "_release_runs"),
        (Tier, "release"),
    ),
}


def _label(owner: Any, name: str) -> str:
    return f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"


@contextmanager
def timed_calls(targets: tuple[tuple[Any, str], ...]) -> Iterator[dict[str, list[int]]]:
    """Wrap ``targets`` with timers while the context lasts; yields label -> durations (ns)."""
    times: dict[str, list[int]] = {}
    saved: list[tuple[Any, str, Any]] = []
    clock = time.perf_counter_ns

    def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(label, []).append(clock() - t0)

        return timed

    try:
        for owner, name in targets:
            # A class's own attribute (None where it inherits it: the native index's
            # verbs), so restoring puts back exactly what was there.
            original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, original))
            setattr(owner, name, wrap(getattr(owner, name), _label(owner, name)))
        yield times
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def cold_profile(
    flush: Callable[[], object], *, rounds: int = 40, value_bytes: int = 2 << 20
) -> list[dict[str, Any]]:
    """Rows ``{op, function, calls_per_op, median_us}`` of cold single-chunk operations."""
    tier = HostTier(
        TierGeometry("host", 16 * value_bytes, value_bytes, 16 * value_bytes),
        Options(pin=Switch.OFF, prefault=True),
    )
    st = TieredStore([tier], io_threads=0)
    src = np.random.default_rng(3).integers(0, 256, size=value_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    ops: dict[str, Callable[[list[ChunkKey]], object]] = {
        "put": lambda k: st.put(k, src).result(),
        "get": lambda k: st.get(k, dst).result(),
        "delete": lambda k: st.delete(k),
    }
    warm = 5
    samples: dict[tuple[str, str], list[int]] = {}
    try:
        for r in range(rounds + warm):
            key = [ChunkKey(b"profile!" + r.to_bytes(8, "little"))]
            for op, run in ops.items():
                flush()
                with timed_calls(PROFILED[op]) as times:
                    run(key)
                if r < warm:
                    continue
                for label, ns in times.items():
                    samples.setdefault((op, label), []).append(sum(ns))
                    samples.setdefault((op, label + "#calls"), []).append(len(ns))
        if not np.array_equal(dst, src):
            raise RuntimeError("the profiled get returned other bytes than the put stored")
    finally:
        st.close()
    rows = []
    for op, targets in PROFILED.items():
        for owner, name in targets:
            label = _label(owner, name)
            if (op, label) not in samples:
                continue  # not called on this path (e.g. no room to make)
            rows.append(
                {
                    "op": op,
                    "function": label,
                    "calls_per_op": statistics.median(samples[(op, label + "#calls")]),
                    "median_us": round(statistics.median(samples[(op, label)]) / 1e3, 1),
                }
            )
    return rows


def print_profile(rows: list[dict[str, Any]], value_bytes: int) -> None:
    print(
        f"where a cold {value_bytes >> 10} KiB operation's time goes (inline store, caches "
        "evicted first; inclusive microseconds, wrappers included):"
    )
    for r in rows:
        calls = f" x{r['calls_per_op']:g}" if r["calls_per_op"] != 1 else ""
        print(f"  {r['op']:<7} {r['function']:<38} {r['median_us']:>7.1f}{calls}")
