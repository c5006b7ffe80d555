"""Run by test_vllm_families.py in its own process: one in-process vLLM engine on a tiny
model of a family (families.py), with the connector over a host tier and an nvme tier.

Usage: python -m tests.connectors.family_driver MODEL_DIR NVME_DIR OUT_JSON MODE [TP]

MODE ``first``: serve each prompt twice (the second run hits what the first stored),
then shut the engine down: the store moves what its host tier holds into nvme.
MODE ``second``: a new engine process on the same configuration: serve the same prompts
(hits loaded from nvme), then each under a fresh cache salt (the recompute reference),
then the first prompt again after the store lost every chunk (a failed load).

Both write token ids, cached token counts, the worker's counters and its group layout.
TP > 1: vLLM's multi-process engine (two worker processes on the CPU); token ids and
cached counts only (the workers are in other processes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PROMPT_SEEDS = (41, 42)
PROMPT_TOKENS = 300  # 4 full chunks of 64 tokens each
NVME_BYTES = 8 << 20


def main(model: str, nvme_dir: str, out_path: str, mode: str, tp: str = "1") -> None:
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if int(tp) > 1 else "0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from tests.connectors.conftest import HOST_BYTES, Engine, kv_transfer_config, prompt, tiny_llm

    cfg = kv_transfer_config()
    cfg["kv_connector_extra_config"]["tiers"] = [
        {"kind": "host", "capacity_bytes": 2 * HOST_BYTES, "prefault": False},
        {"kind": "nvme", "capacity_bytes": NVME_BYTES, "dir": nvme_dir, "create_dirs": True},
    ]
    # Blocks of 32 tokens (vLLM's CPU MLA backend makes them 16: the connector follows).
    parallel = {"tensor_parallel_size": int(tp), "distributed_executor_backend": "mp"}
    llm = tiny_llm(model, cfg, **(parallel if int(tp) > 1 else {}))
    eng = Engine(llm)
    prompts = [prompt(s, PROMPT_TOKENS) for s in PROMPT_SEEDS]
    if int(tp) > 1:
        runs = [eng.generate(p) for p in prompts + prompts]
        tokens, cached = [x.tokens for x in runs], [x.num_cached_tokens for x in runs]
        llm.llm_engine.engine_core.shutdown()
        Path(out_path).write_text(json.dumps({"tokens": tokens, "cached": cached}))
        return
    worker = eng.connector.worker
    r: dict[str, Any] = {
        "groups": [[g.sliding, g.tail_blocks, g.window_chunks] for g in worker.layout.groups],
        "mla": worker.spec.mla,
        "layers": [m.num_layers for m in worker.movers],
        "page_bytes": [m.page_bytes for m in worker.movers],
        "block_size": worker.block_size,
    }
    runs = [eng.generate(p) for p in prompts]
    r.update(tokens=[x.tokens for x in runs], cached=[x.num_cached_tokens for x in runs])
    r["stored"] = len(worker.store.keys())  # entries in this rank's store (all tiers)
    if mode == "first":
        again = [eng.generate(p) for p in prompts]
        r.update(again=[x.tokens for x in again], again_cached=[x.num_cached_tokens for x in again])
    else:
        ref = [eng.generate(p, cache_salt="recompute") for p in prompts]
        r.update(ref=[x.tokens for x in ref], ref_cached=[x.num_cached_tokens for x in ref])
        r["totals"] = eng.totals()
        # A load that fails: the store loses the chunks after the scheduler last heard
        # of them (as an eviction racing a lookup would); vLLM recomputes the prompt.
        worker.store.delete(worker.store.keys())
        lost = eng.generate(prompts[0])
        r.update(lost=lost.tokens, lost_totals=eng.totals())
    r.setdefault("totals", eng.totals())
    llm.llm_engine.engine_core.shutdown()
    Path(out_path).write_text(json.dumps(r))


if __name__ == "__main__":  # vLLM may spawn: keep the guard
    main(*sys.argv[1:6])
