"""TTFT of a kvtier hit against recompute, on one real vLLM CPU engine, same prompts.

    kvtier bench vllm_e2e --json out.json [--tokens 4096] [--repeat 5] [--layers 4] ...
    kvtier bench vllm_e2e --restart ...   (TTFT in a new engine process: vllm_restart.py)

One engine with the kvtier connector (host tier). For each repeat, a fresh random
prompt is sent twice with a fresh cache salt: the first run misses (vLLM computes the
prefill, kvtier saves it in the background), the second hits (kvtier loads every full
chunk; vLLM computes only the tail). With ``max_tokens=1`` a request's latency is its
time to first token. The two runs of a repeat are back to back, so machine drift hits
both alike. Outputs must be identical: the first token and its top-5 logprobs, exactly.

vLLM's own prefix cache is off, so the hit can only come from kvtier. The engine runs
in-process and eager (fast start); the data path is the same as in the multi-process
engine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Any

from kvtier.bench.common import envelope, write_json
from kvtier.bench.tiny_llama import TinyLlama, write_tiny_llama


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench vllm_e2e", description=__doc__)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bfloat16, float32)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--host-bytes", default="1GiB")
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
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    if "--restart" in argv:  # two engine processes: see kvtier.bench.vllm_restart
        from kvtier.bench.vllm_restart import main as restart_main

        rc: int = restart_main(argv)
        return rc
    a = _args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    geo = TinyLlama(
        layers=a.layers,
        hidden=a.hidden,
        intermediate=a.intermediate,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_positions=max(8192, a.tokens + 64),
    )
    model = write_tiny_llama(a.model_dir or tempfile.mkdtemp(prefix="kvtier-bench-llama-"), geo)

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    kvtier = a.source == "kvtier"
    connector_cfg: dict[str, Any] = {
        "kv_transfer_config": {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "store.chunk_tokens": a.chunk_tokens,
                "tiers": [{"kind": "host", "capacity_bytes": a.host_bytes}],
            },
        }
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
                    "shared_storage_path": tempfile.mkdtemp(prefix="kvtier-bench-example-")
                },
            }
        }
    llm = LLM(
        model=str(model),
        load_format="safetensors",
        skip_tokenizer_init=True,
        block_size=32,
        max_model_len=a.tokens + 64,
        max_num_batched_tokens=a.tokens + 64,
        max_num_seqs=2,
        enable_prefix_caching=a.source == "prefix-cache",
        seed=0,
        enforce_eager=True,
        dtype=a.dtype,
        **(connector_cfg if a.source != "prefix-cache" else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    rng = random.Random(0)

    def run(tokens: list[int], salt: str) -> tuple[float, int, int, dict[int, float]]:
        p = TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)
        t0 = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        lp = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
        top = {int(tid): float(v.logprob) for tid, v in lp.items()}
        return dt, int(out.num_cached_tokens or 0), int(out.outputs[0].token_ids[0]), top

    miss_s: list[float] = []
    hit_s: list[float] = []
    same_tokens = 0
    max_dlogprob = 0.0
    misses_clean = True
    cached: list[int] = []
    for i in range(a.warmup + a.repeat):
        tokens = [rng.randrange(3, geo.vocab) for _ in range(a.tokens)]
        salt = f"bench-{i}-{rng.random()}"
        t_miss, c_miss, tok_miss, lp_miss = run(tokens, salt)
        if a.gap_s > 0:
            time.sleep(a.gap_s)
        t_hit, c_hit, tok_hit, lp_hit = run(tokens, salt)
        if i < a.warmup:
            continue
        miss_s.append(t_miss)
        hit_s.append(t_hit)
        cached.append(c_hit)
        misses_clean &= c_miss == 0
        same_tokens += tok_miss == tok_hit
        common = lp_miss.keys() & lp_hit.keys()
        dlp = max((abs(lp_miss[k] - lp_hit[k]) for k in common), default=float("inf"))
        max_dlogprob = max(max_dlogprob, dlp)
        print(
            f"repeat {i - a.warmup}: recompute {t_miss:.3f}s  hit {t_hit:.3f}s  cached {c_hit}  "
            f"token {tok_miss}/{tok_hit}  max|dlogprob| {dlp:.4f}"
        )

    totals: dict[str, float] = {}
    if kvtier:
        connector: Any = get_kv_transfer_group()
        totals = connector.worker.totals()
    elem = 4 if "32" in a.dtype else 2
    kv_bytes_per_token = 2 * geo.layers * geo.kv_heads * geo.head_dim * elem
    identical = same_tokens == a.repeat and misses_clean
    med_hit, med_miss = statistics.median(hit_s), statistics.median(miss_s)
    pairs = [h / m for h, m in zip(hit_s, miss_s, strict=True)]
    row: dict[str, Any] = {
        "scenario": f"same prompt twice, fresh salt per repeat; hit from {a.source}",
        "prompt_tokens": a.tokens,
        "tier": "daemon"
        if kvtier and a.daemon
        else {"kvtier": "host", "prefix-cache": "vllm-prefix-cache"}.get(a.source, "disk"),
        "ttft_s": med_hit,
        "ttft_min_s": min(hit_s),
        "ttft_max_s": max(hit_s),
        "recompute_ttft_s": med_miss,
        "recompute_min_s": min(miss_s),
        "recompute_max_s": max(miss_s),
        "ratio": med_hit / med_miss,
        # Per repeat (the two runs of a pair are back to back): robust to machine drift.
        "pair_ratio_median": statistics.median(pairs),
        "pair_ratio_min": min(pairs),
        "pair_ratio_max": max(pairs),
        "hit_cached_tokens": statistics.median(cached),
        "outputs_identical": identical,
        "identical_first_tokens": f"{same_tokens}/{a.repeat}",
        "max_abs_dlogprob_top5": max_dlogprob,
        "dtype": a.dtype,
        "chunk_tokens": a.chunk_tokens if a.source == "kvtier" else None,
        "gap_s": a.gap_s,
    }
    print(
        f"{a.tokens}-token prompt: hit {med_hit:.3f}s vs recompute {med_miss:.3f}s -> "
        f"ratio {row['ratio']:.3f} (median of {a.repeat}); first tokens identical "
        f"{same_tokens}/{a.repeat}, max |dlogprob| {max_dlogprob:.4f}"
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
