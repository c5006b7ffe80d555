"""TTFT of kvtier hits on a real CUDA vLLM engine against recompute and vLLM's own offloading.

    kvtier bench vllm_gpu --json out.json [--lengths 8192,32768,131072] [--repeat 3] ...

Llama-3-8B geometry (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per token) with
``load_format="dummy"``. vLLM's dummy weights are uniform in +-1e-3 and give near-flat
logits, so after loading, every weight is redrawn on the GPU from N(0, 1/fan_in) with a
seed per parameter name (the same in every process): logits are sharp, and a wrong KV
block changes the greedy token and its logprobs.

One run, the same prompts (random token ids, a fresh cache salt per pair) and the same
engine arguments for every row; each source runs in its own engine process, one after
the other, so that GPU and host memory start clean:

* ``kvtier-host``: the kvtier connector, one host tier (pinned shared memory), hits
  read in place (connectors/vllm/inplace.py); ``kvtier-host-staged`` (not run by
  default): the same through the staging copy, ``KVTIER_LOAD_IN_PLACE=0``;
  ``kvtier-host-sync`` (not run by default): with ``async_loads = "off"``, every load
  inside the engine step (on CUDA the default runs them off the step: docs/connector.md);
* ``kvtier-nvme``: the kvtier connector, one nvme tier only (kvikio where installed:
  GDS where the machine allows it, its compat mode otherwise; else the POSIX engine),
  the page cache dropped before each hit where the process may;
* ``native``: vLLM's ``OffloadingConnector`` (CPU offloading), the thing a user would
  pick instead;
* ``lmcache`` (not run by default): vLLM's ``LMCacheConnectorV1`` over LMCache's local
  CPU backend of the same size, 256-token chunks (LMCache 0.5.3 is the last release
  whose CUDA ops are built for torch 2.11, vLLM 0.26's pin; docs/operations.md).

In each engine, per prompt length and repeat: the prompt runs once cold (vLLM computes
the prefill: the recompute TTFT), the saves are waited for (kvtier: the worker's save
counter; native: a fixed pause), then the same prompt runs again and hits. A request has
``max_tokens=1``, so its latency is its TTFT. vLLM's prefix cache is off, so a hit can
only come from the connector. Outputs must agree: the hit's greedy token equals the cold
run's, and top-5 logprobs are compared. Ratios: each hit against the recompute of its own
engine (medians), and kvtier's host hit against the native hit of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, missing, scratch_dir, write_json

SOURCES = ("kvtier-host", "kvtier-nvme", "native")
CHUNK_TOKENS = 256

# Llama-3-8B (Llama 3.1 positions): the geometry of the KV and of the prefill's work.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench vllm_gpu", description=__doc__)
    p.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths (tokens)")
    p.add_argument("--repeat", type=int, default=3, help="pairs per length (each: cold, hit)")
    p.add_argument("--long-repeat", type=int, default=2, help="pairs for lengths >= 65536")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured pairs at the first length")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--host-gib", type=float, default=24.0, help="kvtier host tier / native CPU")
    p.add_argument("--nvme-dir", default="/var/tmp/kvtier-bench-nvme")
    p.add_argument("--nvme-engine", default="auto", help="auto, kvikio or posix")
    p.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    p.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--model-dir", default=None)
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop starting pairs after this many seconds from the start (0: no limit); "
        "each engine gets an equal share of what is left when it starts",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def write_model(folder: Path, max_len: int) -> Path:
    """``config.json`` of Llama-3-8B's geometry (no weights: the engine loads dummy ones)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(LLAMA3_8B, max_position_embeddings=max(131072, max_len))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def sharpen(model: Any) -> int:
    """Redraw every weight from N(0, 1/fan_in), seeded by its name; norms to 1.

    Runs inside the worker (``LLM.apply_model``). Deterministic across processes, so
    engines of one run compute the same KV for the same prompt.
    """
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            if p.dim() == 1:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, float(p.shape[1]) ** -0.5, generator=g)
                if "lm_head" in name:
                    p.mul_(4.0)
            n += 1
    return n


def connector_config(source: str, a: argparse.Namespace) -> dict[str, Any]:
    host_bytes = int(a.host_gib * (1 << 30))
    if source == "native":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes},
        }
    if source == "lmcache":  # its settings are environment variables (child())
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if source.startswith("kvtier-host"):
        tiers: list[dict[str, Any]] = [{"kind": "host", "capacity_bytes": host_bytes}]
    else:
        tiers = [
            {
                "kind": "nvme",
                "capacity_bytes": host_bytes,
                "dir": str(Path(a.nvme_dir) / "tier"),
                "create_dirs": True,
                "engine": a.nvme_engine,
                "recover": False,
            }
        ]
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store.chunk_tokens": CHUNK_TOKENS,
            "tiers": tiers,
            **({"async_loads": "off"} if source == "kvtier-host-sync" else {}),
        },
    }


def prompt_tokens(length: int, i: int) -> list[int]:
    """The ``i``-th prompt of a length: the same in every engine of a run."""
    rng = random.Random(length * 1000 + i)
    return [rng.randrange(1000, 128000) for _ in range(length)]


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def child(spec: dict[str, Any]) -> int:
    """One engine of one source: every length's pairs; results to ``spec['out']``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    a = argparse.Namespace(**spec["args"])
    source: str = spec["source"]
    if source == "kvtier-host-staged":  # the A/B of connectors/vllm/inplace.py
        os.environ["KVTIER_LOAD_IN_PLACE"] = "0"
    if source == "lmcache":
        os.environ.update(
            LMCACHE_LOCAL_CPU="True",
            LMCACHE_MAX_LOCAL_CPU_SIZE=str(a.host_gib),
            LMCACHE_CHUNK_SIZE=str(CHUNK_TOKENS),
        )
    lengths: list[int] = spec["lengths"]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=max(lengths) + 64,
        max_num_batched_tokens=a.batched_tokens,
        max_num_seqs=4,
        enable_prefix_caching=False,
        gpu_memory_utilization=a.gpu_mem,
        enforce_eager=True,
        seed=0,
        dtype="bfloat16",
        kv_transfer_config=connector_config(source, a),
    )
    start_s = time.perf_counter() - t0
    sharpened = llm.apply_model(sharpen)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    worker = None
    if source.startswith("kvtier"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker  # type: ignore[attr-defined]

    def run(tokens: list[int], salt: str) -> dict[str, Any]:
        t = time.perf_counter()
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)], params, use_tqdm=False
        )[0]
        dt = time.perf_counter() - t
        lp = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
        return {
            "s": dt,
            "cached": int(out.num_cached_tokens or 0),
            "token": int(out.outputs[0].token_ids[0]),
            "top5": {int(k): float(v.logprob) for k, v in lp.items()},
        }

    def wait_saved(expected_chunks: int, kv_bytes: int) -> float:
        t = time.perf_counter()
        if worker is None:  # native: its stores finish asynchronously, no public counter
            time.sleep(2.0 + 0.25 * kv_bytes / (1 << 30))
            return time.perf_counter() - t
        deadline = t + 60
        while sum(worker.totals().get(k, 0) for k in ("save_chunks", "save_failed_chunks")) < (
            expected_chunks
        ):
            if time.perf_counter() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        return time.perf_counter() - t

    results: list[dict[str, Any]] = []
    saved_chunks = 0
    first = True
    for length in lengths:
        n = a.repeat if length < 65536 else a.long_repeat
        warm = a.warmup if first else 0
        first = False
        for i in range(warm + n):
            if spec["deadline"] and time.time() > spec["deadline"]:
                print(f"[{source}] out of time: {length} #{i} and later not run", flush=True)
                break
            tokens = prompt_tokens(length, i)
            salt = f"{source}-{length}-{i}-{time.time_ns()}"
            cold = run(tokens, salt)
            saved_chunks += length // CHUNK_TOKENS
            waited = wait_saved(saved_chunks, length * KV_BYTES_PER_TOKEN)
            dropped = _drop_page_cache() if source == "kvtier-nvme" else None
            hit = run(tokens, salt)
            rec = {
                "length": length,
                "i": i,
                "warmup": i < warm,
                "cold": cold,
                "hit": hit,
                "save_wait_s": waited,
                "page_cache_dropped": dropped,
            }
            results.append(rec)
            Path(spec["out"]).write_text(json.dumps({"source": source, "runs": results}))
            print(
                f"[{source}] {length} #{i}{' (warmup)' if i < warm else ''}: cold {cold['s']:.3f}s "
                f"hit {hit['s']:.3f}s cached {hit['cached']} token {cold['token']}/{hit['token']}",
                flush=True,
            )
    extra: dict[str, Any] = {"engine_start_s": start_s, "sharpened_params": sharpened}
    if worker is not None:
        extra["connector_totals"] = worker.totals()
        store = worker.store
        extra["tiers"] = [
            {"name": t.name, "kind": type(t).__name__, **_tier_info(t)} for t in store.tiers
        ]
    Path(spec["out"]).write_text(json.dumps({"source": source, "runs": results, **extra}))
    return 0


def _tier_info(t: Any) -> dict[str, Any]:
    info: dict[str, Any] = {}
    stats = getattr(t, "nvme_stats", None)
    if stats is not None:
        st = stats()
        info["nvme_stats"] = (
            dataclasses.asdict(st)
            if dataclasses.is_dataclass(st) and not isinstance(st, type)
            else str(st)
        )
        eng = getattr(t, "engine", None)
        info["engine"] = getattr(eng, "name", str(eng))
    return info


def _dlogprob(a: dict[str, float], b: dict[str, float]) -> float:
    common = a.keys() & b.keys()
    return max((abs(a[k] - b[k]) for k in common), default=float("inf"))


def summarize(source: str, runs: list[dict[str, Any]], length: int) -> dict[str, Any]:
    rs = [r for r in runs if r["length"] == length and not r["warmup"]]
    hit = [r["hit"]["s"] for r in rs]
    cold = [r["cold"]["s"] for r in rs]
    same = sum(r["hit"]["token"] == r["cold"]["token"] for r in rs)
    return {
        "source": source,
        "prompt_tokens": length,
        "kv_gib": length * KV_BYTES_PER_TOKEN / (1 << 30),
        "hit_ttft_s": statistics.median(hit),
        "hit_min_s": min(hit),
        "hit_max_s": max(hit),
        "recompute_ttft_s": statistics.median(cold),
        "recompute_min_s": min(cold),
        "recompute_max_s": max(cold),
        "hit_over_recompute": statistics.median(hit) / statistics.median(cold),
        "hit_cached_tokens": statistics.median(r["hit"]["cached"] for r in rs),
        "identical_first_tokens": f"{same}/{len(rs)}",
        "outputs_identical": same == len(rs) and all(r["cold"]["cached"] == 0 for r in rs),
        "max_abs_dlogprob_top5": max(
            (_dlogprob(r["cold"]["top5"], r["hit"]["top5"]) for r in rs), default=0.0
        ),
        "cold_tokens": [r["cold"]["token"] for r in rs],
        "repeats": len(rs),
    }


def main(argv: list[str]) -> int:
    a = _args(argv)
    if a.child:
        return child(json.loads(a.child))
    if missing("vllm", "every vllm_gpu row", "scripts/wheelhouse.sh (docs/operations.md)"):
        return 0
    import torch

    if not torch.cuda.is_available():
        print("vllm_gpu: skipped, no CUDA device (this benchmark needs a CUDA build of vLLM)")
        return 0
    lengths = [int(x) for x in a.lengths.split(",")]
    tmp = scratch_dir("kvtier-bench-gpu-")
    model = write_model(Path(a.model_dir) if a.model_dir else tmp / "llama3-8b", max(lengths) + 64)
    per_source: dict[str, dict[str, Any]] = {}
    sources = a.sources.split(",")
    t_start = time.time()
    for k, source in enumerate(sources):
        out = tmp / f"{source}.json"
        deadline = 0.0
        if a.budget_s > 0:
            left = a.budget_s - (time.time() - t_start)
            deadline = time.time() + left / (len(sources) - k)
        spec = {
            "source": source,
            "lengths": lengths,
            "model": str(model),
            "out": str(out),
            "deadline": deadline,
            "args": {k: v for k, v in vars(a).items() if k not in ("child",)},
        }
        cmd = [sys.executable, "-m", "kvtier.bench.vllm_gpu", "--child", json.dumps(spec)]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        print(f"[{source}] engine process exited {rc} after {time.perf_counter() - t0:.0f}s")
        if out.exists():  # what it finished, also when it failed later
            per_source[source] = json.loads(out.read_text())
        else:
            per_source[source] = {"source": source}
        if rc != 0:
            per_source[source]["error"] = f"engine process exited {rc}"
    rows: list[dict[str, Any]] = []
    for source, res in per_source.items():
        if "runs" not in res:
            continue
        for length in lengths:
            if any(r["length"] == length and not r["warmup"] for r in res["runs"]):
                rows.append(summarize(source, res["runs"], length))
    native = {r["prompt_tokens"]: r for r in rows if r["source"] == "native"}
    host = {r["prompt_tokens"]: r for r in rows if r["source"] == "kvtier-host"}
    print(
        f"\n{'source':12} {'tokens':>7} {'hit s':>8} {'recomp s':>9} {'hit/rec':>8} "
        f"{'vs native':>9} {'identical':>9}"
    )
    for r in rows:
        nat = native.get(r["prompt_tokens"])
        if nat is not None and r["source"] != "native":
            r["hit_over_native_hit"] = r["hit_ttft_s"] / nat["hit_ttft_s"]
        if r["source"] != "kvtier-host" and r["prompt_tokens"] in host:
            r["recompute_over_kvtier_host_engine"] = (
                r["recompute_ttft_s"] / host[r["prompt_tokens"]]["recompute_ttft_s"]
            )
        vs = r.get("hit_over_native_hit")
        print(
            f"{r['source']:12} {r['prompt_tokens']:>7} {r['hit_ttft_s']:>8.3f} "
            f"{r['recompute_ttft_s']:>9.3f} {r['hit_over_recompute']:>8.3f} "
            f"{(f'{vs:.3f}' if vs is not None else '-'):>9} {r['identical_first_tokens']:>9}"
        )
    props = torch.cuda.get_device_properties(0)
    write_json(
        a.json,
        envelope(
            "vllm_gpu",
            rows,
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            geometry=LLAMA3_8B,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            chunk_tokens=CHUNK_TOKENS,
            engines={s: {k: v for k, v in r.items() if k != "runs"} for s, r in per_source.items()},
            raw={s: r.get("runs") for s, r in per_source.items()},
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
