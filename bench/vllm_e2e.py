"""TTFT of a kvtier hit against recompute, on one real vLLM CPU engine, same prompts.

    kvtier bench vllm_e2e --json out.json [--tokens 4096] [--repeat 5] [--layers 4] ...
    kvtier bench vllm_e2e --disagg --json out.json [--tokens 8192] [--repeat 3] ...
    kvtier bench vllm_e2e --restart ...   (TTFT in a new engine process: vllm_restart.py)
    kvtier bench vllm_e2e --no-reuse ...  (throughput cost when nothing repeats: vllm_noreuse.py)

One engine with the kvtier connector (host tier). For each repeat, a fresh random
prompt is sent twice with a fresh cache salt: the first run misses (vLLM computes the
prefill, kvtier saves it in the background), the second hits (kvtier loads every full
chunk; vLLM computes only the tail). With ``max_tokens=1`` a request's latency is its
time to first token. The two runs of a repeat are back to back, so machine drift hits
both alike. Outputs must be identical: the first token and its top-5 logprobs, exactly.

vLLM's own prefix cache is off, so the hit can only come from kvtier. The engine runs
in-process and eager (fast start); the data path is the same as in the multi-process
engine.

**Disaggregated mode** (``--disagg``): prefill and decode on different engines.

Three processes on this machine: a ``kvtier serve`` daemon (memory only, temporary), a
prefill engine (a child process, ``kv_role = kv_producer``) and the decode engine (this
process, ``kv_consumer``), both real vLLM CPU engines with the same model, each with the
connector in daemon mode. For each repeat a fresh random prompt goes:

* **handoff**: to the prefill engine (``max_tokens=1``); its ``kv_transfer_params`` go with
  the same prompt to the decode engine, which loads the prompt's KV from the daemon
  (waiting, bounded, while the producer's save is still in flight) and computes the
  tail. The decode request's latency (``max_tokens=1``) is the decode engine's TTFT;
* **cold**: the same prompt to the same decode engine with a fresh cache salt and no
  handoff: it computes the whole prefill (the engine without a prefill partner).

The two runs of a repeat are back to back and alternate in order, so machine drift hits
both alike. Outputs must match: the first token and its top-5 logprobs. The daemon's
counters show who did what: the decode engine puts nothing, the prefill engine gets
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.common import LineChild, envelope, missing, scratch_dir, write_json
from kvtier.bench.tiny_llama import (
    add_engine_options,
    bench_geometry,
    engine_args,
    kvtier_transfer,
    write_tiny_llama,
)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench vllm_e2e", description=__doc__)
    add_engine_options(p)
    p.add_argument("--model-dir", default=None, help="where to write the model (default: tmp)")
    p.add_argument(
        "--source",
        choices=("kvtier", "prefix-cache", "example"),
        default="kvtier",
        help="where the hit comes from: kvtier (prefix cache off), or vLLM's own prefix cache "
        "(no connector): the in-memory best case, and a control for numerical noise; or "
        "vLLM's ExampleConnector (safetensors files on disk, under a temporary folder)",
    )
    p.add_argument(
        "--gap-s",
        type=float,
        default=0.0,
        help="pause between the miss and the hit (0: back to back, the hit waits for the "
        "miss's saves to land; > 0: the hit measures the load alone)",
    )
    p.add_argument(
        "--daemon",
        default=None,
        metavar="URL",
        help="kvtier source only: the connector uses this running daemon (`kvtier serve`, "
        "service.max_value_bytes >= the chunk) instead of an embedded host tier",
    )
    p.add_argument("--token", default=None, help="bearer token for --daemon")
    p.add_argument(
        "--disagg",
        action="store_true",
        help="disaggregated mode: a prefill engine (kv_producer) and "
        "this decode engine (kv_consumer) share a temporary kvtier daemon; the decode "
        "engine's TTFT after the handoff against the same engine cold",
    )
    return p.parse_args(argv)


def _env() -> None:
    # In-process, eager engines start fast; the data path is the multi-process one's.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


# One request timed to its first token: seconds, tokens vLLM found cached, the first
# token, and the top-5 logprobs of that position.
_FirstToken = tuple[float, int, int, dict[int, float]]


def _first_token(llm: Any, prompt: Any, params: Any) -> _FirstToken:
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    lp = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
    top = {int(t): float(v.logprob) for t, v in lp.items()}
    return dt, int(out.num_cached_tokens or 0), int(out.outputs[0].token_ids[0]), top


def _dlogprob(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest difference of the top-5 logprobs both runs list (inf: none in common)."""
    common = a.keys() & b.keys()
    return max((abs(a[k] - b[k]) for k in common), default=float("inf"))


@dataclass
class _Pairs:
    """Hit runs against their baseline runs (back to back), and whether the outputs agree."""

    hit_s: list[float] = field(default_factory=list)
    base_s: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    same: int = 0
    max_dlogprob: float = 0.0

    def add(self, hit: _FirstToken, base: _FirstToken) -> float:
        """Record one pair; returns its largest top-5 logprob difference."""
        self.hit_s.append(hit[0])
        self.base_s.append(base[0])
        self.cached.append(hit[1])
        self.same += hit[2] == base[2]
        dlp = _dlogprob(base[3], hit[3])
        self.max_dlogprob = max(self.max_dlogprob, dlp)
        return dlp

    def fields(self, base: str) -> dict[str, Any]:
        """The row's timing and agreement fields; ``base`` names the baseline's."""
        med_hit, med_base = statistics.median(self.hit_s), statistics.median(self.base_s)
        pairs = [h / b for h, b in zip(self.hit_s, self.base_s, strict=True)]
        n = len(pairs)
        return {
            "ttft_s": med_hit,
            "ttft_min_s": min(self.hit_s),
            "ttft_max_s": max(self.hit_s),
            f"{base}_ttft_s": med_base,
            f"{base}_min_s": min(self.base_s),
            f"{base}_max_s": max(self.base_s),
            "ratio": med_hit / med_base,
            # Per repeat (the two runs of a pair are back to back): robust to machine drift.
            "pair_ratio_median": statistics.median(pairs),
            "pair_ratio_min": min(pairs),
            "pair_ratio_max": max(pairs),
            "hit_cached_tokens": statistics.median(self.cached),
            "identical_first_tokens": f"{self.same}/{n}",
            "max_abs_dlogprob_top5": self.max_dlogprob,
        }


def main(argv: list[str]) -> int:
    if "--restart" in argv:  # two engine processes: see kvtier.bench.vllm_restart
        from kvtier.bench.vllm_restart import main as restart_main

        rc: int = restart_main(argv)
        return rc
    if "--no-reuse" in argv:  # two engine processes: see kvtier.bench.vllm_noreuse
        from kvtier.bench.vllm_noreuse import main as noreuse_main

        rc = noreuse_main(argv)
        return rc
    a = _args(argv)
    if missing("vllm", "every vllm_e2e row", "pip install 'kvtier[vllm]'"):
        return 0
    if a.disagg:
        return run_disagg(a)
    _env()
    geo = bench_geometry(a)
    model = write_tiny_llama(a.model_dir or str(scratch_dir("kvtier-bench-llama-")), geo)

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    kvtier = a.source == "kvtier"
    connector_cfg: dict[str, Any] = {
        "kv_transfer_config": kvtier_transfer(
            "kv_both", a.chunk_tokens, [{"kind": "host", "capacity_bytes": a.host_bytes}]
        )
    }
    if a.daemon:
        # Daemon mode: the host tier above only sizes the scheduler's mirror.
        extra = connector_cfg["kv_transfer_config"]["kv_connector_extra_config"]
        extra.update({"url": a.daemon, **({"token": a.token} if a.token else {})})
    if a.source == "example":
        connector_cfg = {
            "kv_transfer_config": {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(scratch_dir("kvtier-bench-example-"))
                },
            }
        }
    llm = LLM(
        **engine_args(model, a.tokens, a.dtype, prefix_caching=a.source == "prefix-cache"),
        **(connector_cfg if a.source != "prefix-cache" else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    rng = random.Random(0)

    def run(tokens: list[int], salt: str) -> _FirstToken:
        return _first_token(llm, TokensPrompt(prompt_token_ids=tokens, cache_salt=salt), params)

    runs = _Pairs()
    misses_clean = True
    for i in range(a.warmup + a.repeat):
        tokens = [rng.randrange(3, geo.vocab) for _ in range(a.tokens)]
        salt = f"bench-{i}-{rng.random()}"
        miss = run(tokens, salt)
        if a.gap_s > 0:
            time.sleep(a.gap_s)
        hit = run(tokens, salt)
        if i < a.warmup:
            continue
        misses_clean &= miss[1] == 0
        dlp = runs.add(hit, miss)
        print(
            f"repeat {i - a.warmup}: recompute {miss[0]:.3f}s  hit {hit[0]:.3f}s  cached {hit[1]}  "
            f"token {miss[2]}/{hit[2]}  max|dlogprob| {dlp:.4f}"
        )

    totals: dict[str, float] = {}
    if kvtier:
        connector: Any = get_kv_transfer_group()
        totals = connector.worker.totals()
    kv_bytes_per_token = geo.kv_bytes_per_token(a.dtype)
    row: dict[str, Any] = {
        "scenario": f"same prompt twice, fresh salt per repeat; hit from {a.source}",
        "prompt_tokens": a.tokens,
        "tier": "daemon"
        if kvtier and a.daemon
        else {"kvtier": "host", "prefix-cache": "vllm-prefix-cache"}.get(a.source, "disk"),
        **runs.fields("recompute"),
        "outputs_identical": runs.same == a.repeat and misses_clean,
        "dtype": a.dtype,
        "chunk_tokens": a.chunk_tokens if a.source == "kvtier" else None,
        "gap_s": a.gap_s,
    }
    print(
        f"{a.tokens}-token prompt: hit {row['ttft_s']:.3f}s vs recompute "
        f"{row['recompute_ttft_s']:.3f}s -> ratio {row['ratio']:.3f} (median of {a.repeat}); "
        f"first tokens identical {runs.same}/{a.repeat}, max |dlogprob| {runs.max_dlogprob:.4f}"
    )
    write_json(
        a.json,
        envelope(
            "vllm_e2e",
            [row],
            geometry=asdict(geo),
            kv_bytes_per_token=kv_bytes_per_token,
            connector_totals=totals,
        ),
    )
    return 0


MARK = "KVTIER-PRODUCER "


def _engine_kwargs(a: argparse.Namespace, model: Path, role: str, url: str) -> dict[str, Any]:
    return {
        **engine_args(model, a.tokens, a.dtype),
        "kv_transfer_config": kvtier_transfer(
            role,
            a.chunk_tokens,
            [{"kind": "host", "capacity_bytes": a.host_bytes}],
            url=url,
            daemon_timeout_s=10.0,
            prefill_wait_s=30.0,
        ),
    }


def producer_child(argv: list[str]) -> int:
    """The prefill engine: one JSON prompt per stdin line, one result line per prompt."""
    a = argparse.Namespace(**json.loads(argv[0]))
    _env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**_engine_kwargs(a, Path(a.model), "kv_producer", a.url))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        tokens = json.loads(line)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        print(MARK + json.dumps({"s": dt, "params": out.kv_transfer_params}), flush=True)
    return 0


def _start_producer(a: argparse.Namespace, model: Path, url: str, log: Path) -> LineChild:
    """The prefill engine's child process (:func:`producer_child`): tokens in, a result out."""
    spec = {**vars(a), "model": str(model), "url": url}
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_e2e", "--producer-child", json.dumps(spec)]
    return LineChild(cmd, log, MARK, "the prefill engine")


def run_disagg(a: argparse.Namespace) -> int:
    """The disaggregated mode (``--disagg``); see the module docstring."""
    import httpx

    _env()
    geo = bench_geometry(a)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-disagg-"))
    model = write_tiny_llama(a.model_dir or tmp / "model", geo)
    kv_bytes_per_token = geo.kv_bytes_per_token(a.dtype)
    from kvtier.bench._daemon_load import start_kvtier

    url, daemon = start_kvtier(tmp, "2GiB", max_value_bytes=kv_bytes_per_token * a.chunk_tokens)
    producer: LineChild | None = None
    finished = False
    try:
        producer = _start_producer(a, model, url, tmp / "producer.log")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**_engine_kwargs(a, model, "kv_consumer", url))
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

        def decode(
            tokens: list[int], salt: str | None, handoff: dict[str, Any] | None
        ) -> _FirstToken:
            p = TokensPrompt(prompt_token_ids=tokens)
            if salt is not None:
                p["cache_salt"] = salt
            sp = params.clone()
            if handoff is not None:
                sp.extra_args = {"kv_transfer_params": handoff}
            return _first_token(llm, p, sp)

        def counters() -> dict[str, int]:
            st: dict[str, int] = httpx.get(url + "/v1/stats", timeout=10).json()["store"]
            return st

        rng = random.Random(0)
        runs = _Pairs()
        prefill_s: list[float] = []
        producer_gets = 0
        for i in range(a.warmup + a.repeat):
            tokens = [rng.randrange(3, geo.vocab) for _ in range(a.tokens)]
            before = counters()
            pre = producer.ask(tokens)
            mid = counters()  # the decode engine is idle until here: gets are the producer's
            if i % 2 == 0:
                hit = decode(tokens, None, pre["params"])
                cold = decode(tokens, f"cold-{i}-{rng.random()}", None)
            else:
                cold = decode(tokens, f"cold-{i}-{rng.random()}", None)
                hit = decode(tokens, None, pre["params"])
            if i < a.warmup:
                continue
            producer_gets += mid["gets"] - before["gets"]
            prefill_s.append(float(pre["s"]))
            dlp = runs.add(hit, cold)
            print(
                f"repeat {i - a.warmup}: prefill engine {pre['s']:.3f}s  decode engine: cold "
                f"{cold[0]:.3f}s, after handoff {hit[0]:.3f}s (cached {hit[1]})  token "
                f"{cold[2]}/{hit[2]}  max|dlogprob| {dlp:.4f}"
            )
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector: Any = get_kv_transfer_group()
        consumer_totals: dict[str, float] = dict(connector.worker.totals())
        finished = True
    finally:
        if producer is not None:
            producer.close()
        daemon.terminate()
        daemon.wait()
        if finished:  # the model, the daemon's data; the logs stay when something failed
            shutil.rmtree(tmp, ignore_errors=True)

    row: dict[str, Any] = {
        "scenario": "disaggregated: prefill engine (kv_producer) -> daemon -> decode engine "
        "(kv_consumer); decode TTFT after the handoff vs the same engine cold",
        "prompt_tokens": a.tokens,
        "tier": "daemon",
        **runs.fields("cold"),
        "prefill_engine_s": statistics.median(prefill_s),
        "outputs_identical": runs.same == a.repeat,
        "producer_daemon_gets": producer_gets,
        # The decode engine's own counters (the producer's saves land while it runs).
        "consumer_save_chunks": consumer_totals.get("save_chunks", 0),
        "consumer_load_chunks": consumer_totals.get("load_chunks", 0),
        "dtype": a.dtype,
        "chunk_tokens": a.chunk_tokens,
    }
    print(
        f"{a.tokens}-token prompt: decode engine after handoff {row['ttft_s']:.3f}s vs cold "
        f"{row['cold_ttft_s']:.3f}s -> ratio {row['ratio']:.3f} (pairs {row['pair_ratio_median']:.3f}, "
        f"median of {a.repeat}); first tokens identical {runs.same}/{a.repeat}; daemon gets by the "
        f"prefill engine {producer_gets}; chunks saved by the decode engine "
        f"{row['consumer_save_chunks']}"
    )
    write_json(
        a.json,
        envelope(
            "vllm_e2e",
            [row],
            mode="disagg",
            geometry=asdict(geo),
            kv_bytes_per_token=kv_bytes_per_token,
            consumer_totals=consumer_totals,
        ),
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--producer-child":
        sys.exit(producer_child(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
