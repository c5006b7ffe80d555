"""Throughput cost of the connector when nothing is ever reused, on real vLLM CPU engines.

    kvtier bench vllm_e2e --no-reuse --json out.json [--prompts 8] [--tokens 1024] ...
    (also: kvtier bench vllm_noreuse ...)

Two engine processes on this machine, the same model and engine settings: one with the
kvtier connector (embedded host tier), one without. Both stay up; for each repeat a
batch of fresh random prompts (never seen before by either engine, so every lookup
misses and every saved chunk is wasted) goes to one engine and then the same batch to
the other, alternating which goes first, so machine drift hits both alike. Throughput
is (prompt + generated tokens) / wall time of the batch; the figure is the per-pair
ratio with / without the connector (1.0 = no cost; the target is >= 0.95). Beside it,
the CPU time each engine process spent on the batch (every thread: the forward's, and
the connector's save thread): on a shared machine wall time also counts other people's
work, CPU time counts only the engine's own.

vLLM's own prefix cache is off in both engines (a fresh prompt could never hit it, and
the other modes of this benchmark run without it). Outputs are greedy: the two engines
must produce the same tokens (the connector loads nothing here, so it must change
nothing). The connector's counters show that it did its work: every full chunk of
every prompt is saved (``save_chunks``), nothing is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench.common import LineChild, envelope, missing, write_json
from kvtier.bench.tiny_llama import TinyLlama, write_tiny_llama

MARK = "KVTIER-ENGINE "


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench vllm_noreuse", description=__doc__)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--repeat", type=int, default=6, help="timed batches per engine")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-bytes", default="1GiB")
    p.add_argument("--json", default=None)
    p.add_argument("--no-reuse", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _geometry(a: argparse.Namespace) -> TinyLlama:
    return TinyLlama(
        layers=a.layers,
        hidden=512,
        intermediate=1536,
        heads=8,
        kv_heads=4,
        head_dim=64,
        max_positions=max(8192, a.tokens + a.max_tokens + 64),
    )


def _engine_kwargs(a: argparse.Namespace, connector: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": a.model,
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "block_size": 32,
        "max_model_len": a.tokens + a.max_tokens + 64,
        "max_num_batched_tokens": max(2048, a.tokens + a.max_tokens + 64),
        "max_num_seqs": a.prompts,
        "enable_prefix_caching": False,
        "seed": 0,
        "enforce_eager": True,
        "dtype": a.dtype,
    }
    if connector:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "store.chunk_tokens": a.chunk_tokens,
                "tiers": [{"kind": "host", "capacity_bytes": a.host_bytes}],
            },
        }
    return kw


def engine_child(spec: str, connector: bool) -> int:
    """One engine: a JSON batch of prompts per stdin line, one result line per batch."""
    a = argparse.Namespace(**json.loads(spec))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**_engine_kwargs(a, connector))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = json.loads(line)
        if batch == "totals":
            totals: dict[str, float] = {}
            if connector:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                totals = dict(get_kv_transfer_group().worker.totals())  # type: ignore[attr-defined]
            print(MARK + json.dumps(totals), flush=True)
            continue
        prompts = [TokensPrompt(prompt_token_ids=t) for t in batch]
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        result = {
            "s": dt,
            "cpu_s": (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime),
            "tokens_in": sum(len(t) for t in batch),
            "tokens_out": sum(len(o.outputs[0].token_ids) for o in outs),
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
        }
        print(MARK + json.dumps(result), flush=True)
    return 0


def _start_engine(a: argparse.Namespace, connector: bool, log: Path) -> LineChild:
    """An engine child process (:func:`engine_child`), with or without the connector."""
    flag = "--engine-with" if connector else "--engine-without"
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_noreuse", flag, json.dumps(vars(a))]
    return LineChild(cmd, log, MARK, "an engine", close_timeout_s=120.0)


def main(argv: list[str]) -> int:
    a = _args(argv)
    if missing("vllm", "every vllm_noreuse row", "pip install 'kvtier[vllm]'"):
        return 0
    geo = _geometry(a)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-noreuse-"))
    a.model = str(write_tiny_llama(tmp / "model", geo))
    rng = random.Random(0)
    engines: dict[str, LineChild] = {}
    finished = False
    tput: dict[str, list[float]] = {"with": [], "without": []}
    pairs: list[float] = []
    cpu_pairs: list[float] = []  # CPU seconds per token, without / with
    same = total = 0
    try:
        # One at a time: two engines starting together would only slow each other.
        engines["with"] = _start_engine(a, True, tmp / "with.log")
        engines["without"] = _start_engine(a, False, tmp / "without.log")
        for i in range(a.warmup + a.repeat):
            batch = [
                [rng.randrange(3, geo.vocab) for _ in range(a.tokens)] for _ in range(a.prompts)
            ]
            order = ("with", "without") if i % 2 == 0 else ("without", "with")
            res = {side: engines[side].ask(batch) for side in order}
            if i < a.warmup:
                continue
            rate = {k: (r["tokens_in"] + r["tokens_out"]) / r["s"] for k, r in res.items()}
            for k in rate:
                tput[k].append(rate[k])
            pairs.append(rate["with"] / rate["without"])
            cpu_pairs.append(res["without"]["cpu_s"] / res["with"]["cpu_s"])
            outs = zip(res["with"]["outputs"], res["without"]["outputs"], strict=True)
            same += sum(x == y for x, y in outs)
            total += a.prompts
            print(
                f"batch {i - a.warmup} ({order[0]} first): with {res['with']['s']:.2f}s, "
                f"without {res['without']['s']:.2f}s -> throughput ratio {pairs[-1]:.3f}; "
                f"CPU {res['with']['cpu_s']:.2f}s / {res['without']['cpu_s']:.2f}s -> "
                f"{cpu_pairs[-1]:.3f}"
            )
        totals: dict[str, float] = engines["with"].ask("totals")
        finished = True
    finally:
        for e in engines.values():
            e.close()
        if finished:  # the model; the engines' logs stay when something failed
            shutil.rmtree(tmp, ignore_errors=True)

    full_chunks = (a.warmup + a.repeat) * a.prompts * (a.tokens // a.chunk_tokens)
    med = statistics.median(pairs)
    row: dict[str, Any] = {
        "scenario": "fresh prompts only (nothing reused): throughput with the connector "
        "against the same engine settings without it",
        "prompts_per_batch": a.prompts,
        "prompt_tokens": a.tokens,
        "max_tokens": a.max_tokens,
        "tier": "host",
        "throughput_with_tok_s": statistics.median(tput["with"]),
        "throughput_without_tok_s": statistics.median(tput["without"]),
        "pair_ratio_median": med,
        "pair_ratio_min": min(pairs),
        "pair_ratio_max": max(pairs),
        "pair_ratios": pairs,
        "overhead": 1.0 - med,
        # Engine CPU seconds per batch, without / with (1.0 = the connector costs no CPU).
        "cpu_ratio_median": statistics.median(cpu_pairs),
        "cpu_ratio_min": min(cpu_pairs),
        "cpu_ratio_max": max(cpu_pairs),
        "outputs_identical": f"{same}/{total}",
        "saved_chunks": totals.get("save_chunks", 0),
        "expected_full_chunks": full_chunks,
        "loaded_chunks": totals.get("load_chunks", 0),
        "save_s": totals.get("save_s", 0.0),
        "dtype": a.dtype,
        "chunk_tokens": a.chunk_tokens,
    }
    print(
        f"no reuse, {a.prompts} x {a.tokens}-token prompts, {a.max_tokens} generated: "
        f"throughput with/without the connector {med:.3f} (pairs {min(pairs):.3f}-"
        f"{max(pairs):.3f}, median of {a.repeat}) -> overhead {100 * (1 - med):.1f}% "
        f"(target <= 5%: {'PASS' if med >= 0.95 else 'MISS'}); CPU time ratio "
        f"{row['cpu_ratio_median']:.3f} ({row['cpu_ratio_min']:.3f}-{row['cpu_ratio_max']:.3f}); "
        f"outputs identical "
        f"{same}/{total}; chunks saved {row['saved_chunks']:.0f} of {full_chunks}, "
        f"loaded {row['loaded_chunks']:.0f}"
    )
    write_json(a.json, envelope("vllm_noreuse", [row], geometry=asdict(geo)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("--engine-with", "--engine-without"):
        sys.exit(engine_child(sys.argv[2], sys.argv[1] == "--engine-with"))
    sys.exit(main(sys.argv[1:]))
