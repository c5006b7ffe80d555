"""Recompute model: how long a prefill of n tokens takes, and what that GPU time costs.

FLOPs of a prefill of tokens ``[start, end)`` with ``start`` tokens already cached:

* linear layers: ``2 * active_params`` per token;
* attention: each new token ``i`` attends to ``i + 1`` keys in every layer, at
  ``2 * q_heads * (d_qk + d_v)`` FLOPs per (query, key) pair (QK^T, then the weighted
  sum of V), so long contexts cost more per token: the sum over ``i`` is quadratic.

Time is FLOPs over ``gpus * peak_flops * mfu``; cost is that time x gpus x $/GPU-second.
The geometry of the presets comes from each model's published ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import SpecError
from kvtier.spec import PRESETS, KVSpec

from .profiles import GPUSpec


@dataclass(frozen=True, slots=True)
class ModelCompute:
    """What a prefill of one model costs in FLOPs, and how it is served.

    Attributes:
        name: model name.
        kv: the KV geometry of the whole model (tp_size 1: all ranks' bytes).
        active_params: parameters touched per token (MoE: the active experts only).
        layers: attention layers.
        q_heads: query heads.
        d_qk: query/key head dimension.
        d_v: value head dimension.
        gpus: GPUs one replica runs on (tensor parallel); they all wait for a prefill.
    """

    name: str
    kv: KVSpec
    active_params: float
    layers: int
    q_heads: int
    d_qk: int
    d_v: int
    gpus: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers."""
        return 2.0 * self.layers * self.q_heads * (self.d_qk + self.d_v)

    def prefill_flops(self, end_tokens: int, start_tokens: int = 0) -> float:
        """FLOPs to compute tokens ``[start, end)`` given ``start`` cached tokens."""
        n = max(end_tokens - start_tokens, 0)
        if n == 0:
            return 0.0
        # sum_{i=start}^{end-1} (i + 1) keys attended
        pairs = (end_tokens * (end_tokens + 1) - start_tokens * (start_tokens + 1)) / 2.0
        return 2.0 * self.active_params * n + self.attn_flops_per_pair * pairs


@dataclass(frozen=True, slots=True)
class Recompute:
    """Prefill time and cost of one model on one GPU type."""

    model: ModelCompute
    gpu: GPUSpec

    @property
    def flops_per_s(self) -> float:
        return self.model.gpus * self.gpu.peak_flops * self.gpu.mfu

    @property
    def cost_per_s(self) -> float:
        """$ per second of a replica (all its GPUs)."""
        return self.model.gpus * self.gpu.cost_per_s

    def prefill_s(self, end_tokens: int, start_tokens: int = 0) -> float:
        """Seconds to prefill tokens ``[start, end)`` on top of ``start`` cached tokens."""
        return self.model.prefill_flops(end_tokens, start_tokens) / self.flops_per_s

    def chunk_s(self, chunk_tokens: int, position_tokens: int) -> float:
        """Seconds to recompute one chunk that starts at ``position_tokens``."""
        return self.prefill_s(position_tokens + chunk_tokens, position_tokens)


# Geometry from the published config.json of each model (hidden size, heads, layers);
# parameter counts from the model cards. TP degrees are typical H200 deployments.
COMPUTE_PRESETS: dict[str, ModelCompute] = {
    "llama-3-8b": ModelCompute("llama-3-8b", PRESETS["llama-3-8b"], 8.03e9, 32, 32, 128, 128, 1),
    "llama-3-70b": ModelCompute("llama-3-70b", PRESETS["llama-3-70b"], 70.6e9, 80, 64, 128, 128, 4),
    "qwen2-7b": ModelCompute("qwen2-7b", PRESETS["qwen2-7b"], 7.62e9, 28, 28, 128, 128, 1),
    "mixtral-8x7b": ModelCompute(
        "mixtral-8x7b", PRESETS["mixtral-8x7b"], 12.9e9, 32, 32, 128, 128, 2
    ),
    # MLA: 128 heads, q/k = 128 nope + 64 rope dims, v = 128; 37B active of 671B.
    "deepseek-v3": ModelCompute("deepseek-v3", PRESETS["deepseek-v3"], 37e9, 61, 128, 192, 128, 8),
}


def model_compute(name_or_path: str, *, gpus: int | None = None) -> ModelCompute:
    """A preset by name, or a compute model estimated from a Hugging Face ``config.json``.

    Raises:
        SpecError: unknown preset, unreadable file, or a config without the needed fields
            (the message names the field).
    """
    key = name_or_path.lower()
    if key in COMPUTE_PRESETS:
        m = COMPUTE_PRESETS[key]
        if gpus is not None:
            from dataclasses import replace

            m = replace(m, gpus=gpus)
        return m
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise SpecError(
            f"unknown model {name_or_path!r}: expected one of {sorted(COMPUTE_PRESETS)} "
            "or a path to a Hugging Face config.json"
        )
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read model config {path}: {exc}") from exc
    return _from_hf(cfg, path.parent.name or path.stem, gpus or 1, str(path))


def _from_hf(raw: dict[str, Any], name: str, gpus: int, where: str) -> ModelCompute:
    kv = KVSpec.from_hf_config(raw)
    cfg = raw.get("text_config", raw)

    def need(field: str) -> int:
        try:
            return int(cfg[field])
        except (KeyError, TypeError, ValueError):
            raise SpecError(f"{where}: field {field!r} is missing or not an integer") from None

    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 32000)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if kv.mla:
        d_qk = int(cfg.get("qk_nope_head_dim", 128)) + int(cfg.get("qk_rope_head_dim", 64))
        d_v = int(cfg.get("v_head_dim", 128))
    else:
        d_qk = d_v = int(cfg.get("head_dim") or hidden // heads)
    experts = int(cfg.get("num_experts_per_tok") or 1)
    # q and k projections, v projection, output projection
    attn = hidden * (heads * d_qk + kv_heads * d_qk + kv_heads * d_v + heads * d_v)
    mlp = 3 * hidden * inter * experts
    params = layers * (attn + mlp) + 2 * vocab * hidden
    return ModelCompute(name, kv, float(params), layers, heads, d_qk, d_v, gpus)
