"""Hypothesis stateful test: the store against a dict model, over a two-tier stack."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.config import Switch
from kvtier.keys import ChunkKey, tag_key
from kvtier.store import TieredStore
from kvtier.store.quota import Quotas, tenant_tag
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.cxl import CXLTier
from kvtier.tiers.cxl import Options as CXLOptions
from kvtier.tiers.host import HostTier, Options

SLOT = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def length_of(i: int) -> int:
    return SLOT if i < 100 else 1000


def value(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8)


class StoreMachine(RuleBasedStateMachine):
    """Whatever the store says is present must read back exactly as written."""

    def __init__(self) -> None:
        super().__init__()
        top = HostTier(
            TierGeometry("top", 6 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
        )
        low = CXLTier(
            TierGeometry("low", 10 * SLOT, SLOT, 1 << 20),
            CXLOptions(emulate=Switch.ON, latency_us=0.0, bandwidth_gbps=1000.0, pin=Switch.OFF),
        )
        self.store = TieredStore([top, low], io_threads=3)
        self.written: dict[int, int] = {}  # key id -> value length
        self.pinned: dict[int, int] = {}

    def key(self, i: int) -> ChunkKey:
        return key(i)

    def teardown(self) -> None:
        self.store.close()

    @rule(first=st.integers(0, 40), n=st.integers(1, 9), family=st.sampled_from([0, 1]))
    def put(self, first: int, n: int, family: int) -> None:
        # A key's value never changes (KV of a prefix is fixed): family 0 holds full
        # slots, family 1 short values, so a re-put after eviction writes equal bytes.
        length = length_of(family * 100)
        ids = list(range(family * 100 + first, family * 100 + first + n))
        data = np.concatenate([value(i, length) for i in ids])
        r = self.store.put([self.key(i) for i in ids], data).result()
        assert r.stored + r.present + r.rejected + r.failed == n
        assert r.failed == 0
        for i in ids:
            self.written[i] = length

    @rule(first=st.integers(0, 45), n=st.integers(1, 10), family=st.sampled_from([0, 1]))
    def get(self, first: int, n: int, family: int) -> None:
        ids = list(range(family * 100 + first, family * 100 + first + n))
        dst = np.zeros(n * SLOT, dtype=np.uint8)
        r = self.store.get([self.key(i) for i in ids], dst).result()
        pos = 0
        for j in range(r.chunks):
            i = ids[j]
            length = r.value_bytes[j]
            assert i in self.written and length == self.written[i]
            assert np.array_equal(dst[pos : pos + length], value(i, length)), "wrong bytes served"
            pos += length
        assert pos == r.nbytes

    @rule(first=st.integers(0, 45), n=st.integers(1, 10))
    def lookup_is_a_prefix(self, first: int, n: int) -> None:
        keys = [self.key(i) for i in range(first, first + n)]
        res = self.store.lookup(keys)
        assert 0 <= res.hits <= n
        assert len(res.tiers) == res.hits

    @rule(i=st.integers(0, 45))
    def delete(self, i: int) -> None:
        self.store.delete([self.key(i)])
        self.store.flush()
        assert self.store.lookup([self.key(i)]).hits == 0

    @rule(i=st.integers(0, 45))
    def pin(self, i: int) -> None:
        if self.store.pin([self.key(i)]):
            self.pinned[i] = self.pinned.get(i, 0) + 1

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def pinned_survive_then_unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.pinned)))
        # A pinned chunk is never evicted or moved away (unless deleted explicitly).
        if self.store.lookup([self.key(i)]).hits:
            self.store.unpin([self.key(i)])
        self.pinned[i] -= 1
        if not self.pinned[i]:
            del self.pinned[i]

    @invariant()
    def occupancy_within_capacity(self) -> None:
        st_ = self.store.stats()
        for t in st_.tiers:
            assert 0 <= t.used_bytes <= t.capacity_bytes


# Quotas: two tenants take turns by key; "a" is limited in both tiers, "b" only in the
# top one, so a's chunks go down or away while b's fill the rest.
QUOTAS = {"a": {0: 2 * SLOT, 1: 3 * SLOT}, "b": {0: 3 * SLOT}}


class QuotaStoreMachine(StoreMachine):
    """The same rules with tenants and quotas: also, no tenant's bytes ever pass its
    quota in any tier, whatever ran before."""

    def __init__(self) -> None:
        super().__init__()
        tiers = list(self.store.tiers)
        self.store.close()
        for t in tiers:
            t.close()
        top = HostTier(
            TierGeometry("top", 6 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
        )
        low = CXLTier(
            TierGeometry("low", 10 * SLOT, SLOT, 1 << 20),
            CXLOptions(emulate=Switch.ON, latency_us=0.0, bandwidth_gbps=1000.0, pin=Switch.OFF),
        )
        self.store = TieredStore([top, low], io_threads=3, quotas=Quotas(QUOTAS, {}))

    def key(self, i: int) -> ChunkKey:
        return tag_key(bytes(4) + i.to_bytes(12, "little"), tenant_tag("a" if i % 2 else "b"))

    @invariant()
    def within_quotas(self) -> None:
        self.store.flush()
        names = {"top": 0, "low": 1}
        for (tenant, tier), used in self.store.quota_use().items():
            limit = QUOTAS[tenant].get(names[tier])
            assert limit is None or used <= limit, (tenant, tier, used, limit)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreMachine = StoreMachine.TestCase
QuotaStoreMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestQuotaStoreMachine = QuotaStoreMachine.TestCase
