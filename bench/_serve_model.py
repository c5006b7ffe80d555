"""The model, the engine's defaults and the weights of ``kvtier bench serve``, per device.

On a CPU the benchmark serves a small Llama with random weights written to safetensors;
on a CUDA GPU it serves Llama-3-8B's geometry with vLLM's dummy weights (sixteen
gigabytes that need not be written), redrawn inside the server so that greedy outputs
can tell right KV from wrong KV. :class:`DeviceDefaults` holds what else follows from
the device: how long the prompts are, how large vLLM's KV pool and the tiers below it
are, and how fast the trace is replayed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "cuda")
MODELS = ("tiny", "llama3-8b")
WEIGHTS = ("random", "dummy")

# The collective_rpc method of the worker extension below: a name no vLLM worker has.
SHARPEN_METHOD = "kvtier_sharpen"


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    """Option defaults of one device; an option given on the command line wins."""

    # Whole multi-turn conversations of the trace replayed.
    conversations: int
    # The trace's arrivals are compressed into this many seconds.
    duration_s: float
    # Tokens per trace hash_id (the trace's own is 512): the prompts' length scale.
    block_tokens: int
    max_prompt_tokens: int
    # vLLM's own KV pool (--num-gpu-blocks-override), below the slice's working set.
    vllm_kv_tokens: int
    # vLLM's KV block (its --block-size): 32 on the CPU build, vLLM's default on CUDA.
    vllm_block: int
    max_batched_tokens: int
    # kvtier's host tier and vLLM's CPU offloading, each above the working set's KV.
    host_bytes: str
    native_gib: float
    start_timeout_s: float
    model: str


# The CPU defaults are what the benchmark has always run: a 2-core VM drains ~400
# prompt tokens/s of the tiny model, so a slice of 40 conversations over two minutes.
CPU = DeviceDefaults(
    conversations=40, duration_s=120.0, block_tokens=32, max_prompt_tokens=4096,
    vllm_kv_tokens=16384, vllm_block=32, max_batched_tokens=4096, host_bytes="2GiB",
    native_gib=2.0, start_timeout_s=300.0, model="tiny",
)  # fmt: skip

# One H100 prefills Llama-3-8B at ~35K tokens/s (bench vllm_gpu), so 20 conversations
# at half the trace's lengths (470K prompt tokens, mean 6.6K) over 30 s keep it below
# half busy without hits, and a row (server start, replay, stop) fits in ~90 s. Their
# working set (~196K tokens, 24 GiB of KV) is six times vLLM's pool of 32K tokens, and
# prompts of thousands of tokens cost ~5x more to recompute than to load from the host.
CUDA = DeviceDefaults(
    conversations=20, duration_s=30.0, block_tokens=256, max_prompt_tokens=16384,
    vllm_kv_tokens=32768, vllm_block=16, max_batched_tokens=8192, host_bytes="24GiB",
    native_gib=24.0, start_timeout_s=240.0, model="llama3-8b",
)  # fmt: skip

DEFAULTS = {"cpu": CPU, "cuda": CUDA}


def detect_device() -> str:
    """``cuda`` where torch sees a CUDA device, else ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_defaults(a: argparse.Namespace) -> None:
    """Fill every option left at None from the defaults of ``a.device``."""
    d = DEFAULTS[a.device]
    for name, value in asdict(d).items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    if a.weights is None:
        a.weights = "random" if a.model == "tiny" else "dummy"


@dataclass(frozen=True, slots=True)
class ServeModel:
    """The model folder the servers load, and what the benchmark needs to know of it."""

    path: Path
    vocab: int  # prompts draw their token ids below this
    kv_bytes_per_token: int
    load_format: str  # vLLM's --load-format
    sharpen: bool  # redraw the weights in each server (dummy weights are near-flat)
    geometry: dict[str, Any]


def write_model(a: argparse.Namespace, folder: Path) -> ServeModel:
    """Write the model ``a`` asks for into ``folder``.

    ``tiny`` is the vLLM benchmarks' small Llama (``--layers``, ``--kv-heads``), with its
    random weights in safetensors, or with vLLM's dummy ones (``--weights dummy``, to try
    the GPU's path on a CPU). ``llama3-8b`` is only its ``config.json``: dummy weights.
    """
    if a.model == "tiny":
        from kvtier.bench.tiny_llama import BENCH_GEOMETRY, write_tiny_llama

        geo = replace(
            BENCH_GEOMETRY, layers=a.layers, kv_heads=a.kv_heads,
            max_positions=max(8192, a.max_prompt_tokens + 128),
        )  # fmt: skip
        path = write_tiny_llama(folder, geo)
        return ServeModel(
            path=path,
            vocab=geo.vocab,
            kv_bytes_per_token=geo.kv_bytes_per_token(a.dtype),
            load_format="safetensors" if a.weights == "random" else "dummy",
            sharpen=a.weights == "dummy",
            geometry=asdict(geo),
        )
    if a.weights != "dummy":
        raise SystemExit("--model llama3-8b runs with --weights dummy only (16 GB to write)")
    from kvtier.bench.vllm_gpu import KV_BYTES_PER_TOKEN
    from kvtier.bench.vllm_gpu import write_model as write_config

    path = write_config(folder, a.max_prompt_tokens + 128)
    elem = 4 if "32" in a.dtype else 2
    return ServeModel(
        path=path,
        vocab=128000,  # below Llama 3's special tokens
        kv_bytes_per_token=KV_BYTES_PER_TOKEN * elem // 2,
        load_format="dummy",
        sharpen=True,
        geometry=json.loads((path / "config.json").read_text()),
    )


class SharpenExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``): redraws the weights.

    Called through the server's ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) once it
    is up, before any request; runs in the worker process, on its device.
    """

    def kvtier_sharpen(self) -> int:
        """Redraw every weight (:func:`kvtier.bench.vllm_gpu.sharpen`); how many."""
        from kvtier.bench.vllm_gpu import sharpen

        n: int = sharpen(self.get_model())  # type: ignore[attr-defined]
        return n


def sharpen_server(url: str, timeout_s: float = 120.0) -> int:
    """Have the server at ``url`` redraw its weights; how many tensors it redrew.

    Raises:
        RuntimeError: the server has no ``/collective_rpc`` or the call failed.
    """
    import httpx

    resp = httpx.post(url + "/collective_rpc", json={"method": SHARPEN_METHOD}, timeout=timeout_s)
    if resp.status_code != 200:
        raise RuntimeError(f"redrawing the weights failed: {resp.status_code} {resp.text[:300]}")
    return sum(int(r) for r in resp.json()["results"])
