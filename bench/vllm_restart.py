"""TTFT after an engine restart: a new vLLM process hits what the last one stored.

    kvtier bench vllm_e2e --restart --json out.json [--tokens 4096] [--repeat 5] ...
    (also: kvtier bench vllm_restart ...)

Two engine processes, one after the other, on the same kvtier configuration (a host tier
and an nvme tier under a temporary directory):

1. ``store``: serves ``warmup + repeat`` fresh random prompts and exits cleanly (the
   connector's store moves what its host tier holds into the nvme tier at shutdown).
2. ``hit``: a new process. For each prompt, back to back: the same tokens under a fresh
   cache salt (a miss: vLLM computes the prefill; the cold baseline, same process, same
   moment) and the stored prompt itself (a hit: the scheduler side learned at start which
   keys the nvme tier recovered; the worker loads them from nvme). ``max_tokens=1``: a
   request's latency is its time to first token. Outputs must match: the first token and
   its top-5 logprobs.

vLLM's own prefix cache is off, so a hit can only come from kvtier. Engines run
in-process and eager (fast start); the data path is the one of the multi-process engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, missing, scratch_dir, write_json
from kvtier.bench.tiny_llama import (
    add_engine_options,
    bench_geometry,
    engine_args,
    kvtier_transfer,
    write_tiny_llama,
)


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of the restart mode (shared with ``vllm_e2e --restart``)."""
    p.add_argument("--nvme-bytes", default="2GiB", help="capacity of the nvme tier")
    p.add_argument("--workdir", default=None, help="model and nvme folder (default: tmp)")
    p.add_argument("--phase", choices=("store", "hit"), default=None, help=argparse.SUPPRESS)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench vllm_restart", description=__doc__)
    add_engine_options(p)
    p.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    add_args(p)
    return p.parse_args(argv)


def _prompts(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(a.tokens)] for _ in range(a.warmup + a.repeat)]


def _phase(a: argparse.Namespace) -> dict[str, Any]:
    """One engine process: ``store`` or ``hit`` (see the module docstring)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    work = Path(a.workdir)
    geo = bench_geometry(a)
    model = write_tiny_llama(work / "model", geo)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    tiers: list[dict[str, Any]] = [
        {"kind": "host", "capacity_bytes": a.host_bytes},
        {
            "kind": "nvme",
            "capacity_bytes": a.nvme_bytes,
            "dir": str(work / "nvme"),
            "create_dirs": True,
        },
    ]
    llm = LLM(
        **engine_args(model, a.tokens, a.dtype),
        kv_transfer_config=kvtier_transfer("kv_both", a.chunk_tokens, tiers),
    )
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def run(tokens: list[int], salt: str | None) -> dict[str, Any]:
        p = TokensPrompt(prompt_token_ids=tokens)
        if salt is not None:
            p["cache_salt"] = salt
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        lp = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
        return {
            "ttft_s": dt,
            "cached": int(out.num_cached_tokens or 0),
            "token": int(out.outputs[0].token_ids[0]),
            "top5": {str(tid): float(v.logprob) for tid, v in lp.items()},
        }

    res: dict[str, Any] = {"phase": a.phase, "engine_start_s": start_s}
    prompts = _prompts(a, geo.vocab)
    if a.phase == "store":
        res["runs"] = [run(p, None) for p in prompts]
    else:
        res["pairs"] = [
            {"cold": run(p, f"cold-{i}-{random.random()}"), "hit": run(p, None)}
            for i, p in enumerate(prompts)
        ]
        connector: Any = get_kv_transfer_group()
        res["connector_totals"] = connector.worker.totals()
        stats = connector.worker.store.stats()
        res["tiers_used_bytes"] = {t.name: t.used_bytes for t in stats.tiers}
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # closes the connector: the store persists
    res["shutdown_s"] = time.perf_counter() - t
    return res


def _child(argv: list[str], phase: str, workdir: str, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_restart", *argv]
    cmd += ["--phase", phase, "--workdir", workdir, "--json", str(out)]
    subprocess.run(cmd, check=True)
    return dict(json.loads(out.read_text()))


def main(argv: list[str]) -> int:
    a = _args(argv)
    if missing("vllm", "every vllm_restart row", "pip install 'kvtier[vllm]'"):
        return 0
    if a.phase is not None:
        write_json(a.json, _phase(a))
        return 0
    own = [x for x in argv if x != "--restart"]
    own = [x for i, x in enumerate(own) if x != "--json" and (i == 0 or own[i - 1] != "--json")]
    workdir = a.workdir or str(scratch_dir("kvtier-bench-restart-"))
    store = _child(own, "store", workdir, Path(workdir) / "store.json")
    hit = _child(own, "hit", workdir, Path(workdir) / "hit.json")
    pairs = hit["pairs"][a.warmup :]
    cold_s = [p["cold"]["ttft_s"] for p in pairs]
    hit_s = [p["hit"]["ttft_s"] for p in pairs]
    first_s = [r["ttft_s"] for r in store["runs"][a.warmup :]]
    same = sum(p["cold"]["token"] == p["hit"]["token"] for p in pairs)
    dlp = 0.0
    for p in pairs:
        common = p["cold"]["top5"].keys() & p["hit"]["top5"].keys()
        diffs = (abs(p["cold"]["top5"][k] - p["hit"]["top5"][k]) for k in common)
        dlp = max(dlp, max(diffs, default=float("inf")))
    ratios = [h / c for h, c in zip(hit_s, cold_s, strict=True)]
    row: dict[str, Any] = {
        "scenario": "engine restart: a new process serves the prompts the last one stored",
        "prompt_tokens": a.tokens,
        "tier": "nvme (recovered after restart)",
        "ttft_s": statistics.median(hit_s),
        "ttft_min_s": min(hit_s),
        "ttft_max_s": max(hit_s),
        "recompute_ttft_s": statistics.median(cold_s),
        "recompute_min_s": min(cold_s),
        "recompute_max_s": max(cold_s),
        "ratio": statistics.median(hit_s) / statistics.median(cold_s),
        "pair_ratio_median": statistics.median(ratios),
        "pair_ratio_min": min(ratios),
        "pair_ratio_max": max(ratios),
        "first_engine_cold_ttft_s": statistics.median(first_s),
        "hit_cached_tokens": statistics.median(p["hit"]["cached"] for p in pairs),
        "cold_cached_tokens": max(p["cold"]["cached"] for p in pairs),
        "identical_first_tokens": f"{same}/{len(pairs)}",
        "outputs_identical": same == len(pairs),
        "max_abs_dlogprob_top5": dlp,
        "engine_start_s": {"store": store["engine_start_s"], "hit": hit["engine_start_s"]},
        "store_shutdown_s": store["shutdown_s"],
        "dtype": a.dtype,
        "chunk_tokens": a.chunk_tokens,
    }
    print(
        f"{a.tokens}-token prompt after a restart: hit {row['ttft_s']:.3f}s vs recompute "
        f"{row['recompute_ttft_s']:.3f}s -> ratio {row['ratio']:.3f} (median of {len(pairs)}); "
        f"first tokens identical {same}/{len(pairs)}, max |dlogprob| {dlp:.4f}; engine start "
        f"{store['engine_start_s']:.1f}s then {hit['engine_start_s']:.1f}s (recovery included)"
    )
    write_json(
        a.json,
        envelope(
            "vllm_e2e --restart",
            [row],
            connector_totals=hit["connector_totals"],
            tiers_used_bytes=hit["tiers_used_bytes"],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
