"""Tiny random models of the architectures people serve, one ``config.json`` each.

Each keeps its family's KV geometry where vLLM's CPU build insists on it (DeepSeek's MLA
latent of 512 + 64) and is otherwise as small as vLLM takes: two or three layers, a
hidden size of 256, a 1,024-token vocabulary. They run with ``load_format="dummy"``
(random weights, no files to write), ``skip_tokenizer_init`` and prompts as token ids.
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
# that size). Dense MLPs only (first_k_dense_replace covers every layer): the family's KV
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
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
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

FAMILIES: dict[str, dict[str, Any]] = {"deepseek_v2": DEEPSEEK_V2, "gemma3": GEMMA3}


def write_family(name: str, folder: str | Path) -> Path:
    """Write the ``config.json`` of family ``name`` into ``folder``; returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(FAMILIES[name], indent=1))
    return out
