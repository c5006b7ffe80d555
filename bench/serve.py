"""Serving under load: a Mooncake trace replayed through real vLLM API servers.

    kvtier bench serve --json out.json [--trace mooncake-conversation] [--requests 160]
        [--conversations 40] [--duration-s 120] [--block-tokens 32] [--vllm-kv-tokens 16384]
        [--rows none,noop,kvtier,daemon,native] [--no-reuse] [--device auto|cpu|cuda]
        [--budget-s 0] [--log-dir DIR]

Each row is one ``vllm.entrypoints.openai.api_server`` process started by the
benchmark (the multi-process engine ``vllm serve`` runs, vLLM's own prefix cache on),
on the same model, the same prompts and the same arrival times:

* ``none``: no KV connector;
* ``noop``: a connector that does nothing (``kvtier.bench._noop_connector``): the
  baseline, since configuring *any* connector changes vLLM's engine apart from caching;
* ``kvtier``: kvtier's connector with an embedded host tier;
* ``daemon``: kvtier's connector in daemon mode, against a ``kvtier serve`` started here;
* ``native``: vLLM's own CPU offloading (``--kv-offloading-size``), where it runs
  (vLLM's CUDA build; its CPU build refuses it).

The device (``--device``, by default CUDA where torch sees a GPU) sets the model and
the scale (bench/_serve_model.py): on a CPU, a small Llama with random weights, short
prompts and a two-minute replay; on a CUDA GPU, Llama-3-8B's geometry with vLLM's dummy
weights redrawn in each server (through its ``/collective_rpc``, so ``VLLM_SERVER_DEV_MODE``
is on there), prompts of thousands of tokens and a 30-second replay. Every option given
on the command line wins over the device's default.

The trace's requests become token prompts: each ``hash_id`` (one 512-token block in the
trace) is a block of ``--block-tokens`` deterministic random tokens, so requests that
share hash ids share a prefix, and lengths scale by ``block_tokens / 512``. Arrival
times are compressed so that the slice arrives within ``--duration-s``. Every request
asks for one greedy token, so its latency is its time to first token (TTFT). A request
is sent at its arrival time whatever is still in flight (an open-loop load).

Reported per row: TTFT p50/p90/p99, prompt tokens per second over the replay
(first arrival to last answer), vLLM's local and external (connector) prefix-cache hit
rates from its ``/metrics``, whether each request's token equals the ``none`` row's, and
the host's load average as the replay starts and ends (TTFT under a burst is queueing:
a row that shares the cores with other work drains its bursts slower).
Ratios are against the ``noop`` row (or ``none`` without it). ``--no-reuse`` salts every
request's tokens so that nothing repeats (the overhead case).

vLLM's KV pool is ``--vllm-kv-tokens`` (``--num-gpu-blocks-override``): choose it below
the slice's working set to see what a cache below vLLM adds, above it to see that
nothing is lost when vLLM's own cache suffices.

``--budget-s`` bounds the whole run (a GPU lent for minutes): a row is not started when
the time left is shorter than the longest row so far, a replay still running at the
end is cut (that row records an error), and the JSON is rewritten after every row, so
what finished is kept whatever stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench._serve_model import (
    DEVICES,
    MODELS,
    WEIGHTS,
    ServeModel,
    apply_defaults,
    detect_device,
    sharpen_server,
    write_model,
)
from kvtier.bench.common import envelope, free_port, missing, write_json
from kvtier.bench.tiny_llama import BENCH_GEOMETRY
from kvtier.traces import resolve_trace

ROWS = ("none", "noop", "kvtier", "daemon", "native")
TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids each stand for 512 tokens
VLLM_BLOCK = 32  # vLLM's block size on the CPU build: a multiple of 32
# What a server needs after its replay: the stop (SIGTERM, the engine's exit) and the JSON.
STOP_RESERVE_S = 20.0


@dataclass(frozen=True, slots=True)
class Request:
    """One replayed request: when it arrives (s after the first) and its prompt."""

    at_s: float
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Answer:
    """What came back for one request."""

    sent_s: float
    ttft_s: float
    token: int
    cached_tokens: int


def _args(argv: list[str], detect: Callable[[], str] = lambda: "cpu") -> argparse.Namespace:
    """The options; ``--device auto`` becomes what ``detect`` answers (``main`` passes
    :func:`detect_device`), and each option left unset takes that device's default
    (bench/_serve_model.py)."""
    p = argparse.ArgumentParser(prog="kvtier bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="mooncake-conversation")
    p.add_argument(
        "--device", choices=("auto", *DEVICES), default="auto",
        help="sets the defaults marked [device] (auto: cuda where torch sees a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--conversations", type=int, default=None,
        help="replay every turn of this many multi-turn conversations (0: a slice "
        "instead) [device: 40 cpu, 20 cuda]",
    )  # fmt: skip
    p.add_argument("--start", type=int, default=0, help="with --conversations 0: first request")
    p.add_argument("--requests", type=int, default=160, help="with --conversations 0: how many")
    p.add_argument(
        "--duration-s", type=float, default=None,
        help="the slice arrives within this [device: 120 cpu, 30 cuda]",
    )  # fmt: skip
    p.add_argument(
        "--block-tokens", type=int, default=None,
        help="tokens per trace hash_id [device: 32 cpu, 256 cuda]",
    )  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="[device: 4096, 16384]")
    p.add_argument("--no-reuse", action="store_true", help="salt every prompt: nothing repeats")
    p.add_argument("--rows", default="none,noop,kvtier,daemon,native")
    p.add_argument(
        "--vllm-kv-tokens", type=int, default=None,
        help="vLLM's own KV pool [device: 16384 cpu, 32768 cuda]",
    )  # fmt: skip
    p.add_argument("--vllm-block", type=int, default=None, help="vLLM's --block-size [32, 16]")
    p.add_argument(
        "--host-bytes", default=None, help="kvtier's host tier [device: 2GiB cpu, 24GiB cuda]"
    )
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument(
        "--native-gib", type=float, default=None,
        help="vLLM's CPU offloading size [device: 2 cpu, 24 cuda]",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=None, help="[device: 4096, 8192]")
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bfloat16, float32)")
    p.add_argument(
        "--model", choices=MODELS, default=None,
        help="tiny (--layers, --kv-heads) or Llama-3-8B's geometry [device: tiny, llama3-8b]",
    )  # fmt: skip
    p.add_argument(
        "--weights", choices=WEIGHTS, default=None,
        help="random: written to safetensors (tiny only); dummy: vLLM's, redrawn in the "
        "server [model: random tiny, dummy llama3-8b]",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=BENCH_GEOMETRY.layers, help="tiny model")
    p.add_argument("--kv-heads", type=int, default=BENCH_GEOMETRY.kv_heads, help="tiny model")
    p.add_argument("--start-timeout-s", type=float, default=None, help="[device: 300, 240]")
    p.add_argument(
        "--budget-s", type=float, default=0.0,
        help="bound the whole run to this many seconds (0: none); see the module's doc",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="runs of every row, order alternating")
    p.add_argument("--keep", action="store_true", help="keep the servers' logs and the model")
    p.add_argument("--log-dir", default=None, help="write the servers' logs here (kept)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = detect()
    apply_defaults(a)
    a.rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in a.rows if r not in ROWS]
    if bad:
        p.error(f"unknown rows {bad}; choose from {','.join(ROWS)}")
    if a.block_tokens < 1 or a.requests < 1 or a.duration_s <= 0:
        p.error("--block-tokens and --requests must be >= 1, --duration-s > 0")
    if a.model != "tiny" and a.weights != "dummy":
        p.error(f"--model {a.model} runs with --weights dummy only (no weights are written)")
    if a.chunk_tokens % a.vllm_block:
        p.error("--chunk-tokens must be a multiple of --vllm-block")
    return a


def _conversations(rows: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """Every turn of the first ``k`` conversations with two turns or more, in trace order.

    A conversation is the requests that share their first two blocks (the first is the
    trace's common system prompt); its later turns extend its earlier ones.
    """
    turns: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        turns.setdefault(tuple(r["hash_ids"][:2]), []).append(i)
    chosen = sorted((v for v in turns.values() if len(v) >= 2), key=lambda v: v[0])[:k]
    return [rows[i] for i in sorted(i for v in chosen for i in v)]


def load_requests(a: argparse.Namespace, vocab: int) -> list[Request]:
    """The trace's requests as token prompts, arrivals compressed into ``a.duration_s``."""
    path = resolve_trace(a.trace)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        every = [json.loads(line) for line in f if line.strip()]
    if a.conversations > 0:
        rows = _conversations(every, a.conversations)
    else:
        rows = every[a.start : a.start + a.requests]
    if not rows:
        raise SystemExit(f"no requests chosen from {a.trace}")
    t0 = rows[0]["timestamp"]
    span_ms = max(1, rows[-1]["timestamp"] - t0)
    scale = a.duration_s / (span_ms / 1000.0)
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(h * 7919 + 17)
            blocks[h] = [rng.randrange(3, vocab) for _ in range(a.block_tokens)]
        return blocks[h]

    out: list[Request] = []
    for i, r in enumerate(rows):
        n = round(r["input_length"] * a.block_tokens / TRACE_BLOCK_TOKENS)
        n = max(a.vllm_block, min(a.max_prompt_tokens, n))
        toks = [t for h in r["hash_ids"] for t in block(h)][:n]
        if len(toks) < n:  # the trace's last block may be longer than its ids say
            toks += block(-1 - i)[: n - len(toks)]
        if a.no_reuse:
            rng = random.Random(1_000_003 * (a.start + i) + 1)
            toks = [rng.randrange(3, vocab) for _ in toks]
        at_s = (r["timestamp"] - t0) / 1000.0 * scale
        out.append(Request(at_s, tuple(toks)))
    return out


class Server:
    """One vLLM API server process (its own process group, so a stop takes its engine)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
                 "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")
                # The root cause, not the launcher's "initialization failed" after it.
                # A warning may quote an error ("OSError: [Errno 24]" in vLLM's ulimit one).
                cause = [
                    ln for ln in text.splitlines()
                    if "Error: " in ln and "Engine core initialization failed" not in ln
                    and " WARNING " not in ln
                ]  # fmt: skip
                why = cause[0].split("] ", 1)[-1].strip() if cause else "see the log"
                raise RuntimeError(f"server exited ({self.proc.returncode}): {why}\n{text[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout_s:.0f} s; see {self.log}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _server_args(a: argparse.Namespace, row: str, model: ServeModel, daemon_url: str) -> list[str]:
    longest = a.max_prompt_tokens + 64
    # --enforce-eager also on CUDA: one token per request is all prefill, which CUDA
    # graphs do not speed up, and every row's server would compile again at its start.
    args = [
        "--model", str(model.path), "--load-format", model.load_format,
        "--skip-tokenizer-init",
        "--block-size", str(a.vllm_block), "--max-model-len", str(longest),
        "--max-num-seqs", str(a.max_num_seqs),
        "--max-num-batched-tokens", str(max(a.max_batched_tokens, longest)),
        "--num-gpu-blocks-override", str(a.vllm_kv_tokens // a.vllm_block),
        "--enable-prefix-caching", "--enforce-eager", "--seed", "0", "--dtype", a.dtype,
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if model.sharpen:
        args += ["--worker-extension-cls", "kvtier.bench._serve_model.SharpenExtension"]
    tiers = [{"kind": "host", "capacity_bytes": a.host_bytes}]
    ktc: dict[str, Any] | None = None
    if row == "noop":
        ktc = {"kv_connector": "NoopConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "kvtier.bench._noop_connector"}  # fmt: skip
    elif row in ("kvtier", "daemon"):
        extra: dict[str, Any] = {"store.chunk_tokens": a.chunk_tokens, "tiers": tiers}
        if row == "daemon":
            extra["url"] = daemon_url
        ktc = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "kvtier.connectors.vllm",
               "kv_connector_extra_config": extra}  # fmt: skip
    elif row == "native":
        args += ["--kv-offloading-size", str(a.native_gib), "--kv-offloading-backend", "native"]
    if ktc is not None:
        args += ["--kv-transfer-config", json.dumps(ktc)]
    return args


def _metrics(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (summed over label sets)."""
    import httpx

    want = (
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    )  # fmt: skip
    out = dict.fromkeys(want, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def _replay(
    url: str, model: str, reqs: list[Request], timeout_s: float | None = None
) -> list[Answer]:
    """Send each request at its arrival time (open loop); one greedy token each.

    Raises:
        TimeoutError: not every answer came within ``timeout_s`` (None: no bound).
    """
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=1800.0, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(r: Request) -> Answer:
            delay = r.at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            body = {"model": model, "prompt": list(r.tokens), "max_tokens": 1,
                    "temperature": 0, "ignore_eos": True, "detokenize": False,
                    "return_token_ids": True}  # fmt: skip
            resp = await client.post(url + "/v1/completions", json=body)
            resp.raise_for_status()
            out = resp.json()
            done = time.perf_counter()
            details = out["usage"].get("prompt_tokens_details") or {}
            return Answer(
                sent_s=sent - t0,
                ttft_s=done - sent,
                token=int(out["choices"][0]["token_ids"][0]),
                cached_tokens=int(details.get("cached_tokens") or 0),
            )

        return list(await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), timeout_s))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def reusable_tokens(reqs: list[Request], block: int = VLLM_BLOCK) -> list[int]:
    """Per request: its leading tokens, in whole ``block``s, that an earlier request's
    prompt also starts with (what any prefix cache could serve it, however large)."""
    seen: set[int] = set()
    out: list[int] = []
    for r in reqs:
        key, n, shared = 0, 0, True
        for i in range(0, len(r.tokens) - block + 1, block):
            key = hash((key, r.tokens[i : i + block]))  # names the whole prefix
            if shared and key in seen:
                n += block
            else:
                shared = False
            seen.add(key)
        out.append(n)
    return out


def distinct_blocks(reqs: list[Request], block: int) -> int:
    """Distinct prefixes of whole ``block``s over all prompts: the blocks a cache would
    keep to hold every prefix (the slice's working set, in blocks)."""
    seen: set[int] = set()
    for r in reqs:
        key = 0
        for i in range(0, len(r.tokens) - block + 1, block):
            key = hash((key, r.tokens[i : i + block]))  # names the whole prefix
            seen.add(key)
    return len(seen)


def reuse_figures(ttft: list[float], reusable: list[int], least: int) -> dict[str, Any]:
    """TTFT percentiles of the requests with at least ``least`` reusable tokens: where a
    cache can act at all. A trace's first turns share nothing but a system prompt, and
    when they arrive together their burst sets the all-request percentiles."""
    xs = [t for t, n in zip(ttft, reusable, strict=True) if n >= least]
    if not xs:
        return {"reuse_requests": 0}
    return {
        "reuse_requests": len(xs),
        "ttft_reuse_p50_s": _pct(xs, 0.5),
        "ttft_reuse_p90_s": _pct(xs, 0.9),
        "ttft_reuse_p99_s": _pct(xs, 0.99),
    }


def _warm(url: str, model: str, vocab: int) -> None:
    """Two requests of their own tokens: the first forward passes' one-off costs."""
    rng = random.Random(99)
    warm = [Request(0.0, tuple(rng.randrange(3, vocab) for _ in range(256))) for _ in range(2)]
    asyncio.run(_replay(url, model, warm))


def _left_s(deadline: float | None, what: str) -> float | None:
    """Seconds to ``deadline`` (monotonic) less the stop's reserve; None without one."""
    if deadline is None:
        return None
    left = deadline - time.monotonic() - STOP_RESERVE_S
    if left <= 0:
        raise RuntimeError(f"out of time (--budget-s) before {what}")
    return left


def run_row(
    a: argparse.Namespace,
    row: str,
    model: ServeModel,
    reqs: list[Request],
    tmp: Path,
    reusable: list[int] | None = None,
    deadline: float | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Start the row's server(s), replay, read the counters, stop; the row's figures.

    ``deadline`` (``time.monotonic()``): the server's start and the replay are cut so
    that the row ends by then. Raises RuntimeError when the row could not be measured.
    """
    import httpx

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    if a.device == "cpu":
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="4")
    if model.sharpen:  # the /collective_rpc that redraws the dummy weights
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    daemon = None
    daemon_url = ""
    if row == "daemon":
        from kvtier.bench._daemon_load import start_kvtier

        chunk_bytes = model.kv_bytes_per_token * a.chunk_tokens
        daemon_url, daemon = start_kvtier(tmp, a.host_bytes, max_value_bytes=chunk_bytes)
    log = (log_dir or tmp) / f"{row}.log"
    t_start = time.perf_counter()
    server = Server(_server_args(a, row, model, daemon_url), log, env)
    sharpened = None
    try:
        start_left = _left_s(deadline, "the server's start")
        server.wait_ready(min(a.start_timeout_s, start_left or a.start_timeout_s))
        start_s = time.perf_counter() - t_start
        if model.sharpen:
            sharpened = sharpen_server(server.url)
        _warm(server.url, str(model.path), model.vocab)
        before = _metrics(server.url)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            answers = asyncio.run(
                _replay(server.url, str(model.path), reqs, _left_s(deadline, "the replay"))
            )
        except TimeoutError:
            raise RuntimeError(
                f"out of time (--budget-s): replay cut after {time.perf_counter() - t0:.0f} s"
            ) from None
        except httpx.HTTPError as exc:
            raise RuntimeError(f"a request failed: {exc!r}; see {log}") from exc
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()[0]
        after = _metrics(server.url)
    finally:
        server.stop()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
    d = {k: after[k] - before[k] for k in after}
    ttft = [x.ttft_s for x in answers]
    prompt_tokens = sum(len(r.tokens) for r in reqs)
    last_done = max(x.sent_s + x.ttft_s for x in answers)

    def rate(hits: str, queries: str) -> float:
        return d[hits] / d[queries] if d[queries] else 0.0

    return {
        "row": row,
        "server_start_s": start_s,
        "sharpened_tensors": sharpened,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "ttft_p99_s": _pct(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft),
        "prompt_tokens_per_s": prompt_tokens / last_done,
        "requests_per_s": len(reqs) / last_done,
        "replay_wall_s": wall,
        # The host's 1-minute load average as the replay starts and ends: TTFT under a
        # burst is queueing, so other processes on the host's cores move it several-fold.
        "load_avg_1m": [load0, load1],
        "vllm_hit_rate": rate("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "external_hit_rate": rate(
            "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"
        ),
        "cached_tokens": sum(x.cached_tokens for x in answers),
        "preemptions": d["vllm:num_preemptions_total"],
        "counters": d,
        "tokens": [x.token for x in answers],
        "ttft_s": ttft,
        **reuse_figures(ttft, reusable or [0] * len(ttft), a.chunk_tokens),
    }


def summarise(
    a: argparse.Namespace, runs: list[dict[str, Any]], n: int, *, quiet: bool = False
) -> list[dict[str, Any]]:
    """Per row: the median over repeats of each figure and of its ratio to the baseline
    of the same repeat; outputs compared with the ``none`` row of the same repeat (the
    baseline's where ``none`` was not run). ``quiet``: print nothing."""
    done = [r for r in runs if "error" not in r]
    rows_run = {r["row"] for r in done}
    base = "noop" if "noop" in rows_run else "none" if "none" in rows_run else None
    ref_row = "none" if "none" in rows_run else base
    by = {(r["row"], r["repeat"]): r for r in done}
    out: list[dict[str, Any]] = []
    # Each figure and the name of its ratio to the baseline.
    ratios = {
        "ttft_p50_s": "ttft_p50_ratio",
        "ttft_p90_s": "ttft_p90_ratio",
        "ttft_p99_s": "ttft_p99_ratio",
        "prompt_tokens_per_s": "throughput_ratio",
        "ttft_reuse_p50_s": "ttft_reuse_p50_ratio",
        "ttft_reuse_p99_s": "ttft_reuse_p99_ratio",
    }
    for row in a.rows:
        mine = [r for r in done if r["row"] == row]
        if not mine:
            out.append({"row": row, "errors": [r["error"] for r in runs if r["row"] == row]})
            continue
        s: dict[str, Any] = {"row": row, "repeats": len(mine), "baseline": base}
        for f in (*ratios, "vllm_hit_rate", "external_hit_rate", "cached_tokens", "preemptions"):
            if all(f in r for r in mine):  # no reusing request: no such percentiles
                s[f] = statistics.median(r[f] for r in mine)
        same = total = 0
        for r in mine:
            ref = by.get((ref_row, r["repeat"])) if ref_row else None
            if ref is not None:
                same += sum(x == y for x, y in zip(r["tokens"], ref["tokens"], strict=True))
                total += n
            b = by.get((base, r["repeat"])) if base else None
            if b is not None:
                for f, name in ratios.items():
                    if f in r and b.get(f):
                        r[name] = r[f] / b[f]
        s["outputs_identical"] = f"{same}/{total}"
        s["outputs_reference"] = ref_row
        for key in ratios.values():
            vals = [r[key] for r in mine if key in r]
            if vals:
                s[key] = statistics.median(vals)
                s[key + "s"] = vals
        s["runs"] = mine
        out.append(s)
    if base is not None and not quiet:
        print(f"against {base}, median over {a.repeat} repeat(s):")
        for s in out:
            if "ttft_p50_ratio" in s:
                print(
                    f"{s['row']:>7}: TTFT p50 {s['ttft_p50_ratio']:.2f}x  p90 "
                    f"{s['ttft_p90_ratio']:.2f}x  p99 {s['ttft_p99_ratio']:.2f}x  throughput "
                    f"{s['throughput_ratio']:.2f}x  outputs identical to {ref_row} "
                    f"{s['outputs_identical']}"
                    + (
                        f"  reusing: p50 {s['ttft_reuse_p50_ratio']:.2f}x  p99 "
                        f"{s['ttft_reuse_p99_ratio']:.2f}x"
                        if "ttft_reuse_p50_ratio" in s
                        else ""
                    )
                )
    return out


def main(argv: list[str]) -> int:
    t_begin = time.monotonic()
    a = _args(argv, detect_device)
    if missing("vllm", "every serve row", "pip install 'kvtier[vllm]'"):
        return 0
    if missing("httpx", "every serve row", "pip install 'kvtier[service]'"):
        return 0
    deadline = t_begin + a.budget_s if a.budget_s > 0 else None
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    model = write_model(a, tmp / "model")
    reqs = load_requests(a, model.vocab)
    kv_per_token = model.kv_bytes_per_token
    prompt_tokens = sum(len(r.tokens) for r in reqs)
    block = a.vllm_block
    distinct = distinct_blocks(reqs, block)
    print(
        f"{a.device}, model {a.model} ({a.weights} weights, "
        f"{kv_per_token // 1024} KiB of KV per token): "
        f"{len(reqs)} requests of {a.trace} ("
        + (f"{a.conversations} conversations" if a.conversations > 0 else f"from #{a.start}")
        + f") in {a.duration_s:.0f} s, "
        f"{prompt_tokens} prompt tokens ({prompt_tokens / len(reqs):.0f} per request), "
        f"working set {distinct * block} tokens = "
        f"{distinct * block * kv_per_token / 2**20:.0f} MiB of KV; vLLM's pool "
        f"{a.vllm_kv_tokens} tokens" + (" (no reuse)" if a.no_reuse else "")
    )
    # Near the engine's capacity TTFT is all queueing, and a few percent of throughput
    # swings it several-fold: compare rows at an offered load well below capacity.
    reusable = reusable_tokens(reqs, block)
    reusing = sum(n >= a.chunk_tokens for n in reusable)
    print(
        f"{reusing} requests start with {a.chunk_tokens}+ tokens an earlier one started with "
        f"({sum(reusable)} reusable tokens): the 'reusing' percentiles are theirs"
    )
    offered = prompt_tokens / max(r.at_s for r in reqs)
    print(
        f"offered load {offered:.0f} prompt tokens/s; a row's throughput near it means "
        "the engine kept up, below it that requests queued"
    )
    runs: list[dict[str, Any]] = []  # one per row and repeat, in the order run

    def report(quiet: bool) -> None:
        write_json(
            a.json,
            envelope(
                "serve",
                summarise(a, runs, len(reqs), quiet=quiet),
                geometry=model.geometry,
                kv_bytes_per_token=kv_per_token,
                options=vars(a),
                requests=len(reqs),
                prompt_tokens=prompt_tokens,
                offered_prompt_tokens_per_s=offered,
                working_set_tokens=distinct * block,
                reusable_tokens=reusable,
                wall_s=time.monotonic() - t_begin,
            ),
        )

    ok = False
    longest_row_s = 0.0
    try:
        for rep in range(a.repeat):
            # Every other repeat runs the rows backwards: a drift of the machine's load
            # then hits each row from both sides (the rows' ratios are per repeat).
            order = a.rows if rep % 2 == 0 else a.rows[::-1]
            for row in order:
                t_row = time.monotonic()
                try:
                    if deadline is not None and deadline - t_row < longest_row_s:
                        raise RuntimeError(
                            f"out of time (--budget-s): {deadline - t_row:.0f} s left, "
                            f"a row took up to {longest_row_s:.0f} s"
                        )
                    r = run_row(a, row, model, reqs, tmp, reusable, deadline, log_dir)
                except RuntimeError as exc:
                    print(f"{row}: not run: {str(exc).splitlines()[0]}")
                    runs.append({"row": row, "repeat": rep, "error": str(exc)[-2000:]})
                    report(quiet=True)
                    continue
                finally:
                    longest_row_s = max(longest_row_s, time.monotonic() - t_row)
                r["repeat"] = rep
                runs.append(r)
                report(quiet=True)
                print(
                    f"{row:>7} #{rep}: TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms  p90 "
                    f"{r['ttft_p90_s'] * 1e3:8.1f}  p99 {r['ttft_p99_s'] * 1e3:8.1f}  "
                    f"{r['prompt_tokens_per_s']:7.0f} prompt tok/s  vLLM hits "
                    f"{100 * r['vllm_hit_rate']:5.1f}%  external "
                    f"{100 * r['external_hit_rate']:5.1f}%  preemptions {r['preemptions']:.0f}"
                    f"  load {r['load_avg_1m'][0]:.1f}-{r['load_avg_1m'][1]:.1f}"
                    f"  server start {r['server_start_s']:.0f} s"
                )
        ok = True
    finally:
        if ok and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and model kept in {tmp}")
    report(quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
