"""Placement and admission driving the real store: the write budget is never exceeded,
eviction stays atomic, and decisions follow the benefit model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cli.demo import _placement_line
from kvtier.config import Switch
from kvtier.keys import ChunkKey
from kvtier.policies.budget import WriteBudget
from kvtier.policies.eviction import ARCEviction, CostAwareEviction
from kvtier.policies.placement import CostAwarePlacement, Economics
from kvtier.policies.profiles import DDR5_HOST, NVME_GEN5_TLC
from kvtier.policies.reuse import ReuseTracker
from kvtier.store import TieredStore
from kvtier.store.policy import LRUEviction
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.host import HostTier, Options

VALUE = 4096
MAX_EXTENT = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_store(
    host_slots: int,
    ssd_slots: int,
    budget_bytes_per_window: float,
    clock: Clock,
    eviction=LRUEviction,
    window_s: float = 600.0,
):
    """A real two-tier store: host DRAM over a second host arena priced as an SSD."""
    host = HostTier(
        TierGeometry("host", host_slots * VALUE, VALUE, MAX_EXTENT), Options(pin=Switch.OFF)
    )
    ssd = HostTier(
        TierGeometry("ssd", ssd_slots * VALUE, VALUE, MAX_EXTENT), Options(pin=Switch.OFF)
    )
    econ = Economics(chunk_bytes=VALUE, recompute_s=1.0, value_per_s=1.0, window_s=window_s)
    budget = WriteBudget(
        budget_bytes_per_window * 86400.0 / window_s, window_s=window_s, clock=clock
    )
    placement = CostAwarePlacement(
        [DDR5_HOST, replace(NVME_GEN5_TLC, name="ssd")],
        [host_slots * VALUE, ssd_slots * VALUE],
        econ,
        clock=clock,
        budgets={1: budget},
    )
    store = TieredStore([host, ssd], eviction=eviction, placement=placement, io_threads=2)
    return store, placement, budget


def value(i: int) -> np.ndarray:
    return np.full(VALUE, i % 251, dtype=np.uint8)


def replay(store: TieredStore, requests: list[list[int]]) -> None:
    for blocks in requests:
        keys = [key(b) for b in blocks]
        hits = store.lookup(keys).hits
        if hits:
            dst = np.empty(hits * VALUE, dtype=np.uint8)
            got = store.get(keys[:hits], dst).result()
            for j in range(got.chunks):  # never wrong bytes
                assert np.array_equal(dst[j * VALUE : (j + 1) * VALUE], value(blocks[j]))
        if hits < len(keys):
            data = np.concatenate([value(b) for b in blocks[hits:]])
            store.put(keys[hits:], data).result()
        store.flush()


requests_st = st.lists(
    st.tuples(
        st.floats(0.0, 200.0),  # seconds since the previous request
        st.integers(0, 7),  # conversation
        st.integers(1, 6),  # blocks added by this turn
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=requests_st, budget_chunks=st.integers(0, 12))
def test_ssd_writes_never_exceed_the_budget(
    ops: list[tuple[float, int, int]], budget_chunks: int
) -> None:
    clock = Clock()
    window = 600.0
    store, _, budget = make_store(6, 64, budget_chunks * VALUE, clock, window_s=window)
    convs: dict[int, list[int]] = {}
    next_id = 1000
    # (time, cumulative SSD bytes written, of which puts the store had to take)
    written: list[tuple[float, int, float]] = []
    try:
        for dt, conv, add in ops:
            clock.t += dt
            blocks = convs.setdefault(conv, [0])  # block 0: a shared system prompt
            for _ in range(add):
                blocks.append(next_id)
                next_id += 1
            replay(store, [list(blocks)])
            ssd = store.stats().tiers[1]
            written.append((clock.t, ssd.bytes_written, budget.forced_bytes))
            # Demotions write only what the budget granted; a put that overflows the
            # host (a run longer than it) is stored, never refused, and counted.
            assert ssd.bytes_written <= budget.granted_bytes + budget.forced_bytes
        # Every window of the budget's length holds at most its allowance of demotions.
        for i, (t_end, w_end, f_end) in enumerate(written):
            before = [(w, f) for t, w, f in written[:i] if t < t_end - window]
            w0, f0 = before[-1] if before else (0, 0.0)
            assert (w_end - w0) - (f_end - f0) <= budget.allowance_bytes
    finally:
        store.close()


def test_eviction_takes_exactly_what_is_needed_with_every_policy() -> None:
    for factory in (LRUEviction, ARCEviction, CostAwareEviction):
        clock = Clock()
        store, _, _ = make_store(4, 4, 0.0, clock, eviction=factory)
        try:
            replay(store, [[1, 2, 3, 4]])
            assert store.pin([key(i) for i in (1, 2, 3, 4)]) == 4
            # The host is full and pinned: a put still stores, in the ssd (never refused).
            replay(store, [[5, 6, 7, 8]])
            assert store.lookup([key(i) for i in (5, 6, 7, 8)]).tiers == ("ssd",) * 4
            assert store.pin([key(i) for i in (5, 6, 7, 8)]) == 4
            # Nothing evictable anywhere: the put changes nothing.
            res = store.put([key(10), key(11)], np.zeros(2 * VALUE, dtype=np.uint8)).result()
            assert res.stored == 0
            st_ = store.stats()
            assert st_.demoted_chunks == 0 and st_.dropped_chunks == 0
            store.unpin([key(4)])
            # One evictable chunk: exactly one leaves, for the one new chunk that fits.
            res = store.put([key(10), key(11)], np.zeros(2 * VALUE, dtype=np.uint8)).result()
            store.drain()
            st_ = store.stats()
            assert res.stored == 1
            assert st_.demoted_chunks + st_.dropped_chunks == 1
            assert store.lookup([key(i) for i in (1, 2, 3)]).tiers == ("host",) * 3
        finally:
            store.close()


def test_demotes_reused_chunks_and_drops_one_offs() -> None:
    clock = Clock()
    store, placement, _ = make_store(4, 16, 1e12, clock)
    try:
        tracker: ReuseTracker = placement.tracker
        assert tracker.class_probability(1) > 0  # prior before any evidence
        replay(store, [[1, 2, 3, 4], [1, 2, 3, 4]])  # evidence: these are reused
        # Worth keeping below DRAM: p * (1 s recompute) * $1/s beats 4 KiB of wear.
        assert placement.benefit(1, [key(1)]) > 0
        replay(store, [[100, 101, 102, 103]])  # evicts 1..4 from host
        assert store.lookup([key(i) for i in (1, 2, 3, 4)]).tiers == ("ssd",) * 4
    finally:
        store.close()


def _reuse_under_a_spent_budget(store: TieredStore, clock: Clock) -> None:
    """Six conversations of 4 chunks, each asked twice, 10 s apart."""
    for r in range(6):
        clock.t += 10
        replay(store, [[r * 10 + j for j in range(4)], [r * 10 + j for j in range(4)]])


def test_write_budget_of_zero_keeps_ssd_untouched() -> None:
    clock = Clock()
    store, placement, _ = make_store(4, 16, 0.0, clock)
    try:
        _reuse_under_a_spent_budget(store, clock)
        assert store.stats().tiers[1].bytes_written == 0
        assert sum(placement.stats().budget_refusals) > 0
    finally:
        store.close()


def test_the_store_stats_carry_what_placement_decided_and_why() -> None:
    # A spent write budget: the SSD stays empty, and the stats say why (per tier, by
    # reason) with the same figures the policy keeps, so an operator need not guess.
    clock = Clock()
    store, placement, _ = make_store(4, 16, 0.0, clock)
    try:
        _reuse_under_a_spent_budget(store, clock)
        report = {(c.name, c.tier): c for c in store.stats().placement}
        mine = placement.stats()
        assert report["refused_budget_chunks", "ssd"].value == mine.budget_refusals[1] > 0
        assert report["admitted_chunks", "host"].value == mine.admitted[0] > 0
        assert report["demoted_chunks", "ssd"].value == 0
        assert report["dropped_chunks", ""].value == mine.dropped > 0
        assert report["budget_available_bytes", "ssd"].gauge
        assert report["budget_available_bytes", "ssd"].value == 0
        assert ("budget_available_bytes", "host") not in report  # DRAM does not wear
        assert all(c.help for c in report.values())
        # `kvtier demo` prints the same reasons.
        line = _placement_line("cost", store.stats())
        assert f"{mine.budget_refusals[1]} budget" in line and "0 colder" in line
    finally:
        store.close()


def test_a_policy_that_reports_nothing_leaves_the_stats_empty() -> None:
    host = HostTier(TierGeometry("host", 4 * VALUE, VALUE, MAX_EXTENT), Options(pin=Switch.OFF))
    with TieredStore([host], io_threads=0) as store:
        store.put([key(1)], value(1)).result()
        assert store.stats().placement == ()


def test_promotion_from_a_wearing_tier_weighs_the_rewrite() -> None:
    clock = Clock()
    store, placement, _ = make_store(4, 16, 1e12, clock)
    try:
        cheap = Economics(chunk_bytes=VALUE, recompute_s=1.0, value_per_s=0.0)
        keys = [key(1)]
        assert placement.should_promote(1, keys)  # $1/s of time beats 4 KiB of wear
        frugal = CostAwarePlacement(
            [DDR5_HOST, NVME_GEN5_TLC], [4 * VALUE, 16 * VALUE], cheap, clock=clock
        )
        assert not frugal.should_promote(1, keys)  # time is worth nothing: keep it down
    finally:
        store.close()


def _learned_tracker(clock: Clock) -> tuple[ReuseTracker, ChunkKey]:
    """A tracker that has seen one chunk referenced 200 times (class 3: reused nearly
    always) and 300 chunks referenced once, never again (class 1: almost never)."""
    tracker = ReuseTracker(clock=clock, horizon_s=600.0)
    hot = key(10_000)
    for _ in range(200):
        clock.t += 1.0
        tracker.reference([hot])
    tracker.reference([key(20_000 + i) for i in range(300)])
    clock.t += 601.0
    tracker.reference([hot])  # expires the 300 as failures; hot stays in class 3
    return tracker, hot


def test_expected_reuses_chain_the_classes() -> None:
    tracker, hot = _learned_tracker(Clock())
    p3 = tracker.class_probability(3)
    assert p3 >= 0.99
    hits, n = tracker.expected_reuses([hot])
    assert n == 1 and hits == 64.0  # p / (1 - p) = 99, capped
    cold, _ = tracker.expected_reuses([key(30_000)])  # never seen: class 1
    assert cold < 1.0  # class 1 reuses almost never: well under one more hit
    fresh = ReuseTracker(clock=Clock())
    assert fresh.expected_reuses([hot]) == (1.0, 1)  # prior p = 1/2 per class: one more


def test_a_chunk_hit_again_and_again_moves_into_free_room_where_one_hit_would_not_pay() -> None:
    """Promotion weighs the wear of one rewrite against the time it saves. Priced so that
    one hit saves an eighth of the rewrite: into free room (it displaces nothing) a chunk
    hit 200 times moves up on the hits to come, a rarely reused one stays down; into a
    full top tier only the next hit counts (it would evict a chunk whose own hits are
    lost), and the hot chunk stays down too."""
    clock = Clock()
    tracker, hot = _learned_tracker(clock)
    profiles = [DDR5_HOST, replace(NVME_GEN5_TLC, name="ssd")]
    sizes = [4 * VALUE, 16 * VALUE]
    probe = CostAwarePlacement(
        profiles, sizes, Economics(VALUE, recompute_s=1.0, value_per_s=1.0), clock=clock
    )
    rewrite = probe._wear[1] * probe.pressure(1)
    saved_per_hit_per_dollar = probe._load[1] - probe._load[0]
    value_per_s = rewrite / saved_per_hit_per_dollar / 8
    assert rewrite > 0
    assert tracker.class_probability(3) * saved_per_hit_per_dollar * value_per_s < rewrite
    econ = Economics(chunk_bytes=VALUE, recompute_s=1.0, value_per_s=value_per_s)
    placement = CostAwarePlacement(profiles, sizes, econ, tracker=tracker, clock=clock)
    host = HostTier(TierGeometry("host", sizes[0], VALUE, MAX_EXTENT), Options(pin=Switch.OFF))
    ssd = HostTier(TierGeometry("ssd", sizes[1], VALUE, MAX_EXTENT), Options(pin=Switch.OFF))
    with TieredStore([host, ssd], placement=placement, io_threads=0) as store:
        assert store.tiers[0].free_slots == 4
        assert placement.should_promote(1, [hot])
        assert not placement.should_promote(1, [key(30_000)])
        for i in range(4):  # fill the top tier
            store.put([key(40_000 + i)], value(i)).result()
        assert store.tiers[0].free_slots == 0
        assert not placement.should_promote(1, [hot])


def test_placement_for_live_tiers_budgets_the_ssd_only() -> None:
    from kvtier.policies.wiring import placement_for_tiers
    from kvtier.spec import PRESETS
    from kvtier.tiers.base import TierProfile
    from kvtier.tiers.meta import MetaTier

    ssd_profile = TierProfile(80e-6, 14e9, 0.0025, endurance_dwpd=1.0)
    tiers = [
        MetaTier(TierGeometry("host", 64 * VALUE, VALUE, MAX_EXTENT)),
        MetaTier(TierGeometry("ssd", 64 * VALUE, VALUE, MAX_EXTENT), ssd_profile),
    ]
    p = placement_for_tiers(tiers, PRESETS["llama-3-8b"], 256)
    assert set(p.budgets) == {1}
    with TieredStore(tiers, placement=p, io_threads=0) as store:
        keys = [key(i) for i in range(8)]
        assert store.put(keys, np.zeros(8 * VALUE, np.uint8)).result().stored == 8


class RoomView:
    """A store's tiers as placement sees them: free slots, and the next victims."""

    def __init__(self, free: int, coldest: list[ChunkKey]) -> None:
        self.free = free
        self.cold = coldest

    def free_slots(self, tier: int) -> int:
        return self.free

    def coldest(self, tier: int, n: int) -> list[ChunkKey]:
        return self.cold[:n]

    def stored_bytes(self, keys) -> int:
        return len(keys) * BIG


BIG = 64 << 20  # a Llama-3-8B chunk: wear matters at this size


def big_placement(
    clock: Clock, budget_chunks: float, window_s: float = 3600.0, free: int = 1 << 20
) -> CostAwarePlacement:
    # 20 ms of recompute at $0.002/s against the wear of 64 MiB on a 1-DWPD TLC drive:
    # worth an SSD write at a reuse probability above ~0.14 with the budget full.
    econ = Economics(chunk_bytes=BIG, recompute_s=0.02, value_per_s=0.002, window_s=window_s)
    budget = WriteBudget(budget_chunks * BIG * 86400.0 / window_s, window_s=window_s, clock=clock)
    p = CostAwarePlacement(
        [DDR5_HOST, NVME_GEN5_TLC], [BIG, 1 << 50], econ, clock=clock, budgets={1: budget}
    )
    p.bind(RoomView(free, []))
    return p


def test_with_no_evidence_puts_are_admitted_and_victims_demoted() -> None:
    clock = Clock()
    p = big_placement(clock, budget_chunks=0.0)
    # A put is never refused, not even into an SSD with no budget left.
    assert p.admit(1, [key(1)], 4096) and p.admit(0, [key(2)], 4096)
    p = big_placement(clock, budget_chunks=100.0)
    assert p.tracker.class_probability(1) > 0  # a prior, never "worthless"
    assert p.demote_target(0, 2, [key(3)]) == 1


def test_the_write_budget_paces_demotions_and_never_switches_them_off() -> None:
    clock = Clock()
    window = 3600.0
    p = big_placement(clock, budget_chunks=10.0, window_s=window)
    budget = p.budgets[1]
    outcomes = []
    for i in range(10):
        outcomes.append(p.demote_target(0, 2, [key(100 + i)]))
    granted = outcomes.count(1)
    # Pacing: the likeliest victims get the first bytes, and demotion slows down (the
    # price of wear rises as the allowance drains) before the allowance is spent...
    assert 0 < granted < 10 and outcomes[:granted] == [1] * granted
    assert budget.granted_bytes < budget.allowance_bytes
    assert p.pressure(1) > 1.0
    # (what is left goes to victims likelier to be read again), and once the window has passed, demotions resume at full pace.
    clock.t += window + 120.0
    assert p.pressure(1) == 1.0
    assert p.demote_target(0, 2, [key(300)]) == 1
    assert budget.granted_bytes <= 2 * budget.allowance_bytes


def test_a_victim_displaces_only_colder_chunks_below() -> None:
    clock = Clock()
    p = big_placement(clock, budget_chunks=1e6, free=0)
    hot = [key(i) for i in range(4)]
    # Evidence: 4 chunks read again and again within the horizon; 30 one-offs never.
    for _ in range(4):
        clock.t += 10.0
        p.on_miss(hot)
    for i in range(30):
        p.on_miss([key(1000 + i)])
    clock.t += p.tracker.horizon_s + 60.0
    p.on_miss([key(5000)])  # time moves on: the one-offs resolve as not reused
    assert p.tracker.class_probability(3) > p.tracker.class_probability(1)
    # The tier below is full of hot chunks: a one-off victim is dropped, not written.
    p.bind(RoomView(0, hot))
    assert p.demote_target(0, 2, [key(1001)]) is None
    assert p.stats().colder_refusals[1] == 1
    # Below it holds colder one-offs: a hot victim displaces them.
    p.bind(RoomView(0, [key(1002)]))
    assert p.demote_target(0, 2, [hot[0]]) == 1
    # With room below, no comparison: a victim worth its wear goes down.
    p.bind(RoomView(5, [key(1002)]))
    assert p.demote_target(0, 2, [hot[1]]) == 1
