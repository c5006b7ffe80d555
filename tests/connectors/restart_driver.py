"""Run by test_vllm_restart.py in its own process: one vLLM engine over an embedded store
with a host tier and an nvme tier, serving the same prompts in every run.

Usage: python -m tests.connectors.restart_driver MODEL_DIR NVME_DIR OUT_JSON MODE [TP]

MODE ``first``: vLLM's default multi-process engine (the connector's scheduler side and
worker in different processes). Serve the prompts, then let the script end: vLLM's own
shutdown closes the connector, whose store moves what its host tier holds into the nvme
tier.

MODE ``second``: a new engine process on the same configuration, in-process so that the
worker's counters can be read. Serve the same prompts (hits loaded from the nvme tier),
then each prompt again under a fresh cache salt (the recompute reference).

TP > 1 (tensor parallelism, two worker processes on the CPU): both modes run vLLM's
multi-process engine (the only one with several workers), so no counters are read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

PROMPT_SEEDS = (31, 32, 33)
PROMPT_TOKENS = 300  # 4 full chunks of 64 tokens each
NVME_BYTES = 8 << 20


def restart_config(nvme_dir: str) -> dict[str, Any]:
    from tests.connectors.conftest import HOST_BYTES, kv_transfer_config

    cfg = kv_transfer_config()
    cfg["kv_connector_extra_config"]["tiers"] = [
        {"kind": "host", "capacity_bytes": HOST_BYTES, "prefault": False},
        {"kind": "nvme", "capacity_bytes": NVME_BYTES, "dir": nvme_dir, "create_dirs": True},
    ]
    return cfg


# vLLM's logging configuration, extended so that kvtier's INFO lines of every process
# (the worker's shutdown included) reach the log the test reads.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"f": {"format": "%(process)d %(name)s %(levelname)s %(message)s"}},
    "handlers": {
        "h": {"class": "logging.StreamHandler", "formatter": "f", "stream": "ext://sys.stdout"}
    },
    "loggers": {
        "vllm": {"handlers": ["h"], "level": "INFO", "propagate": False},
        "kvtier": {"handlers": ["h"], "level": "INFO", "propagate": False},
    },
}


def main(model: str, nvme_dir: str, out_path: str, mode: str, tp: str = "1") -> None:
    logging.basicConfig(level=logging.WARNING)
    log_cfg = Path(out_path).with_suffix(".logging.json")
    log_cfg.write_text(json.dumps(LOGGING))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(log_cfg)
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if mode == "first" or int(tp) > 1 else "0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from tests.connectors.conftest import Engine, prompt, tiny_llm

    llm = tiny_llm(
        model,
        restart_config(nvme_dir),
        tensor_parallel_size=int(tp),
        **({"distributed_executor_backend": "mp"} if int(tp) > 1 else {}),
    )
    eng = Engine(llm)
    prompts = [prompt(s, PROMPT_TOKENS) for s in PROMPT_SEEDS]
    r: dict[str, Any] = {}
    runs = [eng.generate(p) for p in prompts]
    r.update(tokens=[x.tokens for x in runs], cached=[x.num_cached_tokens for x in runs])
    if mode == "second":
        if int(tp) == 1:
            r["totals"] = eng.totals()
            store = eng.connector.worker.store
            r["tiers_used"] = {t.name: t.used_bytes for t in store.stats().tiers}
        ref = [eng.generate(p, cache_salt="recompute") for p in prompts]
        r.update(ref=[x.tokens for x in ref], ref_cached=[x.num_cached_tokens for x in ref])
    Path(out_path).write_text(json.dumps(r))


if __name__ == "__main__":  # the multi-process engine spawns: keep the guard
    main(*sys.argv[1:6])
