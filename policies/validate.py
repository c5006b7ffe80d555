"""Model against reality: replay a scaled-down trace through a store with real bytes.

The same trace, policy and capacities (in chunks) run twice:

* through the simulator (``meta`` tiers, no bytes), and
* through a real :class:`~kvtier.store.TieredStore` over a host tier and a lower tier
  that moves real bytes (the ``nvme`` tier where it is installed, else an emulated
  ``cxl`` tier, which is said in the result), with the store's own I/O threads. Each
  chunk holds random bytes derived from its block id, and every hit is verified.

The predicted and measured hit rates per tier are then compared.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.config import build_dataclass
from kvtier.enums import Switch
from kvtier.errors import KVTierError
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier, TierGeometry, TierSection
from kvtier.tiers.host import HostTier
from kvtier.tiers.host import Options as HostOptions
from kvtier.tiers.registry import BUILTIN_KINDS, create_tier

from .simulate import SimConfig, key_of, make_policies, simulate
from .trace import Trace

MAX_EXTENT = 1 << 30


@dataclass(frozen=True, slots=True)
class Validation:
    """Predicted against measured hit rates, per tier (fractions of chunks looked up)."""

    policy: str
    lower_kind: str
    requests: int
    chunks: int
    predicted: tuple[tuple[str, float], ...]
    measured: tuple[tuple[str, float], ...]
    """Real tiers stand in for the simulated ones in order (a ``cxl`` tier for ``nvme``
    where the nvme kind is not installed)."""
    max_abs_diff_points: float
    verified_chunks: int
    corrupt_chunks: int


def _lower_tier(kind: str, cap_bytes: int, slot: int, workdir: Path) -> tuple[Tier, str]:
    if kind == "nvme" and "nvme" in BUILTIN_KINDS:
        from kvtier.tiers.registry import tier_options_class

        opts = build_dataclass(
            tier_options_class("nvme"),
            {"dir": str(workdir / "nvme"), "create_dirs": True, "recover": False},
            "tiers.1",
        )
        return create_tier(TierSection("nvme", "nvme", cap_bytes, opts), slot, MAX_EXTENT), "nvme"
    from kvtier.tiers.cxl import CXLTier
    from kvtier.tiers.cxl import Options as CXLOptions

    opts_cxl = CXLOptions(emulate=Switch.ON, latency_us=1.0, bandwidth_gbps=100.0)
    return CXLTier(TierGeometry("cxl", cap_bytes, slot, MAX_EXTENT), opts_cxl), "cxl (emulated)"


def _value(block: int, salt: int, value_bytes: int) -> npt.NDArray[Any]:
    return np.random.default_rng((salt, block)).integers(0, 256, value_bytes, dtype=np.uint8)


def validate(
    cfg: SimConfig,
    trace: Trace,
    *,
    value_bytes: int = 8192,
    lower_kind: str = "nvme",
    workdir: Path | None = None,
    salt: int = 12345,
) -> Validation:
    """Run ``trace`` through the simulator and through real tiers; compare hit rates.

    ``cfg.capacities_bytes`` are in the model's real bytes, as for :func:`simulate`;
    the real tiers get the same number of chunks, each ``value_bytes`` long.
    """
    sim = simulate(cfg, trace)
    chunk_bytes = cfg.model.kv.chunk_bytes(trace.block_tokens)
    slots = [int(c // chunk_bytes) for c in cfg.capacities_bytes]
    if len(slots) != 2 or min(slots) < 1:
        raise KVTierError(f"validation needs two tiers with room, got {slots} chunks")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        host = HostTier(
            TierGeometry("host", slots[0] * value_bytes, value_bytes, MAX_EXTENT),
            HostOptions(pin=Switch.OFF),
        )
        lower, kind = _lower_tier(lower_kind, slots[1] * value_bytes, value_bytes, Path(tmp))
        now = [trace.requests[0].t_s]
        specs = list(cfg.hardware.tiers)
        caps = [s * chunk_bytes for s in slots]
        placement, eviction = make_policies(cfg, trace, specs, caps, lambda: now[0], value_bytes)
        store = TieredStore(
            [host, lower], eviction=eviction, placement=placement, promote_on_hit=cfg.promote_on_hit
        )
        verified = bad = chunks = 0
        try:
            for r in trace.requests:
                now[0] = r.t_s
                blocks = trace.full_blocks(r)
                if not blocks:
                    continue
                keys = [key_of(b) for b in blocks]
                chunks += len(keys)
                hits = store.lookup(keys).hits
                if hits:
                    dst = np.empty(hits * value_bytes, dtype=np.uint8)
                    got = store.get(keys[:hits], dst).result()
                    for j in range(got.chunks):
                        want = _value(blocks[j], salt, value_bytes)
                        piece = dst[j * value_bytes : (j + 1) * value_bytes]
                        if np.array_equal(piece, want):
                            verified += 1
                        else:
                            bad += 1
                if hits < len(keys):
                    data = np.concatenate([_value(b, salt, value_bytes) for b in blocks[hits:]])
                    store.put(keys[hits:], data, prefix=keys[:hits]).result()
                store.flush()  # promotions land before the next request, as in the simulator
            st = store.stats()
        finally:
            store.close()
    measured = tuple((name, n / chunks if chunks else 0.0) for name, n in st.tier_hits)
    predicted = tuple((t.name, t.hit_rate) for t in sim.tiers)
    diff = max(abs(p - m) for (_, p), (_, m) in zip(predicted, measured, strict=True)) * 100
    return Validation(
        cfg.policy, kind, len(trace.requests), chunks, predicted, measured, diff, verified, bad
    )
