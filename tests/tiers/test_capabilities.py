"""Each tier kind offers exactly the capabilities it implements, and says so by type.

The store and the registry ask ``isinstance(tier, SharedTier)`` and the like, never a
flag or a name: a kind that offered a capability it does not implement (or lacked one
it does) would be treated wrongly above it. The base contract carries none of their
methods, so a new tier implements only what it offers.
"""

from __future__ import annotations

import pytest

from kvtier import plugins
from kvtier.config import Switch
from kvtier.tiers.base import PersistentTier, SharedTier, Tier, TierGeometry, ViewableTier
from kvtier.tiers.cxl import CXLTier
from kvtier.tiers.cxl import Options as CXLOptions
from kvtier.tiers.gpu import GPUTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.meta import MetaTier
from kvtier.tiers.nvme.tier import NVMeTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.registry import is_shared_kind

CAPABILITIES = (ViewableTier, PersistentTier, SharedTier)

OFFERS: dict[type[Tier], set[type[Tier]]] = {
    HostTier: {ViewableTier},
    CXLTier: {ViewableTier},
    GPUTier: set(),
    MetaTier: set(),
    NVMeTier: {PersistentTier},
    RedisTier: {SharedTier},
}


@pytest.mark.parametrize("cls", sorted(OFFERS, key=lambda c: c.kind), ids=lambda c: c.kind)
def test_each_kind_offers_what_it_implements(cls: type[Tier]) -> None:
    assert {cap for cap in CAPABILITIES if issubclass(cls, cap)} == OFFERS[cls]
    assert not getattr(cls, "__abstractmethods__", None)  # every method it offers is there


def test_every_builtin_kind_is_covered() -> None:
    assert {cls.kind for cls in OFFERS} == set(plugins.BUILTIN[plugins.TIERS])


def test_the_base_contract_carries_no_capability_or_flag() -> None:
    offered = [
        *("shared", "persistent"),  # the flags these capabilities replace
        *("slot_view", "run_view"),  # ViewableTier
        *("recover", "forget", "commit_forgets"),  # PersistentTier
        *("bind", "probe", "discard"),  # SharedTier
    ]
    assert [name for name in offered if hasattr(Tier, name)] == []


def test_the_registry_asks_for_shared_kinds_by_type() -> None:
    shared = {k for k in plugins.BUILTIN[plugins.TIERS] if is_shared_kind(k)}
    assert shared == {"redis"}


def test_an_emulated_cxl_tier_is_viewable_but_gives_no_view() -> None:
    # An emulated tier injects its latency into every transfer, so it refuses views
    # while keeping the type of the memory tier it stands in for.
    tier = CXLTier(
        TierGeometry("c", 8 * 4096, 4096, 1 << 20),
        CXLOptions(emulate=Switch.ON, pin=Switch.OFF),
    )
    try:
        assert isinstance(tier, ViewableTier) and tier.emulated
        assert tier.slot_view(0, 4096) is None
    finally:
        tier.close()
