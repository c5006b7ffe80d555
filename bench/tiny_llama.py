"""A small Llama with random (not dummy) weights, written to a folder vLLM can load.

``load_format="dummy"`` gives near-uniform logits, so greedy outputs cannot tell correct
KV from wrong KV. These weights are N(0, 1/fan_in)-scaled, so logits are sharp and a
wrong KV block changes the output (the negative control in docs/connector.md).

Also the engine arguments and options the vLLM benchmarks run it with, kept here once.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """Geometry of the model. ``head_dim`` must be one the CPU attention backend takes."""

    layers: int = 2
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 1024
    max_positions: int = 8192
    seed: int = 1234

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V of one token over all layers, in ``dtype`` (float32: 4 B)."""
        elem = 4 if "32" in dtype else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


def write_tiny_llama(folder: str | Path, geo: TinyLlama = TinyLlama()) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (bf16) into ``folder``; returns it.

    Reuses the folder when it already holds this geometry.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": geo.hidden,
        "intermediate_size": geo.intermediate,
        "num_hidden_layers": geo.layers,
        "num_attention_heads": geo.heads,
        "num_key_value_heads": geo.kv_heads,
        "head_dim": geo.head_dim,
        "vocab_size": geo.vocab,
        "max_position_embeddings": geo.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "kvtier_geometry": asdict(geo),
    }
    cfg_path = out / "config.json"
    weights = out / "model.safetensors"
    if cfg_path.exists() and weights.exists() and json.loads(cfg_path.read_text()) == cfg:
        return out
    cfg_path.write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(geo.seed)
    h, inter, v = geo.hidden, geo.intermediate, geo.vocab
    nh, nkv, hd = geo.heads, geo.kv_heads, geo.head_dim

    def w(o: int, i: int, scale: float = 1.0) -> torch.Tensor:
        t: torch.Tensor = (torch.randn(o, i, generator=g) * scale / i**0.5).to(torch.bfloat16)
        return t

    sd = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(v, h, 4.0),
    }
    for layer in range(geo.layers):
        p = f"model.layers.{layer}."
        sd[p + "self_attn.q_proj.weight"] = w(nh * hd, h, 2.0)
        sd[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, 2.0)
        sd[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        sd[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        sd[p + "mlp.gate_proj.weight"] = w(inter, h)
        sd[p + "mlp.up_proj.weight"] = w(inter, h)
        sd[p + "mlp.down_proj.weight"] = w(h, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(sd, str(weights))
    return out


# The vLLM benchmarks' model by default; each field of _SHAPE is an option (--kv-heads ...).
BENCH_GEOMETRY = TinyLlama(layers=4, hidden=512, intermediate=1536, heads=8, kv_heads=4)
_SHAPE = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options of the vLLM benchmarks on this model: prompt, repeats, the model's shape,
    dtype, the connector's chunk and host tier, and where the JSON goes."""
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    for name in _SHAPE:
        p.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(BENCH_GEOMETRY, name)
        )
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bfloat16, float32)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-bytes", default="1GiB")
    p.add_argument("--json", default=None)


def bench_geometry(a: argparse.Namespace) -> TinyLlama:
    """The model of :func:`add_engine_options`' options, with positions for the prompt."""
    shape = {name: getattr(a, name) for name in _SHAPE}
    return replace(BENCH_GEOMETRY, **shape, max_positions=max(8192, a.tokens + 64))


def engine_args(
    model: Path, tokens: int, dtype: str, *, prefix_caching: bool = False
) -> dict[str, Any]:
    """The benchmarks' vLLM ``LLM`` arguments for this model on prompts of ``tokens`` tokens.

    Eager, two sequences at a time, a few positions beyond the prompt; vLLM's own prefix
    cache off unless ``prefix_caching`` (a kvtier hit must come from kvtier).
    """
    return {
        "model": str(model),
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "block_size": 32,
        "max_model_len": tokens + 64,
        "max_num_batched_tokens": tokens + 64,
        "max_num_seqs": 2,
        "enable_prefix_caching": prefix_caching,
        "seed": 0,
        "enforce_eager": True,
        "dtype": dtype,
    }


def kvtier_transfer(
    role: str, chunk_tokens: int, tiers: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvtier's connector (``extra``: more connector keys)."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"store.chunk_tokens": chunk_tokens, "tiers": tiers, **extra},
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.tiny_llama DIR``: write the model into DIR, print DIR."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("folder", type=Path, help="where to write config.json and the weights")
    args = ap.parse_args(argv)
    print(write_tiny_llama(args.folder.expanduser()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
