"""The connector on a real CUDA vLLM engine: hits, a failed load, a restart, preemption.

Skipped without CUDA (the suite's vLLM is the CPU build). On a GPU host with a CUDA
build of vLLM (0.26 on the lent H100/H200 hosts: scripts/wheelhouse.sh,
docs/operations.md) the same small Llama as the CPU tests (random bf16 weights, so a
wrong KV block changes the output) runs on the GPU's attention backend and KV layout,
and the connector moves blocks with the CUDA transfer engine:

* the worker's mover is the transfer engine's, over CUDA tensors;
* a repeated prompt loads its full chunks, with greedy output identical to the first run;
  one ending at a chunk boundary loads all of its last chunk but the block holding its
  last token; a prompt sharing a prefix loads only that prefix, identical to its salted
  recompute;
* chunks deleted from the store after the scheduler heard of them: the load fails for
  real, vLLM recomputes, same output;
* a new engine process hits what the last one left in the nvme tier (restart_driver.py);
* a KV cache of 22 blocks preempts a request mid-decode; outputs equal each prompt
  computed alone (preempt_driver.py).

The two subprocess scenarios come first: each engine takes most of the GPU's memory, so
they run before this module's in-process engine (which takes a quarter) exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connectors.conftest import (
    BLOCK,
    CHUNK,
    Engine,
    in_process_engine,
    kv_transfer_config,
    prompt,
)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not _cuda(), reason="needs a CUDA device and a CUDA build of vLLM"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_new_engine_process_hits_what_the_last_left_in_nvme(
    tiny_model: str, tmp_path: Path
) -> None:
    from tests.connectors.restart_driver import PROMPT_SEEDS
    from tests.connectors.test_vllm_restart import _run

    nvme = tmp_path / "nvme"
    first = _run(tiny_model, nvme, tmp_path / "first.json", "first")
    second = _run(tiny_model, nvme, tmp_path / "second.json", "second")
    n = len(PROMPT_SEEDS)
    assert first["cached"] == [0] * n
    assert f"{n * 4} chunk(s) moved into nvme before closing" in first["log"]
    assert second["cached"] == [4 * CHUNK] * n  # every full chunk, from nvme
    assert second["tokens"] == first["tokens"]
    assert second["ref_cached"] == [0] * n
    assert second["ref"] == first["tokens"]
    assert second["totals"].get("load_failed_blocks", 0) == 0


def test_preempted_request_finishes_with_identical_output(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "preempt.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.connectors.preempt_driver", tiny_model, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["preemptions"] >= 1
    assert r["batch"] == r["single"]
    assert r["again"] == r["single"]
    assert r["again_cached"] == [3 * CHUNK] * 4
    assert r["loads_after_batch"] > 0


@pytest.fixture(scope="module")
def cuda_engine(tiny_model: str) -> Iterator[Engine]:
    with in_process_engine(
        tiny_model,
        kv_transfer_config(),
        max_model_len=4096,
        max_num_seqs=4,
        gpu_memory_utilization=0.25,
    ) as e:
        yield e


def test_the_worker_moves_cuda_blocks_with_the_transfer_engine(cuda_engine: Engine) -> None:
    mover = cuda_engine.connector.worker.mover
    assert mover.device.type == "cuda"
    assert type(mover).__name__ == "EngineBlockMover"
    assert mover.layout.startswith("page-")  # whole blocks are dense byte runs


def test_repeated_prompt_hits_with_identical_output(cuda_engine: Engine) -> None:
    p = prompt(401, 300)
    first = cuda_engine.generate(p)
    before = cuda_engine.totals()
    second = cuda_engine.generate(p)
    after = cuda_engine.totals()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 4 * CHUNK
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) == 4 * CHUNK
    # From the pinned host tier, off the step, with no load thread (inplace.py).
    assert after.get("load_enqueued", 0) - before.get("load_enqueued", 0) == 1
    assert second.tokens == first.tokens


def test_prompt_ending_at_a_chunk_boundary_loads_all_but_its_last_block(
    cuda_engine: Engine,
) -> None:
    # The last chunk's leading blocks only are scattered (in place where the host tier
    # is pinned, inplace.py).
    p = prompt(406, 5 * CHUNK)
    first = cuda_engine.generate(p)
    before = cuda_engine.totals().get("load_tokens", 0)
    second = cuda_engine.generate(p)
    loaded = cuda_engine.totals().get("load_tokens", 0) - before
    ref = cuda_engine.generate(p, cache_salt="cuda-boundary-ref")
    assert second.num_cached_tokens == 5 * CHUNK - BLOCK
    assert loaded == 5 * CHUNK - BLOCK
    assert ref.num_cached_tokens == 0
    assert second.tokens == first.tokens == ref.tokens


def test_shared_prefix_loads_only_the_prefix(cuda_engine: Engine) -> None:
    base = prompt(402, 266)
    a = base + prompt(403, 40)
    b = base + prompt(404, 40)
    cuda_engine.generate(a)
    hit = cuda_engine.generate(b)
    ref = cuda_engine.generate(b, cache_salt="cuda-prefix-ref")
    assert hit.num_cached_tokens == 4 * CHUNK
    assert ref.num_cached_tokens == 0
    assert hit.tokens == ref.tokens


def _stored(engine: Engine, chunks: int) -> list[bytes]:
    """The worker store's keys once it holds ``chunks`` of them (saves end after the step)."""
    store = engine.connector.worker.store
    deadline = time.monotonic() + 60
    while len(store.keys()) < chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(store.keys())


def test_failed_load_is_recomputed(cuda_engine: Engine) -> None:
    # On CUDA the default loads off the step (compat.sync_load_failures_recover): vLLM
    # recomputes a failed synchronous load from a stale offset there.
    victim = prompt(405, 10 * CHUNK)
    first = cuda_engine.generate(victim)
    store = cuda_engine.connector.worker.store
    assert store.delete(_stored(cuda_engine, 10)) >= 10
    before = cuda_engine.totals()
    again = cuda_engine.generate(victim)
    after = cuda_engine.totals()
    assert after.get("load_failed_blocks", 0) - before.get("load_failed_blocks", 0) > 0
    assert after.get("load_async", 0) > before.get("load_async", 0)
    assert again.tokens == first.tokens
    third = cuda_engine.generate(victim)
    assert third.tokens == first.tokens
    assert third.num_cached_tokens == 10 * CHUNK - BLOCK  # the last chunk but its last block
