"""``KVTierStoragePlugin``: LMCache's storage plug-in holding an embedded kvtier store.

LMCache config::

    storage_plugins: ["kvtier"]
    extra_config:
      storage_plugin.kvtier.module_path: kvtier.connectors.lmcache
      storage_plugin.kvtier.class_name: KVTierStoragePlugin
      storage_plugin.kvtier.config_file: /etc/kvtier/lmcache.toml   # a kvtier TOML

The TOML is an ordinary kvtier configuration (docs/configuration.md): its ``[[tiers]]``
(host, cxl, nvme, redis) and ``[store]`` policies apply; its slot size is LMCache's
chunk (from the engine's metadata), whatever ``[model]`` says. Without a file the
embedded default applies (a 2 GiB host tier: nothing survives a restart).

Contracts kept (read from LMCache 0.5.6, ``abstract_backend.py``): the storage manager
drops its reference to a memory object as soon as ``batched_submit_put_task`` returns,
so each store takes a reference (``ref_count_up``) and releases it when the kvtier
store has copied the bytes. Loads allocate through ``local_cpu_backend.allocate`` and
the store copies straight into the object. A failing tier is a miss (the store logs
and counts it); nothing here raises into LMCache after start-up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lmcache.integration.vllm.utils import get_size_bytes
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from typing_extensions import override

from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.factory import build_store
from kvtier.keys import ChunkKey
from kvtier.store.types import GetResult, PutResult

from .keys import engine_key
from .settings import STORAGE_PREFIX, plugin_name
from .spans import collect, spans

log = logging.getLogger(__name__)

CONFIG_FILE = "config_file"
DROP_LOG_EVERY_S = 30.0


class KVTierStoragePlugin(StoragePluginInterface):  # type: ignore[misc]  # LMCache is untyped
    """An embedded kvtier store as one of LMCache's storage backends. Thread-safe.

    Args (as LMCache's ``storage_plugin_launcher`` passes them):
        dst_device: where blocking loads land; LMCache passes its device.
        config: LMCache's engine config; settings in ``extra_config``.
        metadata: the engine's metadata (chunk shape and dtype).
        local_cpu_backend: allocates the memory objects that loads fill.
        loop: LMCache's event loop.

    Raises:
        ConfigError: no metadata or local CPU backend, or a bad kvtier config file.
    """

    def __init__(
        self,
        dst_device: str = "cpu",
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        if config is None or metadata is None or local_cpu_backend is None:
            raise ConfigError(
                "storage_plugins", "kvtier", "an engine with metadata and local_cpu_backend"
            )
        extra = config.extra_config or {}
        self.name = plugin_name(extra, config.storage_plugins, STORAGE_PREFIX, type(self).__name__)
        path = extra.get(f"{STORAGE_PREFIX}.{self.name}.{CONFIG_FILE}")
        cfg = load_config(path or None)
        self.meta_shapes = metadata.get_shapes()
        self.meta_dtypes = metadata.get_dtypes()
        self.meta_fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        # Names RemoteConnector.reshape_partial_chunk reads (reused below).
        self.full_chunk_size_bytes: int = get_size_bytes(self.meta_shapes, self.meta_dtypes)
        self.single_token_size = self.full_chunk_size_bytes // metadata.chunk_size
        self.store = build_store(cfg, chunk_bytes=self.full_chunk_size_bytes).store
        self._lock = threading.Lock()
        self._put_tasks: set[CacheEngineKey] = set()
        # Chunks stored to LMCache's call that the kvtier store did not keep.
        self.dropped_total = 0
        self._last_drop_log = -DROP_LOG_EVERY_S
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lmcache-plugin")
        log.info(
            "kvtier storage plug-in %r: %s, chunk %d B, tiers %s",
            self.name,
            path or "embedded default config",
            self.full_chunk_size_bytes,
            ", ".join(t.name for t in self.store.tiers),
        )

    @override
    def __str__(self) -> str:
        return f"KVTierStoragePlugin({self.name})"

    # -- presence --------------------------------------------------------------------------

    def _hits(self, keys: Sequence[CacheEngineKey], pin: bool) -> int:
        ks = [engine_key(k) for k in keys]
        try:
            n = self.store.lookup(ks).hits
            if pin and n:
                n = min(n, self.store.pin(ks[:n]))
        except KVTierError as exc:  # a closed store (shutdown race): a miss
            log.debug("kvtier storage plug-in: lookup failed, a miss: %s", exc)
            return 0
        return n

    @override
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._hits([key], pin) == 1

    @override
    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self._hits(keys, pin)

    @override
    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return self._hits(keys, pin)

    @override
    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._put_tasks

    # -- stores ------------------------------------------------------------------------------

    @override
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[PutResult]]:
        if not keys:
            return []
        ks = [engine_key(k) for k in keys]
        # LMCache drops its references when this returns: hold one each until the copy.
        for obj in objs:
            obj.ref_count_up()
        with self._lock:
            self._put_tasks.update(keys)
        done = functools.partial(self._put_done, keys, objs, callback=on_complete_callback)
        try:
            # One put for the whole batch (one buffer per chunk, no copy), so the store
            # places the prompt's head before its tail: a prompt longer than the store
            # keeps its head, which lookups can hit, never a tail they cannot. As the
            # prefix, the batch's chunks the store already holds are kept while it makes
            # room. (One put per chunk would race on the I/O threads: a tail chunk could
            # take the last slot before the head's put ran.)
            fut = self.store.put(ks, [obj.byte_array.cast("B") for obj in objs], prefix=ks)
        except KVTierError as exc:
            log.warning("kvtier storage plug-in: store of %d chunks refused: %s", len(ks), exc)
            done(None)
            return []
        fut.add_done_callback(done)
        return [fut]

    def _put_done(
        self,
        keys: Sequence[CacheEngineKey],
        objs: Sequence[MemoryObj],
        fut: Future[PutResult] | None,
        *,
        callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        for obj in objs:
            obj.ref_count_down()
        with self._lock:
            self._put_tasks.difference_update(keys)
        if fut is None or fut.exception():
            return
        res = fut.result()
        if res.rejected or res.failed:
            self._dropped(res)
        if callback is None:
            return
        for key in keys:
            try:
                callback(key)
            except Exception as exc:  # LMCache's callback: its failure must not kill ours
                log.warning("kvtier storage plug-in: on_complete_callback failed: %s", exc)

    def _dropped(self, res: PutResult) -> None:
        """Say, at most once per DROP_LOG_EVERY_S, that a store kept fewer chunks."""
        now = time.monotonic()
        with self._lock:
            self.dropped_total += res.rejected + res.failed
            if now - self._last_drop_log < DROP_LOG_EVERY_S:
                return
            self._last_drop_log = now
            total = self.dropped_total
        log.warning(
            "kvtier storage plug-in %r: a chunk was not kept (%s; %d so far); it will "
            "miss, LMCache's other backends still hold it",
            self.name,
            "no room: the store is full or its placement declined it"
            if res.rejected
            else "a tier error, logged by the store",
            total,
        )

    # -- loads -------------------------------------------------------------------------------

    def _load_run(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """Load the leading present run of ``keys`` (stops at the first miss).

        One store get per span of back-to-back memory objects (usually the whole run:
        see :mod:`.spans`), so the chunks of a run are read in parallel by the tier
        with one index lookup and one thread hop, straight into LMCache's memory.
        """
        ks: list[ChunkKey] = [engine_key(k) for k in keys]
        try:
            n = self.store.lookup(ks).hits
        except KVTierError:
            return []
        assert self.local_cpu_backend is not None
        objs: list[MemoryObj] = []
        for _ in range(n):
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                break
            objs.append(obj)
        span_list = spans(objs, self.full_chunk_size_bytes)
        futures: list[Future[GetResult] | None] = []
        for sp in span_list:
            try:
                futures.append(self.store.get(ks[sp.start : sp.start + sp.count], sp.view))
            except KVTierError as exc:  # closed, or the chunks left meanwhile: a miss
                log.debug("kvtier storage plug-in: load failed, a miss: %s", exc)
                futures.append(None)
        results: list[tuple[int, ...]] = []
        for fut in futures:
            try:
                results.append(fut.result().value_bytes if fut is not None else ())
            except KVTierError as exc:  # the store closed under the load: a miss
                log.debug("kvtier storage plug-in: load failed, a miss: %s", exc)
                results.append(())
        return collect(
            objs,
            results,
            span_list,
            self.full_chunk_size_bytes,
            lambda obj, value: RemoteConnector.reshape_partial_chunk(self, obj, value.nbytes),
        )

    @override
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        got = self._load_run([key])
        return got[0] if got else None

    @override
    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        got: list[MemoryObj | None] = list(self._load_run(keys))
        return got + [None] * (len(keys) - len(got))

    @override
    def get_non_blocking(
        self, key: CacheEngineKey, location: str | None = None
    ) -> Future[MemoryObj | None]:
        return self._pool.submit(self.get_blocking, key)

    @override
    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._load_run, keys)

    # -- the rest ----------------------------------------------------------------------------

    @override
    def pin(self, key: CacheEngineKey) -> bool:
        return self._hits([key], pin=True) == 1

    @override
    def unpin(self, key: CacheEngineKey) -> bool:
        try:
            self.store.unpin([engine_key(key)])
        except KVTierError:
            return False
        return True

    @override
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        try:
            return self.store.delete([engine_key(key)]) > 0
        except KVTierError:
            return False

    @override
    def touch_cache(self) -> None:
        """Nothing to do: the kvtier store updates its eviction order on every read."""

    @override
    def get_allocator_backend(self) -> LocalCPUBackend:
        assert self.local_cpu_backend is not None
        return self.local_cpu_backend

    @override
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
