"""A real LMCache engine on CPU for the kvtier plug-point tests and the benchmark.

Everything is LMCache's own (``LMCacheEngineBuilder``, its storage manager, local CPU
backend, remote backend and plug-in loading) except the copy between the "GPU" and
LMCache's memory objects: LMCache's ``MockGPUConnector`` (``EngineType.MOCK``) does
no copy at all, so :class:`CopyConnector` (a subclass) copies token rows between a
CPU byte tensor standing for the paged KV and the memory objects. That is what lets a
test check that the bytes that come back equal the bytes that went in.

Run as ``python -m tests.connectors.lmcache_engine store URL SEED N_TOKENS`` to store
one prompt through the remote plug-in from a separate process (the restart test).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

from tests.service.conftest import Daemon, free_port, kvtier_cmd, wait_ready

CHUNK = 16
LAYERS, HEADS, HEAD_SIZE = 2, 2, 8
DTYPE = torch.float16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * 2  # K and V, fp16
MODEL = "kvtier-test-model"
# LMCache's default chunk hash ("builtin") seeds vLLM's NONE_HASH with random bytes per
# process; sha256_cbor with one PYTHONHASHSEED in every process gives the same keys
# after a restart (docs/lmcache.md).
STABLE = {"pre_caching_hash_algorithm": "sha256_cbor"}
HASH_SEED = "0"

_ids = itertools.count()


class CopyConnector(MockGPUConnector):  # type: ignore[misc]
    """LMCache's mock GPU connector, plus the copy: ``kv`` in, ``out`` back."""

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        src: torch.Tensor = kw["kv"]
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            n = (e - s) * TOKEN_BYTES
            obj.byte_array.cast("B")[:n] = src[s * TOKEN_BYTES : e * TOKEN_BYTES].numpy().data

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        out: torch.Tensor = kw["out"]
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            n = (e - s) * TOKEN_BYTES
            view = out[s * TOKEN_BYTES : e * TOKEN_BYTES].numpy()
            view[:] = memoryview(obj.byte_array).cast("B")[:n]


@dataclass
class Engine:
    """One LMCache engine and what the tests do with it."""

    engine: LMCacheEngine
    instance: str

    def store(self, tokens: list[int], kv: torch.Tensor, **kw: Any) -> None:
        self.engine.store(tokens, kv=kv, **kw)

    def retrieve(self, tokens: list[int], **kw: Any) -> tuple[int, torch.Tensor]:
        out = torch.zeros(len(tokens) * TOKEN_BYTES, dtype=torch.uint8)
        mask = self.engine.retrieve(tokens, out=out, **kw)
        return int(mask.sum()), out

    def lookup(self, tokens: list[int], backend: str | None = None, **kw: Any) -> int:
        search = [backend] if backend else None
        return int(self.engine.lookup(tokens, search_range=search, **kw))

    def drop_local(self, tokens: list[int] | None = None, timeout_s: float = 20.0) -> None:
        """Drop LMCache's local CPU copies, so hits must come from the backend below.

        LMCache skips objects still referenced (a store to a backend in flight holds
        them): with ``tokens``, clear again until none of their chunks is left locally.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.engine.clear(locations=["LocalCPUBackend"])
            if tokens is None or self.lookup(tokens, "LocalCPUBackend") == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError("LMCache kept its local CPU copies")
            time.sleep(0.05)

    def wait_stored(
        self, tokens: list[int], backend: str, timeout_s: float = 60.0, **kw: Any
    ) -> int:
        """Wait until ``backend`` holds every full chunk of ``tokens`` (stores are async).

        ``kw`` as for :meth:`lookup`: a salted store must be waited for with its salt (the
        unsalted chunks are other keys, and may be there already).
        """
        want = len(tokens) // CHUNK * CHUNK
        deadline = time.monotonic() + timeout_s
        while True:
            n = self.lookup(tokens, backend, **kw)
            if n >= want or time.monotonic() > deadline:
                return n
            time.sleep(0.05)

    def backends(self) -> list[str]:
        assert self.engine.storage_manager is not None
        return list(self.engine.storage_manager.storage_backends)

    def backend(self, name: str) -> Any:
        """The storage backend ``name`` itself (the kvtier plug-in object)."""
        assert self.engine.storage_manager is not None
        return self.engine.storage_manager.storage_backends[name]

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.instance)


def make_engine(config: dict[str, Any], *, model: str = MODEL, worker_id: int = 0) -> Engine:
    """A started LMCache engine with ``config`` over a small fp16 geometry."""
    os.environ["PYTHONHASHSEED"] = HASH_SEED  # vLLM's NONE_HASH derives from it
    cfg = LMCacheEngineConfig.from_dict(
        {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.05, **STABLE, **config}
    )
    meta = LMCacheMetadata(
        model_name=model,
        world_size=2 if worker_id else 1,
        local_world_size=1,
        worker_id=worker_id,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
    )
    instance = f"kvtier-test-{os.getpid()}-{next(_ids)}"
    conn = CopyConnector(kv_shape=meta.kv_shape)
    engine = LMCacheEngineBuilder.get_or_create(
        instance, cfg, meta, conn, lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    return Engine(engine, instance)


@contextmanager
def engine(config: dict[str, Any], **kw: Any) -> Iterator[Engine]:
    e = make_engine(config, **kw)
    try:
        yield e
    finally:
        e.close()


def prompt(seed: int, n_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Token ids and random KV bytes of one prompt (the same for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (n_tokens,), generator=g).tolist()
    kv = torch.randint(0, 256, (n_tokens * TOKEN_BYTES,), dtype=torch.uint8, generator=g)
    return tokens, kv


def remote_config(url: str, token: str | None = None) -> dict[str, Any]:
    """The LMCache config block of docs/lmcache.md for the remote plug-in."""
    extra = {
        "remote_storage_plugin.kvtier.module_path": "kvtier.connectors.lmcache",
        "remote_storage_plugin.kvtier.class_name": "KVTierRemoteConnector",
        "remote_storage_plugin.kvtier.url": url,
        "remote_storage_plugin.kvtier.timeout_s": 2.0,
    }
    if token:
        extra["remote_storage_plugin.kvtier.token"] = token
    return {"remote_storage_plugins": ["kvtier"], "extra_config": extra}


def plugin_config(config_file: str) -> dict[str, Any]:
    """The LMCache config block of docs/lmcache.md for the embedded storage plug-in."""
    return {
        "storage_plugins": ["kvtier"],
        "extra_config": {
            "storage_plugin.kvtier.module_path": "kvtier.connectors.lmcache",
            "storage_plugin.kvtier.class_name": "KVTierStoragePlugin",
            "storage_plugin.kvtier.config_file": config_file,
        },
    }


def nvme_toml(directory: Path, capacity: str = "64MiB", **service: Any) -> str:
    """A kvtier config whose only tier is nvme: what it holds survives a restart, even
    one that is not clean (a host tier above it is written down only at a clean close)."""
    lines = [
        "[[tiers]]",
        'kind = "nvme"',
        f'capacity_bytes = "{capacity}"',
        f'dir = "{directory / "nvme"}"',
        "create_dirs = true",
        "",
        # keep: admit every chunk (the cost model declines new chunks for a lone SSD).
        "[store]",
        'placement = "keep"',
        "",
        "[service]",
        f'data_dir = "{directory}"',
        'max_value_bytes = "1MiB"',
    ]
    lines += [f"{k} = {v!r}" for k, v in service.items()]
    return "\n".join(lines) + "\n"


def nvme_daemon(directory: Path, port: int | None = None) -> Daemon:
    """``kvtier serve`` on a free port with :func:`nvme_toml` (same dir: same chunks)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "kvtier.toml"
    config.write_text(nvme_toml(directory))
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    log = directory / f"daemon-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*kvtier_cmd(), "serve", "--config", str(config), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    d = Daemon(f"http://127.0.0.1:{port}", proc, log)
    return wait_ready(d)


REMOTE = "RemoteBackend-kvtier"
PLUGIN = "kvtier"


def _store_main(url: str, seed: int, n_tokens: int) -> None:
    tokens, kv = prompt(seed, n_tokens)
    with engine(remote_config(url)) as e:
        e.store(tokens, kv)
        n = e.wait_stored(tokens, REMOTE)
        print(f"stored {n}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "store":
        _store_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
