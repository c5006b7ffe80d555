"""Storage tiers: one narrow contract (:class:`Tier`), one module per kind."""

from kvtier.tiers.base import SlotRun, Tier, TierProfile, TierStats

__all__ = ["SlotRun", "Tier", "TierProfile", "TierStats"]
