"""Behaviour of the tiered store: demotion, promotion, pins, concurrency, failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.config import Switch
from kvtier.errors import ClosedError, InputError, TierIOError
from kvtier.keys import ChunkKey
from kvtier.store import EventKind, StoreEvent, TieredStore, WriteThrough
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.host import HostTier, Options

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def host(name: str, slots: int) -> HostTier:
    return HostTier(
        TierGeometry(name, slots * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
    )


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.fixture
def two_tier() -> Iterator[TieredStore]:
    store = TieredStore([host("top", 8), host("low", 32)], io_threads=2, promote_on_hit=True)
    yield store
    store.close()


class _LockChecking(WriteThrough):
    """A placement that records whether each hook ran under the store's lock."""

    def __init__(self) -> None:
        self.store: TieredStore | None = None
        self.unlocked: list[str] = []

    def _check(self, hook: str) -> None:
        assert self.store is not None
        if not self.store._index.lock._is_owned():  # type: ignore[attr-defined]
            self.unlocked.append(hook)

    def admit(self, tier: int, keys, value_bytes: int) -> bool:
        self._check("admit")
        return True

    def demote_target(self, tier: int, n_tiers: int, keys) -> int | None:
        self._check("demote_target")
        return super().demote_target(tier, n_tiers, keys)

    def on_hit(self, tier: int, keys) -> None:
        self._check("on_hit")

    def on_miss(self, keys) -> None:
        self._check("on_miss")

    def should_promote(self, tier: int, keys) -> bool:
        self._check("should_promote")
        return True


def test_every_placement_hook_runs_under_the_store_lock() -> None:
    # The contract of kvtier.store.policy: hooks are called under the store's lock (a
    # policy keeps counters and evidence that I/O threads would otherwise race on).
    policy = _LockChecking()
    store = TieredStore(
        [host("top", 2), host("low", 8)], io_threads=2, placement=policy, promote_on_hit=True
    )
    policy.store = store
    try:
        keys = [key(i) for i in range(6)]
        store.put(keys, rand(6 * SLOT)).result()  # admit, then demotions
        store.lookup([key(99)])  # a miss
        low = [k for k in keys if store.lookup([k]).tiers == ("low",)]
        assert low
        assert store.get(low[:1], np.zeros(SLOT, np.uint8)).result().tiers == ("low",)
        store.drain()  # the promotion it decided on
        assert policy.unlocked == []
    finally:
        store.close()


def test_demote_then_promote_on_hit(two_tier: TieredStore) -> None:
    events: list[StoreEvent] = []
    two_tier.add_listener(events.append)
    a, b = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
    da, db = rand(8 * SLOT, 1), rand(8 * SLOT, 2)
    two_tier.put(a, da).result()
    two_tier.put(b, db).result()
    assert set(two_tier.lookup(a).tiers) == {"low"}
    out = np.zeros_like(da)
    r = two_tier.get(a, out).result()
    assert r.chunks == 8 and set(r.tiers) == {"low"} and np.array_equal(out, da)
    two_tier.drain()  # promotion runs after the get, in the background
    # At most half the top tier is promoted at once, head first.
    assert two_tier.lookup(a).tiers[:4] == ("top",) * 4
    kinds = {e.kind for e in events}
    assert {EventKind.STORED, EventKind.DEMOTED, EventKind.PROMOTED} <= kinds
    out_b = np.zeros_like(db)
    assert two_tier.get(b, out_b).result().chunks == 8 and np.array_equal(out_b, db)


def test_sequence_tail_is_evicted_before_head() -> None:
    with TieredStore([host("only", 8)], io_threads=1) as store:
        ks = [key(i) for i in range(8)]
        store.put(ks, rand(8 * SLOT)).result()
        store.put([key(50), key(51)], rand(2 * SLOT, 3)).result()
        # The two newest chunks displaced the sequence's last two, keeping a usable prefix.
        assert store.lookup(ks).hits == 6


def test_pinned_chunks_are_never_evicted() -> None:
    with TieredStore([host("only", 4)], io_threads=1) as store:
        ks = [key(i) for i in range(4)]
        store.put(ks, rand(4 * SLOT)).result()
        assert store.pin(ks) == 4
        r = store.put([key(9)], rand(SLOT, 1)).result()
        assert r.rejected == 1 and r.stored == 0
        assert store.lookup(ks).hits == 4
        store.unpin(ks)
        assert store.put([key(9)], rand(SLOT, 1)).result().stored == 1


def test_bad_sizes_are_input_errors() -> None:
    with TieredStore([host("only", 4)]) as store:
        with pytest.raises(InputError):
            store.put([key(1), key(2)], bytes(3))
        with pytest.raises(InputError):
            store.put([key(1)], bytes(SLOT + 1))
        store.put([key(1)], rand(SLOT)).result()
        with pytest.raises(InputError):
            store.get([key(1)], bytearray(10))
        with pytest.raises(InputError):
            store.get([key(1)], bytes(SLOT))  # read-only destination


def test_closed_store_refuses_calls() -> None:
    store = TieredStore([host("only", 4)])
    store.close()
    store.close()
    with pytest.raises(ClosedError):
        store.lookup([key(1)])


def test_concurrent_puts_and_gets_never_serve_wrong_bytes() -> None:
    with TieredStore([host("top", 16), host("low", 48)], io_threads=4) as store:
        errors: list[str] = []

        def worker(w: int) -> None:
            rng = np.random.default_rng(w)
            for _ in range(60):
                first = int(rng.integers(0, 100))
                n = int(rng.integers(1, 6))
                ids = list(range(first, first + n))
                if rng.random() < 0.5:
                    data = np.concatenate([rand(SLOT, i) for i in ids])
                    store.put([key(i) for i in ids], data).result()
                else:
                    dst = np.zeros(n * SLOT, np.uint8)
                    r = store.get([key(i) for i in ids], dst).result()
                    for j in range(r.chunks):
                        if not np.array_equal(dst[j * SLOT : (j + 1) * SLOT], rand(SLOT, ids[j])):
                            errors.append(f"wrong bytes for chunk {ids[j]}")

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for ts in store.stats().tiers:
            assert ts.used_bytes <= ts.capacity_bytes


class FlakyTier(HostTier):
    """A host tier whose reads fail on demand: the fault a dying device produces."""

    fail_reads = False

    def _read(self, run: SlotRun, dst: memoryview) -> None:
        if self.fail_reads:
            raise TierIOError("injected EIO")
        super()._read(run, dst)


def test_failing_tier_read_is_a_miss_not_an_exception() -> None:
    flaky = FlakyTier(
        TierGeometry("flaky", 8 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
    )
    with TieredStore([flaky], io_threads=1) as store:
        ks = [key(i) for i in range(4)]
        store.put(ks, rand(4 * SLOT)).result()
        flaky.fail_reads = True
        r = store.get(ks, np.zeros(4 * SLOT, np.uint8)).result()
        assert r.chunks == 0
        st = store.stats()
        assert st.tier_errors == 1
        # Chunks that failed to read are never served again.
        assert store.lookup(ks).hits == 0


def test_put_protects_its_prefix_from_its_own_eviction() -> None:
    with TieredStore([host("only", 8)], io_threads=1) as store:
        head = [key(0)]
        store.put(head, rand(SLOT)).result()
        long_tail = [key(i) for i in range(1, 12)]  # longer than the whole store
        r = store.put(long_tail, rand(11 * SLOT, 1), prefix=head).result()
        assert r.stored == 7
        # The head survived, so the stored part of the sequence is reachable.
        assert store.lookup(head + long_tail).hits == 8


def test_duplicate_keys_in_one_put_are_stored_once() -> None:
    with TieredStore([host("only", 8)], io_threads=1) as store:
        r = store.put([key(1), key(1)], rand(2 * SLOT)).result()
        assert (r.stored, r.present) == (1, 1)
        assert store.lookup([key(1)]).value_bytes == (SLOT,)
        store.delete([key(1)])
        assert store.stats().tiers[0].used_bytes == 0


BAD_KEYS = {
    "3 bytes": b"abc",
    "100 bytes": bytes(100),
    "str": "0" * 16,
    "None": None,
}


@pytest.mark.parametrize("bad", list(BAD_KEYS), ids=list(BAD_KEYS))
@pytest.mark.parametrize("method", ["put", "prefix", "get", "lookup", "delete", "pin"])
def test_malformed_keys_are_refused_not_truncated(
    two_tier: TieredStore, method: str, bad: str
) -> None:
    # A persistent tier's journal stores 16-byte keys: a shorter or longer one was
    # padded or truncated, and after a reopen its value was served under a key never put.
    keys = [key(1), BAD_KEYS[bad]]
    calls = {
        "put": lambda: two_tier.put(keys, rand(2 * SLOT)),
        "prefix": lambda: two_tier.put([key(2)], rand(SLOT), prefix=keys),
        "get": lambda: two_tier.get(keys, np.zeros(2 * SLOT, np.uint8)),
        "lookup": lambda: two_tier.lookup(keys),
        "delete": lambda: two_tier.delete(keys),
        "pin": lambda: two_tier.pin(keys),
    }
    with pytest.raises(InputError, match="16 bytes"):
        calls[method]()
    assert two_tier.stats().chunks == 0 and two_tier.stats().puts == 0


def test_a_single_bytes_value_is_not_taken_for_a_sequence_of_keys(two_tier: TieredStore) -> None:
    with pytest.raises(InputError, match="sequence of chunk keys"):
        two_tier.lookup(key(1))


def test_inline_put_and_get_run_on_the_callers_thread(two_tier: TieredStore) -> None:
    ks, data = [key(500 + i) for i in range(4)], rand(4 * SLOT, 5)
    seen: list[str] = []
    two_tier.add_listener(lambda e: seen.append(threading.current_thread().name))
    fut = two_tier.put(ks, data, inline=True)
    assert fut.done() and fut.result().stored == 4
    assert seen and set(seen) == {threading.current_thread().name}
    out = np.zeros_like(data)
    got = two_tier.get(ks, out, inline=True)
    assert got.done() and got.result().chunks == 4 and np.array_equal(out, data)
    two_tier.close()
    with pytest.raises(ClosedError):
        two_tier.get(ks, out, inline=True)


class GatedTier(HostTier):
    """A host tier whose writes wait for a gate: an operation that stays in flight."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _write(self, run: SlotRun, src: memoryview) -> None:
        self.entered.set()
        assert self.gate.wait(30)
        super()._write(run, src)


def test_drain_waits_for_work_in_flight_and_wakes_when_it_ends() -> None:
    tier = GatedTier(
        TierGeometry("gated", 8 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
    )
    store = TieredStore([tier], io_threads=1)
    try:
        fut = store.put([key(1)], rand(SLOT))
        fut.add_done_callback(lambda _: None)  # an I/O thread runs it; nobody waits
        assert tier.entered.wait(30)
        drained = threading.Event()
        waiter = threading.Thread(target=lambda: (store.drain(), drained.set()))
        waiter.start()
        assert not drained.wait(0.2)  # the put is still in flight
        store.get([key(2)], np.empty(SLOT, np.uint8)).result()  # others come and go meanwhile
        assert not drained.is_set()
        tier.gate.set()
        assert drained.wait(30)  # woken when the last operation ended
        waiter.join(30)
        assert fut.result().stored == 1
    finally:
        tier.gate.set()
        store.close()
