"""kvtier's placement and admission: price a chunk's place in the hierarchy.

For chunks of ``b`` bytes with reuse probability ``p``, keeping them in tier ``t`` is
worth

    benefit_t = p * (recompute_s - load_s(t)) * value_per_s
              - b * (wear_cost_per_byte(t) + storage_cost_per_byte_s(t) * horizon_s)

and the policy keeps them in the fastest tier with a positive benefit, or drops them.
``p`` comes from :class:`~kvtier.policies.reuse.ReuseTracker` (hit counts, prefix
sharing, ghosts); ``value_per_s`` is what one second of recompute costs (GPU dollars,
plus an optional price on the user's waiting time). Tiers that wear (SSDs) also carry a
:class:`~kvtier.policies.budget.WriteBudget`: a write the budget cannot grant is never
made, whatever the benefit.

Demotion uses the same model (victims go to the fastest lower tier that is worth it
and within budget, or are dropped), and so does promotion (a hit in a lower tier moves
up only if the time saved on the next hits outweighs the wear of writing it back down).

Called under the store's lock: everything here is O(keys) arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from typing_extensions import override

from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.store.policy import PlacementPolicy

from .budget import WriteBudget
from .profiles import TierSpec
from .reuse import ReuseTracker


@dataclass(frozen=True, slots=True)
class Economics:
    """What a chunk is worth: the inputs of the benefit formula.

    Attributes:
        chunk_bytes: bytes of one chunk's KV (the real size, also when a simulation
            stores smaller stand-ins).
        recompute_s: seconds to recompute one chunk (average over context positions).
        value_per_s: $ per second of recompute avoided.
        horizon_s: how long a stored chunk is expected to stay, for its storage cost.
        window_s: write-budget enforcement window (see :class:`WriteBudget`).
    """

    chunk_bytes: int
    recompute_s: float
    value_per_s: float
    horizon_s: float = 0.0
    window_s: float = 86400.0

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ConfigError("placement.chunk_bytes", self.chunk_bytes, "an integer >= 1")
        if self.recompute_s < 0 or self.value_per_s < 0 or self.horizon_s < 0:
            raise ConfigError("placement", self, "non-negative recompute_s, value_per_s, horizon_s")


@dataclass(frozen=True, slots=True)
class PlacementStats:
    """What the policy decided, for reports."""

    admitted: tuple[int, ...]
    refused: tuple[int, ...]
    demoted_to: tuple[int, ...]
    dropped: int
    budget_refusals: tuple[int, ...]
    promotions: int
    promotions_declined: int
    budget_granted_bytes: tuple[float, ...]


@dataclass
class _Counters:
    admitted: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    demoted_to: list[int] = field(default_factory=list)
    budget_refusals: list[int] = field(default_factory=list)
    dropped: int = 0
    promotions: int = 0
    promotions_declined: int = 0


class CostAwarePlacement(PlacementPolicy):
    """Latency-cost placement, admission with a write budget, and promotion.

    Args:
        tiers: one :class:`TierSpec` per store tier, in the store's order.
        capacities_bytes: real bytes of each tier (sizes the write budgets).
        economics: the value of a chunk.
        tracker: reuse evidence; a fresh one when None.
        clock: seconds; trace time in a simulation.
        budgets: explicit budgets per tier index; by default every tier that wears gets
            ``TierSpec.write_budget_Bps(capacity) * 86400`` bytes/day.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        capacities_bytes: Sequence[int],
        economics: Economics,
        *,
        tracker: ReuseTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        budgets: dict[int, WriteBudget] | None = None,
    ) -> None:
        if len(tiers) != len(capacities_bytes):
            raise ConfigError("placement.tiers", len(tiers), f"{len(capacities_bytes)} tier specs")
        self.tiers = tuple(tiers)
        self.econ = economics
        self.tracker = tracker or ReuseTracker(clock=clock)
        self.clock = clock
        if budgets is None:
            budgets = {
                i: WriteBudget(t.write_budget_Bps(cap) * 86400.0, window_s=economics.window_s,
                               clock=clock)
                for i, (t, cap) in enumerate(zip(tiers, capacities_bytes, strict=True))
                if t.wears
            }
        self.budgets = budgets
        b = economics.chunk_bytes
        # Per-tier constants of the benefit formula, per chunk.
        self._gain = [
            max(economics.recompute_s - t.load_time_s(b), 0.0) * economics.value_per_s
            for t in self.tiers
        ]
        self._cost = [
            b * (t.wear_cost_per_byte() + t.storage_cost_per_byte_s() * economics.horizon_s)
            for t in self.tiers
        ]
        self._load = [t.load_time_s(b) for t in self.tiers]
        n = len(self.tiers)
        self._c = _Counters([0] * n, [0] * n, [0] * n, [0] * n)

    # -- the model ------------------------------------------------------------------------

    def benefit(self, tier: int, keys: Sequence[ChunkKey], *, victims: bool = False) -> float:
        """Net $ of keeping ``keys`` in ``tier`` (positive: worth it).

        ``victims``: the keys are being evicted, so their learned victim odds apply.
        """
        if victims:
            p_sum, n = self.tracker.mean_victim_probability(keys)
        else:
            p_sum, n = self.tracker.mean_probability(keys)
        return p_sum * self._gain[tier] - n * self._cost[tier]

    def _place(self, tier: int, keys: Sequence[ChunkKey], *, victims: bool = False) -> bool:
        """Worth it and within the write budget (which is spent when granted)."""
        if self.benefit(tier, keys, victims=victims) <= 0:
            return False
        budget = self.budgets.get(tier)
        if budget is not None and not budget.try_spend(len(keys) * self.econ.chunk_bytes):
            self._c.budget_refusals[tier] += len(keys)
            return False
        return True

    # -- PlacementPolicy ------------------------------------------------------------------

    @override
    def admit(self, tier: int, keys: Sequence[ChunkKey], value_bytes: int) -> bool:
        ok = self._place(tier, keys)
        if ok:
            self._c.admitted[tier] += len(keys)
        else:
            self._c.refused[tier] += len(keys)
        return ok

    @override
    def demote_target(self, tier: int, n_tiers: int, keys: Sequence[ChunkKey]) -> int | None:
        self.tracker.victims(keys)
        for target in range(tier + 1, n_tiers):
            if self._place(target, keys, victims=True):
                self._c.demoted_to[target] += len(keys)
                return target
        self._c.dropped += len(keys)
        self.tracker.dropped(keys)
        return None

    @override
    def on_hit(self, tier: int, keys: Sequence[ChunkKey]) -> None:
        self.tracker.reference(keys)

    @override
    def on_miss(self, keys: Sequence[ChunkKey]) -> None:
        self.tracker.reference(keys)

    @override
    def should_promote(self, tier: int, keys: Sequence[ChunkKey]) -> bool:
        # Promotion moves chunks up (the store's tiers are exclusive); when they are
        # evicted again they are written down again. Worth it when the time saved on
        # the next hits beats the wear of that rewrite.
        p_sum, n = self.tracker.mean_probability(keys)
        saved = p_sum * (self._load[tier] - self._load[0]) * self.econ.value_per_s
        rewrite = n * self.econ.chunk_bytes * self.tiers[tier].wear_cost_per_byte()
        ok = saved > rewrite
        if ok:
            self._c.promotions += n
        else:
            self._c.promotions_declined += n
        return ok

    def stats(self) -> PlacementStats:
        c = self._c
        return PlacementStats(
            admitted=tuple(c.admitted),
            refused=tuple(c.refused),
            demoted_to=tuple(c.demoted_to),
            dropped=c.dropped,
            budget_refusals=tuple(c.budget_refusals),
            promotions=c.promotions,
            promotions_declined=c.promotions_declined,
            budget_granted_bytes=tuple(
                self.budgets[i].granted_bytes if i in self.budgets else 0.0
                for i in range(len(self.tiers))
            ),
        )
