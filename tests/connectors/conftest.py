"""One real vLLM CPU engine with the kvtier connector, shared by the module's tests.

Engine start is the expensive part (3 s in-process and eager, 40-80 s otherwise, on two
cores), so the session starts one engine and every scenario uses its own random prompts
(and cache salts) so that scenarios do not see each other's chunks.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker-side
connector is reachable through vLLM's public ``get_kv_transfer_group()`` and tests read
its counters (``worker.totals()``) and store stats. Both sides still talk only through
the connector metadata, exactly as in the multi-process engine.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BLOCK = 32
CHUNK = 64  # two blocks per chunk, so prompts of a few hundred tokens have several chunks
# Host tier of 2 MiB: 32 chunks of 64 KiB (2 layers x 2 blocks x 16 KiB) = 2048 tokens.
HOST_BYTES = 2 << 20
CHUNK_BYTES = 64 << 10

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def kv_transfer_config(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store.chunk_tokens": CHUNK,
            "tiers": [{"kind": "host", "capacity_bytes": HOST_BYTES, "prefault": False}],
            **extra,
        },
    }


@dataclass
class Run:
    tokens: list[int]
    num_cached_tokens: int


class Engine:
    """A started LLM with the connector, and helpers the scenarios share."""

    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate(self, prompt: list[int], cache_salt: str | None = None) -> Run:
        from vllm.inputs import TokensPrompt

        p = TokensPrompt(prompt_token_ids=prompt)
        if cache_salt is not None:
            p["cache_salt"] = cache_salt
        out = self.llm.generate([p], self.params, use_tqdm=False)[0]
        return Run(list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0))

    @property
    def connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def totals(self) -> dict[str, float]:
        return dict(self.connector.worker.totals())


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 1000) for _ in range(n)]


def tiny_llm(model: str, transfer: dict[str, Any], **overrides: Any) -> Any:
    """A vLLM engine on the tiny model with the settings every connector test shares
    (safetensors load, token-id prompts, BLOCK-token blocks, eager, seed 0, no vLLM prefix cache);
    ``overrides`` change or add engine arguments."""
    from vllm import LLM

    args: dict[str, Any] = {
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "block_size": BLOCK,
        "max_model_len": 1024,
        "max_num_seqs": 2,
        "enable_prefix_caching": False,
        "seed": 0,
        "enforce_eager": True,
    }
    return LLM(model=model, kv_transfer_config=transfer, **{**args, **overrides})


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.bench.tiny_llama import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def engine(tiny_model: str) -> Iterator[Engine]:
    # vLLM's own prefix cache stays off (tiny_llm): every hit here must come from kvtier.
    with in_process_engine(
        tiny_model, kv_transfer_config(), max_model_len=4096, max_num_seqs=4
    ) as e:
        yield e


@contextlib.contextmanager
def in_process_engine(model: str, transfer: dict[str, Any], **overrides: Any) -> Iterator[Engine]:
    """:func:`tiny_llm` in this process (ENV set while it lives), shut down at the end."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    # vLLM keeps one worker-side connector per process and a new engine reuses the one it
    # finds: an engine started while another lives here (the session's) gets its own, and
    # the outer engine gets its own back at the end.
    outer = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = None
    llm = tiny_llm(model, transfer, **overrides)
    try:
        yield Engine(llm)
    finally:
        shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        kv_transfer_state._KV_CONNECTOR_AGENT = outer
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
