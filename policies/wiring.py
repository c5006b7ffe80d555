"""Build kvtier's placement for a live store from its tiers' own profiles.

The composition root (CLI, daemon, connector) calls :func:`placement_for_tiers` with the
tiers it built from config, so the policies drive the store in place of the core's
keep-everything default. Each tier's :class:`~kvtier.tiers.base.TierProfile` (latency,
bandwidth, $/GB-month, endurance) becomes a :class:`TierSpec`; a tier with a rated
endurance is treated as an SSD and gets a write budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.spec import KVSpec
from kvtier.tiers.base import Tier

from .placement import CostAwarePlacement, Economics
from .profiles import H200, GPUSpec, Medium, TierSpec
from .recompute import ModelCompute, Recompute


def spec_of(tier: Tier) -> TierSpec:
    """A :class:`TierSpec` from a live tier's profile (p99 latency taken as 2x median)."""
    p = tier.profile
    medium = Medium.SSD if p.endurance_dwpd > 0 else Medium.DRAM
    return TierSpec(
        name=tier.name, medium=medium, latency_s=p.latency_s, p99_latency_s=2 * p.latency_s,
        bandwidth_Bps=p.bandwidth_Bps, half_bandwidth_bytes=128 * 1024,
        cost_per_gb_month=p.cost_per_gb_month, endurance_dwpd=p.endurance_dwpd,
    )


def placement_for_tiers(
    tiers: Sequence[Tier],
    kv: KVSpec,
    chunk_tokens: int,
    *,
    model: ModelCompute | None = None,
    gpu: GPUSpec = H200,
    context_tokens: int = 8192,
    value_of_latency_per_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> CostAwarePlacement:
    """Cost-aware placement for a store over ``tiers``.

    Args:
        tiers: the store's tiers, top first.
        kv: the KV geometry (chunk bytes).
        chunk_tokens: tokens per chunk.
        model: the model's compute (recompute time); without one, a dense model whose
            active parameters match a Llama-3-8B per KV byte is assumed.
        gpu: the GPU that recomputes.
        context_tokens: a typical position of a chunk, for its recompute time.
        value_of_latency_per_s: $ per second of user waiting, on top of GPU cost.
    """
    if model is None:
        from .recompute import COMPUTE_PRESETS

        base = COMPUTE_PRESETS["llama-3-8b"]
        scale = kv.bytes_per_token / base.kv_bytes_per_token
        model = ModelCompute("assumed", kv, base.active_params * scale, base.layers,
                             base.q_heads, base.d_qk, base.d_v)
    rc = Recompute(model, gpu)
    econ = Economics(
        chunk_bytes=kv.chunk_bytes(chunk_tokens),
        recompute_s=rc.chunk_s(chunk_tokens, context_tokens),
        value_per_s=rc.cost_per_s + value_of_latency_per_s,
    )
    return CostAwarePlacement([spec_of(t) for t in tiers], [t.capacity_bytes for t in tiers],
                              econ, clock=clock)
