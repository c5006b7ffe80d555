"""kvtier's placement: a cache by default, that spends SSD endurance as a budget.

What it does with a chunk (the store asks under its lock):

* **a put** is admitted into the first tier the store offers: with no history yet (a
  fresh daemon, a new prefix) there is nothing to judge, and a cache that refuses what
  it is given is not a cache. A put into a full tier makes room by evicting colder
  chunks; a store whose only tier is an SSD stores what it is given (its writes are
  counted against the write budget, so demotions into it slow down).
* **a victim** of a full tier moves to the first lower tier that (a) has room, or holds
  a colder victim of its own (TinyLFU's rule: the newcomer must be at least as likely
  to be reused as what it would displace), and (b) is worth it:

      p · (recompute_s - load_s(t)) · value_per_s  >  b · wear_cost_per_byte(t) · pressure(t)
                                                      + b · storage_cost_per_byte_s(t) · horizon_s

  and (c) whose write budget grants the bytes. Otherwise it is dropped, and remembered
  in the ghost list: if it comes back, its evidence is intact.
* **a hit** in a lower tier moves up when the time saved on its next hits beats the
  wear of writing it down again (the store's tiers are exclusive).

``p`` comes from :class:`~kvtier.policies.reuse.ReuseTracker`: a prior before any
evidence (never 0), then learned odds per reference class, and for victims the learned
odds that a victim comes back. ``value_per_s`` is GPU dollars per second of recompute
plus the value of the user's waiting (TTFT); see ``docs/cost-model.md`` for the default.

**Pacing.** An SSD's :class:`~kvtier.policies.budget.WriteBudget` is a hard cap (DWPD x
capacity x headroom per window). Under it, ``pressure(t) = 1 / fill`` where ``fill`` is
the share of the window's allowance still unspent: with the budget full, every victim
worth its wear is written; as it drains, only the likelier ones are, so the allowance
lasts through the window and goes to the chunks most likely to be read again, instead
of being spent first-come and then switching demotion off.

Called under the store's lock: everything here is O(keys) arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from typing_extensions import override

from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.store.policy import PlacementPolicy, TierView
from kvtier.store.types import PolicyCount
from kvtier.tiers.economics import TierSpec

from .budget import WriteBudget
from .reuse import ReuseTracker

MIN_FILL = 1e-3
"""Below this share of the allowance left, the pressure stops growing (the cap decides)."""


@dataclass(frozen=True, slots=True)
class Economics:
    """What a chunk is worth: the inputs of the benefit formula.

    Attributes:
        chunk_bytes: bytes of one chunk's KV (the real size, also when a simulation
            stores smaller stand-ins).
        recompute_s: seconds to recompute one chunk (average over context positions).
        value_per_s: $ per second of recompute avoided (GPU time plus user waiting).
        horizon_s: how long a stored chunk is expected to stay, for its storage cost.
        window_s: write-budget window (see :class:`WriteBudget`).
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
    colder_refusals: tuple[int, ...] = ()
    value_refusals: tuple[int, ...] = ()


@dataclass
class _Counters:
    admitted: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    demoted_to: list[int] = field(default_factory=list)
    budget_refusals: list[int] = field(default_factory=list)
    colder_refusals: list[int] = field(default_factory=list)
    value_refusals: list[int] = field(default_factory=list)
    dropped: int = 0
    promotions: int = 0
    promotions_declined: int = 0


class CostAwarePlacement(PlacementPolicy):
    """Cache-like placement with a latency-cost model and a paced SSD write budget.

    Args:
        tiers: one :class:`TierSpec` per store tier, in the store's order.
        capacities_bytes: real bytes of each tier (sizes the write budgets).
        economics: the value of a chunk.
        tracker: reuse evidence; a fresh one when None.
        clock: seconds; trace time in a simulation.
        budgets: explicit budgets per tier index; by default every tier that wears gets
            ``TierSpec.write_budget_Bps(capacity) * 86400`` bytes/day over
            ``economics.window_s``.
        bytes_per_stored_byte: real bytes each byte the store holds stands for; the
            budgets charge real bytes. 1 for a real store; a simulation that stores small
            stand-ins of its chunks gives the ratio.
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
        bytes_per_stored_byte: float = 1.0,
    ) -> None:
        if len(tiers) != len(capacities_bytes):
            raise ConfigError("placement.tiers", len(tiers), f"{len(capacities_bytes)} tier specs")
        self.tiers = tuple(tiers)
        self.econ = economics
        self.tracker = tracker or ReuseTracker(clock=clock)
        self.clock = clock
        if budgets is None:
            budgets = {
                i: WriteBudget(
                    t.write_budget_Bps(cap) * 86400.0, window_s=economics.window_s, clock=clock
                )
                for i, (t, cap) in enumerate(zip(tiers, capacities_bytes, strict=True))
                if t.wears
            }
        self.budgets = budgets
        self._scale = bytes_per_stored_byte
        self._view: TierView | None = None
        b = economics.chunk_bytes
        # Per-tier constants of the benefit formula, per chunk.
        self._gain = [
            max(economics.recompute_s - t.load_time_s(b), 0.0) * economics.value_per_s
            for t in self.tiers
        ]
        self._wear = [b * t.wear_cost_per_byte() for t in self.tiers]
        self._hold = [b * t.storage_cost_per_byte_s() * economics.horizon_s for t in self.tiers]
        self._load = [t.load_time_s(b) for t in self.tiers]
        n = len(self.tiers)
        self._c = _Counters([0] * n, [0] * n, [0] * n, [0] * n, [0] * n, [0] * n)

    @override
    def bind(self, view: TierView) -> None:
        self._view = view

    # -- the model ------------------------------------------------------------------------

    def pressure(self, tier: int) -> float:
        """Price multiplier on ``tier``'s wear: 1 with its budget unspent, 1/fill as it drains."""
        budget = self.budgets.get(tier)
        if budget is None or budget.allowance_bytes <= 0:
            return 1.0
        fill = budget.available() / budget.allowance_bytes
        return 1.0 / max(fill, MIN_FILL)

    def benefit(self, tier: int, keys: Sequence[ChunkKey], *, victims: bool = False) -> float:
        """Net $ of keeping ``keys`` in ``tier`` (positive: worth it), at today's pressure.

        ``victims``: the keys are being evicted, so their learned victim odds apply.
        """
        if victims:
            p_sum, n = self.tracker.mean_victim_probability(keys)
        else:
            p_sum, n = self.tracker.mean_probability(keys)
        cost = self._wear[tier] * self.pressure(tier) + self._hold[tier]
        return p_sum * self._gain[tier] - n * cost

    def _colder_below(self, tier: int, keys: Sequence[ChunkKey]) -> bool:
        """``tier`` has room for ``keys``, or holds victims no likelier to be reused."""
        view = self._view
        if view is None or view.free_slots(tier) >= len(keys):
            return True
        theirs = view.coldest(tier, len(keys))
        if len(theirs) < len(keys):
            return True  # the store decides whether room can be made at all
        mine, _ = self.tracker.mean_victim_probability(keys)
        other, _ = self.tracker.mean_victim_probability(theirs)
        return mine >= other  # a tie goes to the newcomer: it is the more recent

    def _written_bytes(self, keys: Sequence[ChunkKey]) -> float:
        """What moving ``keys`` writes: their values' bytes (a daemon's values need not be
        the model's chunk size), or whole chunks when no store is bound."""
        view = self._view
        if view is None:
            return len(keys) * self.econ.chunk_bytes
        return view.stored_bytes(keys) * self._scale

    # -- PlacementPolicy ------------------------------------------------------------------

    @override
    def admit(self, tier: int, keys: Sequence[ChunkKey], value_bytes: int) -> bool:
        # A put is never refused for lack of history: it goes where the store offers.
        # Its SSD bytes still count against the budget, so demotions slow down.
        budget = self.budgets.get(tier)
        if budget is not None:
            budget.spend(len(keys) * value_bytes * self._scale)
        self._c.admitted[tier] += len(keys)
        return True

    @override
    def demote_target(self, tier: int, n_tiers: int, keys: Sequence[ChunkKey]) -> int | None:
        self.tracker.victims(keys)
        for target in range(tier + 1, n_tiers):
            if not self._colder_below(target, keys):
                self._c.colder_refusals[target] += len(keys)
                continue
            if self.benefit(target, keys, victims=True) <= 0:
                self._c.value_refusals[target] += len(keys)
                continue
            budget = self.budgets.get(target)
            if budget is not None and not budget.try_spend(self._written_bytes(keys)):
                self._c.budget_refusals[target] += len(keys)
                continue
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
        # evicted again they are written down again. Worth it when the time saved beats
        # the wear of that rewrite, at the budget's pressure. Into free room it displaces
        # nothing, so every hit to come is saved (a chunk hit hundreds of times stayed
        # down beside an empty host tier when only the next hit counted); into a full
        # tier it evicts a chunk whose own hits are lost, and the next hit alone is the
        # estimate (`kvtier bench policy`: counting every hit there lowered the hit
        # rate and raised SSD writes at small DRAM).
        view = self._view
        if view is not None and view.free_slots(0) >= len(keys):
            hits, n = self.tracker.expected_reuses(keys)
        else:
            hits, n = self.tracker.mean_probability(keys)
        saved = hits * (self._load[tier] - self._load[0]) * self.econ.value_per_s
        rewrite = n * self._wear[tier] * self.pressure(tier)
        ok = saved > rewrite
        if ok:
            self._c.promotions += n
        else:
            self._c.promotions_declined += n
        return ok

    @override
    def report(self) -> list[PolicyCount]:
        c = self._c
        names = [t.name for t in self.tiers]
        out = [
            PolicyCount(name, float(v), names[i], help=what)
            for name, values, what in (
                ("admitted_chunks", c.admitted, "New chunks written into the tier"),
                ("demoted_chunks", c.demoted_to, "Evicted chunks moved down into the tier"),
                (
                    "refused_colder_chunks",
                    c.colder_refusals,
                    "Evicted chunks kept out of the tier: its own coldest are likelier reused",
                ),
                (
                    "refused_value_chunks",
                    c.value_refusals,
                    "Evicted chunks kept out of the tier: holding them costs more than they save",
                ),
                (
                    "refused_budget_chunks",
                    c.budget_refusals,
                    "Evicted chunks kept out of the tier: its write budget is spent",
                ),
            )
            for i, v in enumerate(values)
        ]
        out += [
            PolicyCount(
                "dropped_chunks", float(c.dropped), help="Evicted chunks no lower tier took"
            ),
            PolicyCount(
                "promoted_chunks",
                float(c.promotions),
                help="Chunks hit below the top tier and moved up",
            ),
            PolicyCount(
                "promotions_declined_chunks",
                float(c.promotions_declined),
                help="Chunks hit below the top tier and left there (not worth the rewrite)",
            ),
        ]
        for i, b in sorted(self.budgets.items()):
            out += [
                PolicyCount(
                    "budget_available_bytes",
                    b.available(),
                    names[i],
                    gauge=True,
                    help="Bytes the tier's write budget allows now",
                ),
                PolicyCount(
                    "budget_allowance_bytes",
                    b.allowance_bytes,
                    names[i],
                    gauge=True,
                    help="Bytes the tier's write budget allows per window",
                ),
                PolicyCount(
                    "budget_granted_bytes",
                    b.granted_bytes,
                    names[i],
                    help="Bytes of demotions the tier's write budget granted",
                ),
            ]
        return out

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
            colder_refusals=tuple(c.colder_refusals),
            value_refusals=tuple(c.value_refusals),
        )
