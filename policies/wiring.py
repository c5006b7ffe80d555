"""Build kvtier's placement for a live store from its tiers and the ``[placement]`` section.

The composition root (CLI, daemon, connector: through :func:`kvtier.factory.build_store`)
calls :func:`placement_for_tiers` with the tiers it built from config, so the policies
drive the store in place of the core's keep-everything default. Each tier's
:class:`~kvtier.tiers.base.TierProfile` (latency, bandwidth, $/GB-month, endurance)
becomes a :class:`TierSpec`; a tier with a rated endurance is an SSD and gets a write
budget of ``write_budget_dwpd`` drive writes per day.

Budgets are counted in chunks of the model's real size (slots x chunk bytes), as the
simulator counts them, so a store whose slots hold smaller stand-ins (a scaled replay,
a daemon with small values) spends the same share of a tier per chunk as the plan did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtier.config import PlacementConfig
from kvtier.errors import ConfigError, SpecError
from kvtier.spec import KVSpec
from kvtier.tiers.base import Tier
from kvtier.tiers.economics import TIER_PRESETS, Medium, TierSpec

from .budget import WriteBudget
from .placement import CostAwarePlacement, Economics
from .profiles import GPUSpec, load_hardware
from .recompute import COMPUTE_PRESETS, ModelCompute, Recompute, model_compute


def spec_of(tier: Tier) -> TierSpec:
    """A :class:`TierSpec` from a live tier's profile.

    A profile taken from the table of tier economics (the host and nvme tiers') is priced
    by its whole entry; any other by its four figures, p99 latency taken as 2x median.
    """
    p = tier.profile
    entry = next((t for t in TIER_PRESETS.values() if t.to_tier_profile() == p), None)
    if entry is not None:
        return replace(entry, name=tier.name)
    medium = Medium.SSD if p.endurance_dwpd > 0 else Medium.DRAM
    return TierSpec(
        name=tier.name,
        medium=medium,
        latency_s=p.latency_s,
        p99_latency_s=2 * p.latency_s,
        bandwidth_Bps=p.bandwidth_Bps,
        half_bandwidth_bytes=128 * 1024,
        cost_per_gb_month=p.cost_per_gb_month,
        endurance_dwpd=p.endurance_dwpd,
    )


_MEDIUM_OF_KIND = {
    "host": Medium.DRAM,
    "gpu": Medium.DRAM,
    "cxl": Medium.CXL,
    "nvme": Medium.SSD,
    "redis": Medium.REMOTE,
}


def priced_specs(tiers: Sequence[Tier], hardware: str) -> list[TierSpec]:
    """Each live tier's :class:`TierSpec` from the ``hardware`` preset or TOML.

    A tier takes the hardware's entry of the same name, else the first entry of its
    kind's medium, else its own profile (:func:`spec_of`): the cost model prices tiers
    the way ``kvtier calc`` did, not with the tiers' rough built-in profiles.

    Raises:
        ConfigError: ``hardware`` is neither a preset nor a readable hardware TOML.
    """
    hw = load_hardware(hardware) if hardware else None
    out: list[TierSpec] = []
    for t in tiers:
        spec: TierSpec | None = None
        if hw is not None:
            by_name = [h for h in hw.tiers if h.name == t.name]
            medium = _MEDIUM_OF_KIND.get(t.kind)
            by_medium = [h for h in hw.tiers if h.medium is medium]
            found = by_name or by_medium
            spec = found[0] if found else None
        out.append(spec_of(t) if spec is None else replace(spec, name=t.name))
    return out


def compute_of(settings: PlacementConfig, kv: KVSpec) -> ModelCompute:
    """The model whose prefill a hit saves: ``settings.model``, else one scaled from ``kv``.

    Raises:
        ConfigError: ``placement.model`` names no preset and no readable config.json.
    """
    gpus = settings.gpus or None
    if settings.model:
        try:
            return model_compute(settings.model, gpus=gpus)
        except SpecError as exc:
            raise ConfigError(
                "placement.model", settings.model, f"a model preset or config.json ({exc})"
            ) from exc
    # A dense model whose active parameters match a Llama-3-8B per KV byte.
    base = COMPUTE_PRESETS["llama-3-8b"]
    scale = kv.bytes_per_token / base.kv_bytes_per_token
    return ModelCompute(
        "assumed",
        kv,
        base.active_params * scale,
        base.layers,
        base.q_heads,
        base.d_qk,
        base.d_v,
        gpus or 1,
    )


def placement_for_tiers(
    tiers: Sequence[Tier],
    kv: KVSpec,
    chunk_tokens: int,
    settings: PlacementConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> CostAwarePlacement:
    """Cost-aware placement for a store over ``tiers``.

    Args:
        tiers: the store's tiers, top first.
        kv: the KV geometry (chunk bytes).
        chunk_tokens: tokens per chunk.
        settings: the ``[placement]`` section; its defaults when None.
        clock: seconds (trace time when a trace is replayed).

    Raises:
        ConfigError: a ``[placement]`` setting that cannot be used.
    """
    s = settings or PlacementConfig()
    model = compute_of(s, kv)
    gpu = GPUSpec(
        "configured", peak_flops=s.gpu_peak_flops, mfu=s.gpu_mfu, cost_per_hour=s.gpu_cost_per_hour
    )
    rc = Recompute(model, gpu)
    chunk_bytes = kv.chunk_bytes(chunk_tokens)
    econ = Economics(
        chunk_bytes=chunk_bytes,
        recompute_s=s.recompute_s or rc.chunk_s(chunk_tokens, s.context_tokens),
        value_per_s=rc.cost_per_s + s.value_of_latency_per_s,
        window_s=s.write_budget_window_s,
    )
    specs = priced_specs(tiers, s.hardware)
    caps = [t.capacity_bytes for t in tiers]  # real bytes: the budgets charge real bytes
    budgets = {
        i: WriteBudget(s.write_budget_dwpd * cap, window_s=s.write_budget_window_s, clock=clock)
        for i, (spec, cap) in enumerate(zip(specs, caps, strict=True))
        if spec.wears
    }
    return CostAwarePlacement(specs, caps, econ, clock=clock, budgets=budgets)
