"""LMCache's ``save_chunk_meta`` under the remote plug-in, against a real daemon process.

LMCache's connectors keep each value's shapes, dtypes and memory format when
``save_chunk_meta`` is on (its default), so a value of any layout comes back as it went
in. The connector is built by LMCache's own loader (``CreateConnector`` over the plug-in
config of docs/lmcache.md) over a LocalCPUBackend, as LMCache's connector tests do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import LocalCPUBackend
from lmcache.v1.storage_backend.connector import CreateConnector

from kvtier.connectors.lmcache.keys import engine_key
from kvtier.service.client import Client
from tests.connectors.lmcache_engine import CHUNK, DTYPE, HEAD_SIZE, HEADS, LAYERS, remote_config
from tests.service.conftest import Daemon, start_daemon

FULL = [torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_SIZE])]
KV = MemoryFormat.KV_2LTD
# (shapes, dtypes, format) of each value, in key order: chunks of the engine's layout
# between values of other layouts; the partial chunk of the engine's layout comes last,
# as in a prompt.
LAYOUTS: list[tuple[list[torch.Size], list[torch.dtype], MemoryFormat]] = [
    (FULL, [DTYPE], KV),
    # Another shape and format, shorter than a chunk.
    ([torch.Size([2, 3, 16])], [torch.bfloat16], MemoryFormat.KV_T2D),
    (FULL, [DTYPE], KV),
    # The engine's shape in another dtype: as long as a chunk, so longer once described.
    (FULL, [torch.bfloat16], KV),
    # A partial chunk of a model with two KV layer groups.
    (
        [torch.Size([2, 1, 5, HEADS * HEAD_SIZE]), torch.Size([2, 1, 5, HEAD_SIZE])],
        [DTYPE, DTYPE],
        KV,
    ),
    (FULL, [DTYPE], KV),
    ([torch.Size([2, LAYERS, 5, HEADS * HEAD_SIZE])], [DTYPE], KV),  # a partial last chunk
]
OTHER = [1, 3, 4]  # the values whose layout the engine's metadata does not imply


def _layout(obj: MemoryObj) -> tuple[list[torch.Size], list[torch.dtype], MemoryFormat]:
    # LMCache cuts a partial chunk in ``shape`` and leaves ``shapes`` as they were.
    shapes = obj.get_shapes()
    shapes = [torch.Size(obj.meta.shape)] if len(shapes) == 1 else list(shapes)
    return shapes, list(obj.get_dtypes()), obj.get_memory_format()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    lp.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path)
    yield d
    d.stop()


def _connector(
    url: str, loop: asyncio.AbstractEventLoop, **extra: Any
) -> tuple[Any, LocalCPUBackend]:
    block = remote_config(url)
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        max_local_cpu_size=0.05,
        remote_storage_plugins=block["remote_storage_plugins"],
        extra_config={**block["extra_config"], **extra},
    )
    meta = LMCacheMetadata(
        model_name="kvtier-chunk-meta",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
    )
    local = LocalCPUBackend(cfg, meta, memory_allocator=PinMemoryAllocator(16 << 20))
    return CreateConnector("plugin://kvtier", loop, local, cfg), local


def _values(
    local: LocalCPUBackend, seed: int
) -> tuple[list[CacheEngineKey], list[MemoryObj], list[bytes]]:
    g = torch.Generator().manual_seed(seed)
    keys, objs, data = [], [], []
    for i, (shapes, dtypes, fmt) in enumerate(LAYOUTS):
        obj = local.allocate(shapes, dtypes, fmt)
        assert obj is not None
        raw = obj.byte_array.cast("B")
        raw[:] = torch.randint(0, 256, (raw.nbytes,), dtype=torch.uint8, generator=g).numpy()
        keys.append(CacheEngineKey("kvtier-chunk-meta", 1, 0, seed * 100 + i, DTYPE))
        objs.append(obj)
        data.append(bytes(raw))
    return keys, objs, data


def _run(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


@pytest.mark.parametrize("shared_bytes", ["1GiB", 0], ids=["load-pool", "no-pool"])
def test_values_of_any_layout_round_trip_and_engine_chunks_stay_bare(
    daemon: Daemon, loop: asyncio.AbstractEventLoop, shared_bytes: Any
) -> None:
    conn, local = _connector(
        daemon.url, loop, **{"remote_storage_plugin.kvtier.shared_bytes": shared_bytes}
    )
    try:
        keys, objs, data = _values(local, 1)
        layouts = [_layout(o) for o in objs]
        _run(loop, conn.batched_put(keys, objs))

        # One batched load (LMCache's prefetch): every value, in order, as it went in.
        got = _run(loop, conn.batched_get_non_blocking("lookup-1", keys))
        assert [_layout(o) for o in got] == layouts
        assert [bytes(o.byte_array.cast("B")) for o in got] == data
        for o in got:
            o.ref_count_down()
        # One at a time (LMCache's blocking get), each value of another layout.
        for i in OTHER:
            one = _run(loop, conn.get(keys[i]))
            assert one is not None, f"value {i} missed"
            assert _layout(one) == layouts[i]
            assert bytes(one.byte_array.cast("B")) == data[i]
            one.ref_count_down()

        # Chunks of the engine's layout are stored as their bytes alone (values stored
        # before per-chunk metadata was kept read the same).
        with Client(daemon.url) as client:
            for i, value in enumerate(data):
                stored = client.get(engine_key(keys[i]))
                assert stored is not None
                assert (stored == value) is (i not in OTHER), i
    finally:
        _run(loop, conn.close())
        local.close()


def test_save_chunk_meta_off_stores_every_value_bare(
    daemon: Daemon, loop: asyncio.AbstractEventLoop
) -> None:
    conn, local = _connector(daemon.url, loop, save_chunk_meta=False)
    try:
        keys, objs, data = _values(local, 2)
        _run(loop, conn.batched_put(keys, objs))
        with Client(daemon.url) as client:
            assert [client.get(engine_key(k)) for k in keys] == data
        # A chunk of the engine's layout reads back as before.
        got = _run(loop, conn.get(keys[0]))
        assert got is not None and bytes(got.byte_array.cast("B")) == data[0]
        got.ref_count_down()
    finally:
        _run(loop, conn.close())
        local.close()
