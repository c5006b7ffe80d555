"""Trace simulator: replay a workload through the real store, with no KV bytes.

Every tier is a ``meta`` tier (:mod:`kvtier.tiers.meta`): the real
:class:`~kvtier.store.TieredStore` runs its index, allocator, eviction, demotion and
promotion, and the placement policy under test decides, but no bytes move. Each block
of the trace is one chunk; its slot is a 4 KiB stand-in for the chunk's real bytes
(``Economics.chunk_bytes``), and tier capacities are in whole chunks, so every count
the store keeps scales back to real bytes exactly.

Per request the simulator does what an engine connector does: ``lookup`` the prompt's
full blocks, ``get`` the leading hits (lower-tier hits may be promoted), ``put`` the
rest with the hit as its protected ``prefix``. From the store's own counters it reports
per-tier hit rates, bytes written and read per tier, SSD wear; from the tier profiles
and the recompute model, a TTFT per request (load of the hit prefix, then prefill of the
rest on top of it) and the cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.config import PlacementConfig, StoreConfig
from kvtier.errors import InputError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.policy import EvictionFactory, PlacementPolicy, WriteThrough, eviction_factory
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.economics import SECONDS_PER_MONTH, Medium, TierSpec
from kvtier.tiers.meta import MetaTier

from .eviction import ARCEviction, CostAwareEviction
from .placement import CostAwarePlacement, Economics, PlacementStats
from .profiles import Hardware
from .recompute import ModelCompute, Recompute
from .reuse import ReuseStats
from .trace import Trace

STAND_IN_BYTES = 4096
"""Bytes of one simulated slot (one chunk); the store needs a size, the tiers keep none."""

_LIVE_PLACEMENT = PlacementConfig()
_LIVE_STORE = StoreConfig()
"""What a live store does by default; the simulator's ``kvtier`` policy starts from it."""

POLICIES = ("kvtier", "lru-write-through", "arc-write-through")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One configuration to simulate.

    Attributes:
        model: the model (KV bytes, recompute time).
        hardware: GPU and tier specs, fastest first.
        capacities_bytes: bytes of each tier of ``hardware.tiers``; 0 leaves it out.
        policy: ``kvtier`` (cost-aware placement, admission, write budget, cost-aware
            eviction) or a baseline: ``lru-write-through`` / ``arc-write-through``
            (keep everything, demote tier by tier, as the peers do).
        value_of_latency_per_s: $ per second of user waiting, added to GPU time (default:
            the live store's, ``[placement] value_of_latency_per_s``).
        horizon_s: expected stay of a chunk, for its storage cost in placement.
        budget_window_s: write-budget window (one day: the budget is bytes per day; 3600
            paces it per hour).
        promote_on_hit: let the store promote lower-tier hits (placement may decline).
        eviction: eviction order under ``kvtier`` (``cost``: by the placement's reuse
            odds; or a registered name such as ``lru``, ``arc``; default: the live
            store's, ``store.eviction``); baselines use their own.
    """

    model: ModelCompute
    hardware: Hardware
    capacities_bytes: tuple[int, ...]
    policy: str = "kvtier"
    value_of_latency_per_s: float = _LIVE_PLACEMENT.value_of_latency_per_s
    horizon_s: float = 0.0
    budget_window_s: float = _LIVE_PLACEMENT.write_budget_window_s
    promote_on_hit: bool = True
    eviction: str = _LIVE_STORE.eviction

    def __post_init__(self) -> None:
        if len(self.capacities_bytes) != len(self.hardware.tiers):
            raise InputError(
                f"{len(self.capacities_bytes)} capacities for {len(self.hardware.tiers)} tiers "
                f"({', '.join(t.name for t in self.hardware.tiers)})"
            )
        if any(c < 0 for c in self.capacities_bytes):
            raise InputError(f"capacities must be >= 0 bytes, got {self.capacities_bytes}")
        if self.policy not in POLICIES:
            raise InputError(f"policy {self.policy!r}: expected one of {POLICIES}")


@dataclass(frozen=True, slots=True)
class TierResult:
    """What one tier did over the trace (real bytes, scaled from the stand-ins)."""

    name: str
    medium: str
    capacity_bytes: int
    hit_chunks: int
    hit_rate: float
    bytes_written: float
    bytes_read: float
    writes_per_day: float
    wear_pct_per_year: float | None
    cost_per_month: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of one simulation."""

    trace: str
    policy: str
    requests: int
    chunks: int
    hit_chunks: int
    hit_rate: float
    token_hit_rate: float
    tiers: tuple[TierResult, ...]
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    recompute_ttft_p50_s: float
    recompute_ttft_p99_s: float
    gpu_prefill_s: float
    storage_cost_per_month: float
    gpu_cost_per_month: float
    cost_per_month: float
    ssd_bytes_written: float
    ssd_wear_pct_per_year: float | None
    wall_s: float
    cpu_s: float
    requests_per_s: float
    placement: PlacementStats | None
    reuse: ReuseStats | None
    ttft_s: npt.NDArray[Any] = field(repr=False, compare=False)


def chunk_recompute_s(trace: Trace, rc: Recompute) -> float:
    """Mean seconds to recompute one block, over the positions blocks take in the trace."""
    bt = trace.block_tokens
    positions: list[int] = []
    for r in trace.requests[:: max(len(trace.requests) // 2000, 1)]:
        positions.extend(range(0, len(trace.full_blocks(r)) * bt, bt))
    if not positions:
        return rc.chunk_s(bt, 0)
    pos = np.asarray(positions, dtype=np.float64)
    # prefill_s is linear + quadratic in position: average it exactly over the sample.
    return float(np.mean([rc.chunk_s(bt, int(p)) for p in pos[:: max(len(pos) // 4000, 1)]]))


def cost_eviction(placement: CostAwarePlacement) -> EvictionFactory:
    """Cost-aware eviction scored by the placement's reuse odds (benefit per byte)."""
    probability = placement.tracker.probability

    def score(key: ChunkKey, nbytes: int, hits: int) -> float:
        return probability(key)

    return CostAwareEviction.with_score(score)


def key_of(block: int) -> ChunkKey:
    return ChunkKey(block.to_bytes(16, "little", signed=False))


def build(
    cfg: SimConfig, trace: Trace, clock: Callable[[], float]
) -> tuple[TieredStore, list[TierSpec], PlacementPolicy]:
    """The store and policy of one configuration (tiers with capacity 0 left out)."""
    chunk_bytes = cfg.model.kv.chunk_bytes(trace.block_tokens)
    specs: list[TierSpec] = []
    tiers: list[MetaTier] = []
    caps: list[int] = []
    for spec, cap in zip(cfg.hardware.tiers, cfg.capacities_bytes, strict=True):
        slots = int(cap // chunk_bytes)
        if slots < 1:
            continue
        specs.append(spec)
        caps.append(slots * chunk_bytes)
        geometry = TierGeometry(spec.name, slots * STAND_IN_BYTES, STAND_IN_BYTES, 1 << 40)
        tiers.append(MetaTier(geometry, spec.to_tier_profile()))
    if not tiers:
        raise InputError(f"no tier has room for one chunk of {chunk_bytes} B; raise the capacities")
    placement, eviction = make_policies(cfg, trace, specs, caps, clock, STAND_IN_BYTES)
    store = TieredStore(
        tiers,
        eviction=eviction,
        placement=placement,
        io_threads=0,
        promote_on_hit=cfg.promote_on_hit,
    )
    return store, specs, placement


def make_policies(
    cfg: SimConfig,
    trace: Trace,
    specs: Sequence[TierSpec],
    caps: Sequence[int],
    clock: Callable[[], float],
    stored_bytes: int,
) -> tuple[PlacementPolicy, EvictionFactory]:
    """The placement policy and eviction factory of ``cfg.policy`` for these tiers, whose
    chunks are ``stored_bytes`` long in the store (stand-ins of the model's chunks)."""
    if cfg.policy == "kvtier":
        rc = Recompute(cfg.model, cfg.hardware.gpu)
        econ = Economics(
            chunk_bytes=cfg.model.kv.chunk_bytes(trace.block_tokens),
            recompute_s=chunk_recompute_s(trace, rc),
            value_per_s=rc.cost_per_s + cfg.value_of_latency_per_s,
            horizon_s=cfg.horizon_s,
            window_s=cfg.budget_window_s,
        )
        placement = CostAwarePlacement(
            specs, caps, econ, clock=clock, bytes_per_stored_byte=econ.chunk_bytes / stored_bytes
        )
        if cfg.eviction == "cost":
            return placement, cost_eviction(placement)
        return placement, _eviction(cfg.eviction)
    name = "arc" if cfg.policy.startswith("arc") else "lru"
    return WriteThrough(), _eviction(name)


def _eviction(name: str) -> EvictionFactory:
    # The simulator's own orders need no composed names (a caller of simulate() need not
    # have called kvtier.policies.compose); any other name resolves as a store's would.
    return ARCEviction if name == "arc" else eviction_factory(name)


def simulate(cfg: SimConfig, trace: Trace) -> SimResult:
    """Replay ``trace`` through the real store under ``cfg``. Deterministic."""
    now = [trace.requests[0].t_s if trace.requests else 0.0]
    store, specs, placement = build(cfg, trace, lambda: now[0])
    rc = Recompute(cfg.model, cfg.hardware.gpu)
    bt = trace.block_tokens
    chunk_bytes = cfg.model.kv.chunk_bytes(bt)
    max_blocks = max((len(r.blocks) for r in trace.requests), default=1)
    scratch = np.zeros(max(max_blocks, 1) * STAND_IN_BYTES, dtype=np.uint8)
    view = scratch.data
    names = [s.name for s in specs]
    index_of = {n: i for i, n in enumerate(names)}
    ttft = np.empty(len(trace.requests))
    base = np.empty(len(trace.requests))
    load_s = [[s.load_time_s(k * chunk_bytes, k) for k in range(max_blocks + 1)] for s in specs]
    chunks = hit_tokens = tokens = 0
    gpu_s = 0.0
    t0 = time.perf_counter()
    c0 = time.process_time()
    try:
        for i, r in enumerate(trace.requests):
            now[0] = r.t_s
            keys = [key_of(b) for b in trace.full_blocks(r)]
            n = len(keys)
            hits = 0
            per_tier = [0] * len(specs)
            if n:
                lr = store.lookup(keys)
                hits = lr.hits
                for name in lr.tiers:
                    per_tier[index_of[name]] += 1
                if hits:
                    store.get(keys[:hits], view[: hits * STAND_IN_BYTES]).result()
                if hits < n:
                    store.put(
                        keys[hits:], view[: (n - hits) * STAND_IN_BYTES], prefix=keys[:hits]
                    ).result()
            cached = min(hits * bt, r.input_tokens)
            compute = rc.prefill_s(r.input_tokens, cached)
            load = sum(load_s[t][k] for t, k in enumerate(per_tier) if k)
            ttft[i] = load + compute
            base[i] = rc.prefill_s(r.input_tokens, 0)
            gpu_s += compute
            chunks += n
            hit_tokens += cached
            tokens += r.input_tokens
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        st = store.stats()
    finally:
        store.close()
    res = _result(
        cfg, trace, specs, st, chunk_bytes, chunks, hit_tokens, tokens, gpu_s, ttft, base, wall, rc
    )
    res = replace(res, cpu_s=cpu)
    if isinstance(placement, CostAwarePlacement):
        res = replace(res, placement=placement.stats(), reuse=placement.tracker.stats())
    return res


def _result(
    cfg: SimConfig,
    trace: Trace,
    specs: Sequence[TierSpec],
    st: object,
    chunk_bytes: int,
    chunks: int,
    hit_tokens: int,
    tokens: int,
    gpu_s: float,
    ttft: npt.NDArray[Any],
    base: npt.NDArray[Any],
    wall: float,
    rc: Recompute,
) -> SimResult:
    from kvtier.store.types import StoreStats

    assert isinstance(st, StoreStats)
    scale = chunk_bytes / STAND_IN_BYTES
    per_month = SECONDS_PER_MONTH / trace.duration_s
    per_day = 86400.0 / trace.duration_s
    hits = dict(st.tier_hits)
    tier_results: list[TierResult] = []
    storage = 0.0
    ssd_written = 0.0
    ssd_wear: float | None = None
    for spec, ts in zip(specs, st.tiers, strict=True):
        cap = ts.capacity_bytes / STAND_IN_BYTES * chunk_bytes
        written = ts.bytes_written * scale
        day = written * per_day
        wear = None
        cost = cap / 1e9 * spec.cost_per_gb_month
        if spec.wears:
            day = written * per_day
            if cfg.policy == "kvtier":
                # A trace shorter than the budget window extrapolates a burst to a whole
                # day; the write budget never lets a day exceed its allowance.
                day = min(day, spec.write_budget_Bps(cap) * 86400.0)
            wear = 100.0 * day * 365.0 / spec.tbw_bytes(cap)
            # Writing faster than the rating wears drives out before the warranty ends:
            # replacements are bought sooner, in proportion.
            cost *= max(1.0, wear / 100.0 * spec.warranty_years)
        if spec.medium is Medium.SSD:
            ssd_written += written
            ssd_wear = (ssd_wear or 0.0) + (wear or 0.0)
        storage += cost
        h = hits.get(spec.name, 0)
        tier_results.append(
            TierResult(
                name=spec.name,
                medium=spec.medium.value,
                capacity_bytes=int(cap),
                hit_chunks=h,
                hit_rate=h / chunks if chunks else 0.0,
                bytes_written=written,
                bytes_read=ts.bytes_read * scale,
                writes_per_day=day,
                wear_pct_per_year=wear,
                cost_per_month=cost,
            )
        )
    gpu_cost = gpu_s * rc.cost_per_s * per_month
    hit_chunks = sum(t.hit_chunks for t in tier_results)
    return SimResult(
        trace=trace.name,
        policy=cfg.policy,
        requests=len(trace.requests),
        chunks=chunks,
        hit_chunks=hit_chunks,
        hit_rate=hit_chunks / chunks if chunks else 0.0,
        token_hit_rate=hit_tokens / tokens if tokens else 0.0,
        tiers=tuple(tier_results),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        ttft_mean_s=float(ttft.mean()),
        recompute_ttft_p50_s=float(np.percentile(base, 50)),
        recompute_ttft_p99_s=float(np.percentile(base, 99)),
        gpu_prefill_s=gpu_s,
        storage_cost_per_month=storage,
        gpu_cost_per_month=gpu_cost,
        cost_per_month=storage + gpu_cost,
        ssd_bytes_written=ssd_written,
        ssd_wear_pct_per_year=ssd_wear,
        wall_s=wall,
        cpu_s=wall,
        requests_per_s=len(trace.requests) / wall if wall > 0 else float("inf"),
        placement=None,
        reuse=None,
        ttft_s=ttft,
    )
