"""Prefill/decode disaggregation: a kv_producer and a kv_consumer share one ``kvtier serve``.

Real components only: a daemon subprocess, two OpenAI API servers (vLLM's default
multi-process engine, what ``vllm serve`` runs) with the connector in daemon mode, and
``examples/disagg_proxy.py`` in front of them. One scenario runs once (two engine starts,
made at the same time) and the tests below read its record:

* references: the producer computes each prompt in full (it never loads, and a cache salt
  keeps these apart from the handoff's keys);
* A: a request through the proxy: the producer prefills, the consumer decodes from the
  daemon;
* B: the same prompt again on the producer: it must neither load nor re-put;
* C: the consumer gets a request naming a prefill that has not started, then the producer
  runs it: the consumer waits instead of recomputing;
* D: the consumer gets a request naming a prefill that never comes: after its wait_s it
  computes, and saves nothing;
* E: the producer is killed; a request through the proxy is computed by the consumer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import BLOCK, CHUNK, kv_transfer_config, prompt
from tests.procs import engine_env, kill_group
from tests.service.conftest import Daemon, free_port, start_daemon

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420
PROMPT_TOKENS = 300  # 4 full chunks of 64 tokens; a load covers all 4
HIT_TOKENS = 4 * CHUNK
# 300 + 24 = 324 tokens: the decode completes a fifth chunk, which a saving engine would store.
OUT_TOKENS = 24


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)  # and the engine's shared memory, which a crash leaves

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _serve(model: str, role: str, daemon: str, log: Path, **extra: Any) -> Server:
    port = free_port()
    ktc = kv_transfer_config(url=daemon, daemon_timeout_s=2.0, **extra)
    ktc["kv_role"] = role
    args = [
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--load-format", "safetensors", "--skip-tokenizer-init", "--block-size", str(BLOCK),
        "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc),
    ]  # fmt: skip
    if role == "kv_producer":
        # Off, so that the repeat in B would be a kvtier load (and not vLLM's own hit) if
        # the producer loaded at all.
        args.append("--no-enable-prefix-caching")
    env = engine_env(log.parent)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", proc, log)


def _wait_ready(s: Server, deadline: float) -> None:
    while True:
        if s.proc.poll() is not None:
            pytest.fail(f"{s.url} exited with {s.proc.returncode}:\n{s.log.read_text()[-4000:]}")
        try:
            if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{s.url} did not start:\n{s.log.read_text()[-4000:]}")
        time.sleep(1)


@dataclass
class Out:
    tokens: list[int]
    cached: int
    params: dict[str, Any] | None


def complete(
    url: str, model: str, tokens: list[int], max_tokens: int = OUT_TOKENS, **kw: Any
) -> Out:
    body = {
        "model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "detokenize": False, "return_token_ids": True, **kw,
    }  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.load(r)
    details = out["usage"].get("prompt_tokens_details") or {}
    return Out(
        list(out["choices"][0]["token_ids"]),
        int(details.get("cached_tokens") or 0),
        out.get("kv_transfer_params"),
    )


@dataclass
class Record:
    refs: dict[str, list[int]] = field(default_factory=dict)
    outs: dict[str, Out] = field(default_factory=dict)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    consumer_log: str = ""
    proxy_log: str = ""


@pytest.fixture(scope="module")
def record(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Record]:
    tmp = tmp_path_factory.mktemp("disagg")
    daemon: Daemon = start_daemon(tmp)
    servers: list[Server] = []
    proxy: subprocess.Popen[bytes] | None = None
    rec = Record()

    def stats(name: str) -> None:
        rec.stats[name] = httpx.get(daemon.url + "/v1/stats", timeout=5).json()["store"]

    try:
        producer = _serve(tiny_model, "kv_producer", daemon.url, tmp / "producer.log")
        servers.append(producer)
        consumer = _serve(
            tiny_model, "kv_consumer", daemon.url, tmp / "consumer.log", prefill_wait_s=60
        )
        servers.append(consumer)
        deadline = time.monotonic() + START_TIMEOUT_S
        _wait_ready(producer, deadline)
        _wait_ready(consumer, deadline)
        port = free_port()
        proxy_log = tmp / "proxy.log"
        with proxy_log.open("wb") as out:
            proxy = subprocess.Popen(
                [sys.executable, str(ROOT / "examples" / "disagg_proxy.py"),
                 "--prefill", producer.url, "--decode", consumer.url, "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        proxy_url = f"http://127.0.0.1:{port}"
        _wait_ready(Server(proxy_url, proxy, proxy_log), time.monotonic() + 30)

        p = {
            name: prompt(seed, PROMPT_TOKENS)
            for name, seed in (("A", 21), ("C", 22), ("D", 23), ("E", 24))
        }
        for name, tokens in p.items():
            rec.refs[name] = complete(producer.url, tiny_model, tokens, cache_salt="ref").tokens
        # The references' saves (5 chunks each) land after their answers: let them settle.
        until = time.monotonic() + 60
        stats("start")
        while rec.stats["start"]["put_chunks"] < 5 * len(p) and time.monotonic() < until:
            time.sleep(0.2)
            stats("start")
        rec.outs["A"] = complete(proxy_url, tiny_model, p["A"])
        stats("A")
        rec.outs["B"] = complete(producer.url, tiny_model, p["A"], max_tokens=1)
        stats("B")

        # C: the decode request first (it names no chunks: every full chunk of the prompt).
        box: dict[str, Out] = {}
        waiting = {"kvtier": {"wait_s": 60}}
        t = threading.Thread(
            target=lambda: box.update(
                C=complete(consumer.url, tiny_model, p["C"], kv_transfer_params=waiting)
            )
        )
        t.start()
        until = time.monotonic() + 30
        while "for the prefill's chunks" not in consumer.log.read_text():
            if not t.is_alive() or time.monotonic() > until:
                break  # the assertions below say what went wrong
            time.sleep(0.1)
        rec.outs["C-prefill"] = complete(producer.url, tiny_model, p["C"], max_tokens=1)
        t.join(timeout=300)
        rec.outs["C"] = box["C"]
        stats("C")

        rec.outs["D"] = complete(
            consumer.url, tiny_model, p["D"], kv_transfer_params={"kvtier": {"wait_s": 1}}
        )
        stats("D")

        producer.kill()  # a crash: no clean shutdown
        rec.outs["E"] = complete(proxy_url, tiny_model, p["E"])
        stats("E")
        rec.consumer_log = consumer.log.read_text()
        rec.proxy_log = proxy_log.read_text()
        yield rec
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.terminate()
            proxy.wait()
        for s in servers:
            s.stop()
        daemon.stop()


def _delta(rec: Record, before: str, after: str, key: str) -> int:
    return rec.stats[after][key] - rec.stats[before][key]


def test_consumer_decodes_from_the_producers_prefill(record: Record) -> None:
    a = record.outs["A"]
    assert a.cached == HIT_TOKENS  # the consumer loaded the prompt's 4 chunks
    assert a.tokens == record.refs["A"]  # identical greedy output to a full recompute
    # The proxy handed the producer's kv_transfer_params over; the store got exactly the
    # producer's 4 chunks (a saving consumer would have added the fifth, from its decode).
    assert "kv_transfer_params {'kvtier': {'chunks': 4" in record.proxy_log
    assert _delta(record, "start", "A", "put_chunks") == 4
    assert _delta(record, "start", "A", "get_chunks") == 4


def test_producer_never_loads_nor_re_puts(record: Record) -> None:
    b = record.outs["B"]
    assert b.cached == 0
    assert _delta(record, "A", "B", "gets") == 0
    assert _delta(record, "A", "B", "puts") == 0  # its mirror knows the chunks are stored
    # It names the same 4 chunks as for A (keys are deterministic), already stored.
    assert b.params is not None and b.params["kvtier"]["chunks"] == 4
    assert f"'last_key': '{b.params['kvtier']['last_key']}'" in record.proxy_log


def test_consumer_waits_for_a_prefill_in_flight(record: Record) -> None:
    c = record.outs["C"]
    assert c.cached == HIT_TOKENS  # waited, then loaded (an immediate lookup recomputes)
    assert c.tokens == record.refs["C"]
    assert "the prefill's 4 chunks arrived after" in record.consumer_log


def test_consumer_saves_nothing_and_recomputes_when_the_prefill_never_comes(
    record: Record,
) -> None:
    d = record.outs["D"]
    assert d.cached == 0
    assert d.tokens == record.refs["D"]
    assert "did not arrive within 1.0 s (0 of 4 there)" in record.consumer_log
    assert _delta(record, "C", "D", "puts") == 0  # 5 full chunks computed, none saved


def test_consumer_whose_producer_died_recomputes(record: Record) -> None:
    e = record.outs["E"]
    assert e.cached == 0
    assert e.tokens == record.refs["E"]
    assert "prefill engine" in record.proxy_log and "failed" in record.proxy_log
    assert "loads 0 of 4 prompt chunks; vLLM computes the rest (not in the store)" in (
        record.consumer_log
    )
    assert _delta(record, "D", "E", "puts") == 0
    assert _delta(record, "start", "E", "put_present") == 0
