"""A load from a slow tier runs off the engine step (real vLLM engine, real daemon).

One in-process engine in daemon mode against a real ``kvtier serve``. Daemon loads are
asynchronous (``async_loads = "auto"``), so the test can hold one: it stops the daemon
(SIGSTOP) while a request whose chunks are in the daemon is admitted. The request waits
for its load while another request in the same engine keeps producing tokens, step after
step. When the daemon resumes (SIGCONT), the waiting request completes with the output
of a recompute. Then the same is done with a load that fails after its request was
scheduled: the daemon is killed while the load is in flight, and vLLM recomputes it.

float32, so that a request computed beside another rounds as it does alone.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")

from tests.connectors.conftest import (
    BLOCK,
    CHUNK,
    ENV,
    Engine,
    kv_transfer_config,
    prompt,
    tiny_llm,
)
from tests.service.conftest import Daemon, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HIT = 4 * CHUNK  # full chunks of a 300-token prompt
# Steps the waiting request's neighbour must decode while the load is held. Its prompt is
# short enough that it completes no chunk meanwhile (no save of its own waits on the
# stopped daemon).
STEPS_HELD = 16
NEIGHBOUR_TOKENS = 20


class Stepper:
    """Requests added to the engine and stepped one engine step at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine.llm.llm_engine
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: set[str] = set()

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
        self.tokens[rid] = []

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens[out.request_id] = list(out.outputs[0].token_ids)
            self.cached[out.request_id] = int(out.num_cached_tokens or 0)
            if out.finished:
                self.done.add(out.request_id)

    def loading(self) -> bool:
        """Whether vLLM holds a request in WAITING_FOR_REMOTE_KVS (its load is running)."""
        from vllm.v1.request import RequestStatus

        sched = self.engine.engine_core.engine_core.scheduler
        return any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in sched.requests.values()
        )

    def run_until(self, cond: Any, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if cond():
                return
            self.step()
        raise AssertionError(f"not reached in {max_steps} steps: {self.tokens}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("async-daemon"))
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()


@pytest.fixture(scope="module")
def engine(tiny_model: str, daemon: Daemon) -> Iterator[Engine]:
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    # A long timeout: a held load must outlast the steps the test runs, not time out.
    transfer = kv_transfer_config(url=daemon.url, daemon_timeout_s=120)
    llm = tiny_llm(tiny_model, transfer, dtype="float32", max_num_seqs=4, max_model_len=2048)
    try:
        yield Engine(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_held_load_does_not_stall_the_batch(engine: Engine, daemon: Daemon) -> None:
    p = prompt(51, 300)
    first = engine.generate(p)  # computed, stored into the daemon
    ref = engine.generate(p, cache_salt="recompute")
    assert first.num_cached_tokens == 0 and ref.num_cached_tokens == 0
    before = engine.totals()

    s = Stepper(engine)
    s.add("neighbour", prompt(52, NEIGHBOUR_TOKENS), max_tokens=40)
    s.run_until(lambda: len(s.tokens["neighbour"]) >= 2)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        s.add("held", p, max_tokens=8)
        s.run_until(s.loading)
        start = len(s.tokens["neighbour"])
        s.run_until(lambda: len(s.tokens["neighbour"]) >= start + STEPS_HELD)
        # The neighbour decoded step after step while the held request's load waited on
        # the stopped daemon (a synchronous load would have stalled every one of them).
        assert s.tokens["held"] == [] and s.loading()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    s.run_until(lambda: {"held", "neighbour"} <= s.done)
    assert s.cached["held"] == HIT  # loaded from the daemon, not recomputed
    assert s.tokens["held"] == ref.tokens == first.tokens
    after = engine.totals()
    assert after["load_async"] - before.get("load_async", 0) == 1
    assert after["load_tokens"] - before.get("load_tokens", 0) == HIT
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)


def test_an_asynchronous_load_ending_at_a_chunk_boundary(engine: Engine) -> None:
    """A prompt of whole chunks: its last chunk loads but for the block vLLM computes.

    vLLM allocates an asynchronous load's request only the blocks of its hit, so the
    load writes the last chunk's leading blocks and no others.
    """
    p = prompt(54, 5 * CHUNK)
    first = engine.generate(p)  # computed, stored into the daemon
    ref = engine.generate(p, cache_salt="recompute")
    before = engine.totals()
    again = engine.generate(p)
    after = engine.totals()
    assert ref.num_cached_tokens == 0
    assert again.num_cached_tokens == 5 * CHUNK - BLOCK
    assert again.tokens == ref.tokens == first.tokens
    assert after["load_async"] - before.get("load_async", 0) == 1
    assert after["load_tokens"] - before.get("load_tokens", 0) == 5 * CHUNK - BLOCK
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)


def test_a_load_that_fails_after_scheduling_is_recomputed(engine: Engine, daemon: Daemon) -> None:
    p = prompt(53, 300)
    engine.generate(p)  # stored into the daemon
    ref = engine.generate(p, cache_salt="recompute")
    before = engine.totals()

    s = Stepper(engine)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    s.add("failing", p, max_tokens=8)
    s.run_until(s.loading)  # admitted, its blocks allocated, its load in flight
    assert s.tokens["failing"] == []
    daemon.proc.kill()  # a crash while the load waits: the read fails
    daemon.proc.wait()
    s.run_until(lambda: "failing" in s.done)
    assert s.tokens["failing"] == ref.tokens
    assert s.cached["failing"] == 0  # nothing of the failed load was used
    after = engine.totals()
    assert after["load_async"] - before.get("load_async", 0) == 1
    assert after["load_failed_blocks"] - before.get("load_failed_blocks", 0) == HIT // BLOCK
