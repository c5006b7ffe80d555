"""A prompt longer than the whole store, saved over several prefill steps (real vLLM CPU).

Chunked prefill saves a long prompt a few chunks per step. With the store full of that
prompt's own head, each later step has to make room: had it evicted the head (the least
recently used chunks), the store would end with the prompt's tail, which no prefix
lookup ever reaches. The connector names the request's earlier chunks as the put's
prefix, so the store keeps the head and declines the tail; the next identical prompt
hits the head, and its output equals a recompute. The same holds in daemon mode (a
real ``kvtier serve`` of 32 chunk slots), reached over its same-host channel or, with
that channel off as for a daemon on another host, over HTTP (the batch body's PREFIX).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connectors.conftest import (
    CHUNK,
    CHUNK_BYTES,
    HOST_BYTES,
    Engine,
    in_process_engine,
    kv_transfer_config,
    prompt,
)

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STORE_CHUNKS = HOST_BYTES // CHUNK_BYTES  # 32 chunks of 64 tokens: 2048 tokens
STEP_TOKENS = 4 * CHUNK  # chunked prefill: 4 chunks computed (and saved) per step


@pytest.fixture(scope="module", params=["embedded", "daemon", "daemon-http"])
def small_steps(
    request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    daemon = None
    extra: dict[str, object] = {}
    if request.param.startswith("daemon"):
        from tests.service.conftest import start_daemon

        http_only = ("--set", "service.socket=") if request.param == "daemon-http" else ()
        daemon = start_daemon(
            tmp_path_factory.mktemp("capacity-daemon"),
            *http_only,
            "--set",
            f"service.max_value_bytes={CHUNK_BYTES}",
            "--set",
            f"tiers.0.capacity_bytes={HOST_BYTES}",
            "--set",
            "store.placement=keep",
        )
        extra = {"url": daemon.url}
    try:
        with in_process_engine(
            tiny_model,
            kv_transfer_config(**extra),
            max_model_len=4096,
            max_num_batched_tokens=STEP_TOKENS,
            enable_chunked_prefill=True,
        ) as e:
            yield e
    finally:
        if daemon is not None:
            daemon.stop()


def test_a_prompt_longer_than_the_store_keeps_its_head(small_steps: Engine) -> None:
    engine = small_steps
    n_chunks = STORE_CHUNKS + 12
    p = prompt(300, n_chunks * CHUNK + 5)
    ref = engine.generate(p, cache_salt="capacity-ref").tokens  # a recompute, salted apart
    before = engine.totals()
    first = engine.generate(p)
    second = engine.generate(p)
    after = engine.totals()

    saves = after.get("save_chunks", 0) - before.get("save_chunks", 0)
    assert first.num_cached_tokens == 0
    # The head that fits, not the tail: a store holding only the tail would give 0.
    assert second.num_cached_tokens >= (STORE_CHUNKS // 2) * CHUNK, (second, saves)
    assert second.num_cached_tokens < n_chunks * CHUNK
    assert second.tokens == first.tokens == ref
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)
