"""Tiny random models of the architectures people serve, one ``config.json`` each.

Each keeps its family's KV geometry where vLLM's CPU build insists on it (DeepSeek's MLA
latent of 512 + 64) and is otherwise as small as vLLM takes: two or three layers, a
hidden size of 256, a 1,024-token vocabulary. :func:`write_model` gives each random
weights of a wide spread (Hugging Face's own initialisation, ``initializer_range`` 0.5):
``load_format="dummy"`` weights are so small that greedy outputs barely depend on the
prompt, so they could not tell a wrong KV block from a right one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek-V2 with multi-head latent attention: one latent vector of kv_lora_rank +
# qk_rope_head_dim = 576 elements per token and layer (vLLM's CPU MLA kernel takes only
# that size). The head dimensions are DeepSeek-V2's own (128 / 64 / 128): CUDA's MLA
# prefill (FlashAttention) refuses others. Dense MLPs only (first_k_dense_replace covers every layer): the family's KV
# is what is under test, not its experts.
DEEPSEEK_V2: dict[str, Any] = {
    **_COMMON,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "moe_intermediate_size": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 2,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
}

# Gemma 3 (text): sliding-window layers and a full-attention layer. The window (48
# tokens) is shorter than the prompts, so a hit needs only the window before its boundary
# in the sliding layers, and it ends inside a chunk of the tests (64 tokens).
GEMMA3: dict[str, Any] = {
    **_COMMON,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 48,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}

# gpt-oss: alternating sliding-window and full-attention layers with attention sinks, and
# mixture-of-experts MLPs (unquantized here). A window of 32 tokens ends inside a chunk's
# last block: its sliding group stores one block of each chunk of two.
GPT_OSS: dict[str, Any] = {
    **_COMMON,
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "sliding_window": 32,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "hidden_act": "silu",
}

FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v2": DEEPSEEK_V2,
    "gemma3": GEMMA3,
    "gpt_oss": GPT_OSS,
}


def write_family(name: str, folder: str | Path) -> Path:
    """Write only the ``config.json`` of family ``name`` (for ``load_format="dummy"``)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(FAMILIES[name], indent=1))
    return out


def write_model(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Write family ``name`` with random weights (safetensors) into ``folder``; returns it.

    Reuses the folder when it already holds this family.
    """
    import torch
    import transformers

    out = Path(folder)
    stamp = out / "kvtier-family.json"
    want = json.dumps({"family": FAMILIES[name], "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    cfg = {**FAMILIES[name], "initializer_range": 0.5}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    stamp.write_text(want)
    return out
