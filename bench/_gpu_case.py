"""The pieces the GPU transfer benchmark shares: geometry, timing, a paged cache case.

Part of ``kvtier bench gpu_transfer`` (:mod:`kvtier.bench.gpu_transfer`), not a
benchmark itself.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.enums import Switch
from kvtier.tiers.memory import SharedArena
from kvtier.transfer import Layout, PagedKV, make_paged_cache

BLOCK_SIZE = 16
# Where host bytes live: the host tier's shm arena, torch pinned memory, or auto (the
# arena when /dev/shm has room, else pinned memory).
HOST_MODE = "auto"
POISON = -0x5A5A5A5A5A5A5A5B  # 0xA5A5... as int64


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head: int

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head * 2  # K and V, bf16


LLAMA8B = Geometry("llama-3-8b", 32, 8, 128)
LLAMA70B = Geometry("llama-3-70b", 80, 8, 128)
LLAMA70B_TP8 = Geometry("llama-3-70b-tp8", 80, 1, 128)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Callable[[], object]) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "runs": len(times),
        "GBps": nbytes / med / 1e9,
        "GBps_min": nbytes / max(times) / 1e9,
        "GBps_max": nbytes / min(times) / 1e9,
    }


def interleave(
    dev: torch.device, fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    for _ in range(warmup):
        for fn in fns.values():
            timed(dev, fn)
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            out[k].append(timed(dev, fn))
    return out


def raw_words(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every distinct storage under the layers, as int64 words."""
    seen: dict[int, torch.Tensor] = {}
    for t in layers:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            seen[st.data_ptr()] = raw.view(torch.int64)
    return list(seen.values())


def fill_random(words: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=words[0].device).manual_seed(seed)
    for w in words:
        w.view(torch.uint8).random_(0, 256, generator=g)  # every byte random, never zeros


class Case:
    """One paged cache, its random ids and a pinned host buffer from the arena."""

    def __init__(
        self, dev: torch.device, geo: Geometry, tokens: int, layout: Layout, seed: int
    ) -> None:
        self.dev, self.geo, self.tokens, self.layout = dev, geo, tokens, layout
        self.n = tokens // BLOCK_SIZE
        num_blocks = self.n + self.n // 4 + 16
        self.layers = make_paged_cache(
            layout,
            num_layers=geo.layers,
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            num_kv_heads=geo.kv_heads,
            head_size=geo.head,
            dtype=torch.bfloat16,
            device=dev,
        )
        self.raw = raw_words(self.layers)
        fill_random(self.raw, seed)
        self.kv = PagedKV(self.layers)
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randperm(num_blocks, generator=g)[: self.n]
        self.ids_list = self.ids.tolist()
        self.ids_dev = self.ids.to(dev)
        self.nbytes = self.kv.nbytes(self.n)
        self.arena: SharedArena | None = None
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        if HOST_MODE == "arena" or (HOST_MODE == "auto" and shm_free > self.nbytes * 1.2):
            self.arena = SharedArena(self.nbytes, "gpu-bench", pin=Switch.AUTO)
            self.host = torch.from_numpy(self.arena.array)
            self.host_kind = "shm-arena-registered" if self.arena.pinned else "shm-arena-pageable"
        else:
            # /dev/shm too small for this size: page-locked memory from torch instead.
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
            self.host_kind = "torch-pinned" if dev.type == "cuda" else "torch-pageable"
        g2 = self.kv.geometry
        self.host_w = self.host.view(torch.int64).view(geo.layers, g2.runs, self.n, -1)

    def perblock_store(self) -> None:
        for layer, w in enumerate(self.kv.layers):
            dst = self.host_w[layer]
            for r in range(w.shape[0]):
                for j, b in enumerate(self.ids_list):
                    dst[r, j].copy_(w[r, b], non_blocking=True)

    def perblock_load(self) -> None:
        for layer, w in enumerate(self.kv.layers):
            src = self.host_w[layer]
            for r in range(w.shape[0]):
                for j, b in enumerate(self.ids_list):
                    w[r, b].copy_(src[r, j], non_blocking=True)

    def verify_host(self) -> bool:
        """Host bytes equal an on-device gather of the ids, layer by layer."""
        ok = True
        for layer, w in enumerate(self.kv.layers):
            ref = w.index_select(1, self.ids_dev)
            ok &= bool(torch.equal(self.host_w[layer].to(self.dev), ref))
        return ok

    def poison_targets(self) -> None:
        for w in self.kv.layers:
            w.index_fill_(1, self.ids_dev, POISON)

    def close(self) -> None:
        del self.host, self.host_w
        if self.arena is not None:
            self.arena.close()
