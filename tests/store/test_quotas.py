"""Quotas in the store: a tenant over its quota loses its own coldest chunks, down the
tiers within its quota there, and never another tenant's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvtier.config import Switch
from kvtier.keys import ChunkKey, tag_key
from kvtier.store import TieredStore
from kvtier.store.policy import LRUEviction
from kvtier.store.quota import Quotas, tenant_tag
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.cxl import CXLTier
from kvtier.tiers.cxl import Options as CXLOptions
from kvtier.tiers.host import HostTier, Options

SLOT = 4096


def key(tenant: str, i: int) -> ChunkKey:
    return tag_key(bytes(4) + i.to_bytes(12, "little"), tenant_tag(tenant))


def store(quotas: Quotas | None) -> TieredStore:
    top = HostTier(
        TierGeometry("top", 8 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
    )
    low = CXLTier(
        TierGeometry("low", 8 * SLOT, SLOT, 1 << 20),
        CXLOptions(emulate=Switch.ON, latency_us=0.0, bandwidth_gbps=1000.0, pin=Switch.OFF),
    )
    return TieredStore([top, low], io_threads=2, promote_on_hit=False, quotas=quotas)


def test_over_its_quota_a_tenant_demotes_then_drops_its_own_coldest() -> None:
    s = store(Quotas({"a": {0: 2 * SLOT, 1: 3 * SLOT}}, {}))
    try:
        value = np.ones(SLOT, dtype=np.uint8)
        for i in range(6):
            assert s.put([key("b", i)], value).result().stored == 1
        for i in range(20):
            assert s.put([key("a", i)], value).result().stored == 1
        s.flush()
        assert s.quota_use() == {
            ("a", "top"): 2 * SLOT,
            ("a", "low"): 3 * SLOT,
            (f"{int.from_bytes(tenant_tag('b'), 'big'):08x}", "top"): 6 * SLOT,
        }
        # a's newest two on top, the three before them below, the rest gone.
        where = [s.lookup([key("a", i)]).tiers for i in range(20)]
        assert where[18:] == [("top",), ("top",)]
        assert where[15:18] == [("low",)] * 3
        assert where[:15] == [()] * 15
        # b, unlimited, written first and so the coldest, is all still on top.
        assert [s.lookup([key("b", i)]).tiers for i in range(6)] == [("top",)] * 6
    finally:
        s.close()


def test_a_run_longer_than_the_quota_keeps_its_head_on_top() -> None:
    s = store(Quotas({}, {0: 2 * SLOT}))
    try:
        keys = [key("c", i) for i in range(5)]
        r = s.put(keys, np.ones(5 * SLOT, dtype=np.uint8)).result()
        assert r.stored == 5
        assert s.lookup(keys).tiers == ("top", "top", "low", "low", "low")
    finally:
        s.close()


class CountingLRU(LRUEviction):
    """LRU that counts the chunks every eviction order offers as victims."""

    offered = 0

    def candidates(self) -> Iterator[ChunkKey]:
        for key in super().candidates():
            CountingLRU.offered += 1
            yield key


def test_a_tenant_over_its_quota_is_not_slowed_by_other_tenants_colder_chunks() -> None:
    # b's 2,000 chunks are all colder than a's. Each of a's puts past its quota must find
    # a's coldest without walking past b's: the victims offered stay a few per put.
    n_b, n_a = 2000, 200
    top = HostTier(
        TierGeometry("top", (n_b + 8) * SLOT, SLOT, 1 << 30),
        Options(pin=Switch.OFF, prefault=False),
    )
    s = TieredStore(
        [top], io_threads=2, eviction=CountingLRU, quotas=Quotas({"a": {0: 4 * SLOT}}, {})
    )
    try:
        value = np.ones(SLOT, dtype=np.uint8)
        for i in range(n_b):
            assert s.put([key("b", i)], value).result().stored == 1
        CountingLRU.offered = 0
        for i in range(n_a):
            assert s.put([key("a", i)], value).result().stored == 1
        assert CountingLRU.offered <= 2 * n_a
        assert [s.lookup([key("a", i)]).tiers for i in range(n_a - 5, n_a)] == [()] + [("top",)] * 4
        assert s.lookup([key("b", i) for i in range(n_b)]).hits == n_b
    finally:
        s.close()


def test_figures_count_per_tenant_and_tier_and_fold_unnamed_tenants() -> None:
    s = store(Quotas({"a": {0: 2 * SLOT}}, {}, also_named=[""]))
    try:
        value = np.ones(SLOT, dtype=np.uint8)
        for i in range(4):  # a's two oldest are evicted from top, down to low
            assert s.put([key("a", i)], value[: SLOT // 2]).result().stored == 1
        for t in ("b", "c"):  # not named: one row
            assert s.put([key(t, 0)], value).result().stored == 1
        s.flush()
        assert s.lookup([key("a", i) for i in range(5)]).hits == 4
        assert s.lookup([key("b", 1)]).hits == 0
        out = np.empty(4 * SLOT, dtype=np.uint8)
        assert s.get([key("a", 3), key("a", 0)], out).result().chunks == 2
        figs = {f.tenant: f for f in s.tenant_figures()}
        assert list(figs) == ["anonymous", "a", "(other)"]
        top, low = figs["a"].tiers
        half = SLOT // 2
        assert (top.tier, low.tier) == ("top", "low")
        assert (top.stored_chunks, top.stored_bytes, top.evicted_chunks) == (4, 4 * half, 2)
        assert (low.stored_chunks, low.stored_bytes, low.evicted_chunks) == (2, 2 * half, 0)
        assert (top.lookup_hit_chunks, low.lookup_hit_chunks) == (2, 2)
        assert figs["a"].lookup_miss_chunks == 1
        assert (top.read_chunks, top.read_bytes) == (1, half)
        assert (low.read_chunks, low.read_bytes) == (1, half)
        assert (top.quota_used_bytes, top.quota_limit_bytes) == (2 * SLOT, 2 * SLOT)
        assert (low.quota_used_bytes, low.quota_limit_bytes) == (2 * SLOT, None)
        other = figs["(other)"]
        assert other.lookup_miss_chunks == 1
        assert (other.tiers[0].stored_chunks, other.tiers[0].quota_used_bytes) == (2, 2 * SLOT)
        assert all(t.stored_chunks == 0 for t in figs["anonymous"].tiers)
    finally:
        s.close()


def test_without_quotas_there_are_no_figures() -> None:
    s = store(None)
    try:
        assert s.put([key("a", 0)], np.ones(SLOT, dtype=np.uint8)).result().stored == 1
        assert s.tenant_figures() == ()
    finally:
        s.close()


def test_a_tenant_named_anonymous_keeps_the_label_and_the_nameless_one_folds() -> None:
    q = Quotas({"anonymous": {}}, {}, also_named=[""])
    assert list(q.labels.values()) == ["anonymous"]
