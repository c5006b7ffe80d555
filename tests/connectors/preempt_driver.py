"""Run by test_vllm_preemption.py in its own process: an engine with a KV cache so small
that a batch of four requests must preempt one, with the kvtier connector on.

Usage: python -m tests.connectors.preempt_driver MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import random
import sys

PROMPT_TOKENS = 200  # 3 full chunks of 64 tokens each, 7 blocks of 32
REQUESTS = 4
# 22 blocks of 32 tokens: three prompts fit (21 blocks), and when their decodes grow past
# 256 tokens each needs an 8th block (24 > 22), so vLLM preempts one.
NUM_BLOCKS = 22
MAX_TOKENS = 48


def main(model: str, out_path: str) -> None:
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from tests.connectors.conftest import kv_transfer_config

    llm = LLM(
        model=model,
        load_format="safetensors",
        skip_tokenizer_init=True,
        block_size=32,
        max_model_len=512,  # the 22-block cache (704 tokens) must hold one whole request
        max_num_seqs=REQUESTS,
        enable_prefix_caching=False,
        seed=0,
        enforce_eager=True,
        # float32: batched and single decodes round alike, so outputs compare exactly.
        dtype="float32",
        num_gpu_blocks_override=NUM_BLOCKS,
        disable_log_stats=False,
        # Room for everything this script stores (2 x 4 requests x 3 chunks of 128 KiB).
        kv_transfer_config=kv_transfer_config(
            tiers=[{"kind": "host", "capacity_bytes": "16MiB", "prefault": False}]
        ),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [
        [random.Random(s).randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for s in range(REQUESTS)
    ]

    def one(p: list[int], salt: str) -> tuple[list[int], int]:
        o = llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=salt)], sp, use_tqdm=False)[0]
        return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)

    batch = llm.generate(
        [TokensPrompt(prompt_token_ids=p, cache_salt="batch") for p in prompts], sp, use_tqdm=False
    )
    loads_after_batch = get_kv_transfer_group().worker.totals().get("load_chunks", 0)
    single = [one(p, "single") for p in prompts]  # salted apart: computed, one at a time
    again = [one(p, "batch") for p in prompts]  # hits on what the batch saved
    preemptions = sum(
        int(getattr(m, "value", 0) or 0)
        for m in llm.get_metrics()
        if m.name == "vllm:num_preemptions"
    )
    result = {
        "preemptions": preemptions,
        "batch": [list(o.outputs[0].token_ids) for o in batch],
        "single": [t for t, _ in single],
        "again": [t for t, _ in again],
        "again_cached": [c for _, c in again],
        "loads_after_batch": loads_after_batch,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
