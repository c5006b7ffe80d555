"""Model KV geometry: how many bytes one token's KV takes on one rank.

A :class:`KVSpec` is built from explicit values or from a Hugging Face
``config.json``. Its fingerprint goes into every chunk key's namespace, so KV of two
different geometries (or two TP ranks holding different heads) can never be confused.
An MLA latent is the same on every TP rank, so its fingerprint names no rank: the ranks
share one copy. A hybrid model's KV-cache groups (:class:`KVGroup`: full attention,
sliding window) are part of the geometry too.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvtier.errors import SpecError


class DType(enum.Enum):
    """Element type of the stored KV. Values are the canonical names used in config."""

    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, name: str) -> DType:
        """Accept canonical names and the common aliases used by torch and HF configs."""
        key = name.strip().lower().removeprefix("torch.")
        try:
            return _ALIASES[key]
        except KeyError:
            allowed = ", ".join(sorted(_ALIASES))
            raise SpecError(f"unknown dtype {name!r}; expected one of {allowed}") from None


_ITEMSIZE = {
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP32: 4,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
}
_ALIASES = {
    "bfloat16": DType.BF16,
    "bf16": DType.BF16,
    "float16": DType.FP16,
    "fp16": DType.FP16,
    "half": DType.FP16,
    "float32": DType.FP32,
    "fp32": DType.FP32,
    "float": DType.FP32,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
    "float8_e5m2": DType.FP8_E5M2,
}


class LayerKind(enum.Enum):
    """What a group of attention layers keeps of a sequence's KV."""

    FULL = "full"  # every token's KV (full attention, MLA)
    SLIDING = "sliding"  # the KV of the last tokens only (sliding-window attention)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group of a hybrid model: layers that share a block table.

    Attributes:
        kind: what the layers keep.
        num_layers: layers in the group (on this rank's pipeline stage).
        window_tokens: SLIDING only: tokens before a position that its attention still
            reads (vLLM's ``sliding_window - 1``, plus tokens it retains below the
            window); a prefix hit at token ``P`` needs tokens ``[P - window_tokens, P)``.
    """

    kind: LayerKind
    num_layers: int
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise SpecError(f"KVGroup.num_layers must be >= 1, got {self.num_layers}")
        if (self.kind is LayerKind.SLIDING) != (self.window_tokens > 0):
            raise SpecError(
                f"KVGroup: a SLIDING group has window_tokens > 0, others 0; got {self.kind.value} "
                f"with window_tokens={self.window_tokens}"
            )

    @property
    def canon(self) -> str:
        return f"{self.kind.value}{self.num_layers}w{self.window_tokens}"


@dataclass(frozen=True, slots=True)
class KVSpec:
    """KV geometry of one model on one tensor-parallel rank.

    Attributes:
        num_layers: attention layers that hold KV.
        num_kv_heads: KV heads of the whole model (before TP sharding). For MLA, 1.
        head_size: elements per head. For MLA, kv_lora_rank + qk_rope_head_dim.
        dtype: element type of the cache.
        mla: True for multi-head latent attention (one latent vector, no separate K and V).
        tp_rank: this rank, in [0, tp_size).
        tp_size: tensor-parallel degree; KV heads are split across ranks, or
            replicated when there are fewer heads than ranks (as vLLM does).
        groups: the KV-cache groups of a hybrid model, in vLLM's group order; empty
            for one group of every layer (plain attention, or vLLM's hybrid KV-cache
            manager off). Their layers sum to ``num_layers``.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: DType = DType.BF16
    mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_size"):
            if getattr(self, name) < 1:
                raise SpecError(f"KVSpec.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise SpecError(f"KVSpec.tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        if self.groups and sum(g.num_layers for g in self.groups) != self.num_layers:
            raise SpecError(
                f"KVSpec.groups hold {sum(g.num_layers for g in self.groups)} layers, "
                f"num_layers is {self.num_layers}"
            )

    @property
    def replicated(self) -> bool:
        """Whether every TP rank holds the same KV (an MLA latent): stored once, not per rank."""
        return self.mla

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads held by one rank (MLA latents are replicated on every rank)."""
        if self.mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on this rank, across all layers, K and V."""
        planes = 1 if self.mla else 2
        return (
            self.num_layers * planes * self.kv_heads_per_rank * self.head_size * self.dtype.itemsize
        )

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one chunk of ``chunk_tokens`` tokens on this rank."""
        return self.bytes_per_token * chunk_tokens

    def entry_bytes(self, chunk_tokens: int) -> int:
        """Bytes of the smallest stored entry of one chunk on this rank.

        A hybrid model stores each group's KV of a chunk as an entry of its own, so a
        store of a given capacity holds at most ``capacity // entry_bytes`` entries;
        a model of one group stores one entry per chunk (:meth:`chunk_bytes`).
        """
        if not self.groups:
            return self.chunk_bytes(chunk_tokens)
        per_layer = self.bytes_per_token // self.num_layers
        return min(g.num_layers for g in self.groups) * per_layer * chunk_tokens

    @property
    def fingerprint(self) -> str:
        """Stable 16-hex-digit id of this geometry and rank; part of every key's namespace.

        An MLA latent is the same on every TP rank and at every TP degree, so its
        fingerprint is that of rank 0 of 1: all ranks name one copy.
        """
        rank, size = (0, 1) if self.replicated else (self.tp_rank, self.tp_size)
        canon = (
            f"kvspec/v1:{self.num_layers}:{self.num_kv_heads}:{self.head_size}:"
            f"{self.dtype.value}:{int(self.mla)}:{rank}:{size}"
        )
        if self.groups:
            canon += ":groups=" + ",".join(g.canon for g in self.groups)
        return xxhash.xxh3_64_hexdigest(canon.encode())

    @classmethod
    def from_hf_config(
        cls,
        config: Path | str | dict[str, Any],
        *,
        dtype: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVSpec:
        """Build a spec from a Hugging Face ``config.json`` (a path or its parsed dict).

        Raises:
            SpecError: the file is unreadable or lacks the fields a decoder model has.
        """
        if isinstance(config, dict):
            cfg = config
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise SpecError(f"cannot read model config {path}: {exc}") from exc
        # Multimodal wrappers keep the language model under text_config.
        cfg = cfg.get("text_config", cfg)
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"model config lacks {exc}; is it a decoder LLM config.json?") from exc
        mla = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank") is not None
        if mla:
            kv_heads = 1
            head = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
        else:
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        dt = DType.parse(dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
        return cls(layers, kv_heads, head, dt, mla, tp_rank, tp_size)


# Geometries of widely deployed models, for demos, benchmarks and the calculator.
PRESETS: dict[str, KVSpec] = {
    "llama-3-8b": KVSpec(32, 8, 128),
    "llama-3-70b": KVSpec(80, 8, 128),
    "qwen2-7b": KVSpec(28, 4, 128),
    "mixtral-8x7b": KVSpec(32, 8, 128),
    "deepseek-v3": KVSpec(61, 1, 576, mla=True),
}


def preset(name: str) -> KVSpec:
    """Look up a preset geometry by name (see :data:`PRESETS`)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise SpecError(
            f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}"
        ) from None
