"""``KVTierRemoteConnector``: LMCache's remote storage plug-in, backed by a kvtier daemon.

LMCache config::

    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.connectors.lmcache
      remote_storage_plugin.kvtier.class_name: KVTierRemoteConnector
      remote_storage_plugin.kvtier.url: http://127.0.0.1:8470
      remote_storage_plugin.kvtier.token: ...   # optional: the daemon's tenant token

LMCache's ``DynamicConnectorAdapter`` builds it as ``cls(loop=, local_cpu_backend=,
config=)`` and its ``RemoteBackend`` calls the coroutines on ``loop``. That loader does
not say which plug-in name it serves, so for more than one kvtier plug-in in one config
(``remote_storage_plugins: ["kvtier.a", "kvtier.b"]``) name
``class_name: KVTierConnectorAdapter`` instead: LMCache then passes the name, and each
connector reads its own settings. Each call runs
the blocking HTTP request on this connector's own threads, so the loop never waits on
a socket and several chunks move at once.

Values are the chunk's bytes as LMCache hands them over (``memory_obj.byte_array``).
A chunk of the engine's layout (full, or a partial last chunk, which
``reshape_partial_chunk`` shortens) is stored bare: the engine's metadata and the
value's length say its shape. Under ``save_chunk_meta`` (LMCache's default) a value of
any other layout is stored with its shapes, dtypes and format (:mod:`.layout`) and comes
back as it went in. Loads of bare values are one copy:
from a daemon on this host, into memory objects of a pool shared with it (:mod:`.pool`,
``shared_bytes``, default 1 GiB, at most LMCache's ``max_local_cpu_size``; made at the
first load, not when the connector is built; LMCache's own memory once the pool is
held); over HTTP, from the socket into the objects LMCache allocates.

Contracts kept (read from LMCache 0.5.6): ``put`` never calls ``ref_count_down()`` (the
instrumented wrapper does); ``get`` takes its objects from the load pool or through
``local_cpu_backend.allocate``, and frees them again on a miss; no method raises: a
daemon that is down or refuses is a miss or a dropped store, logged (see :mod:`.link`).
Capacity and eviction are the daemon's: a store that does not fit is rejected by the
daemon's placement, never an error here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from typing_extensions import override

from kvtier.errors import ConfigError
from kvtier.units import GiB

from .keys import engine_key
from .layout import Geometry, describe, parse
from .link import DaemonLink
from .pool import LoadPool, page_lock
from .settings import REMOTE_PREFIX, daemon_settings, plugin_name, shared_bytes
from .spans import Span, collect, spans, split

log = logging.getLogger(__name__)

T = TypeVar("T")

# Requests in flight at once: enough to overlap a batch's round trips on loopback,
# few enough not to starve the engine's own threads.
IO_THREADS = 8
# After the load pool could not be made (channel down), loads copy for this long
# before the connector asks for shared memory again.
POOL_RETRY_S = 5.0
# Keys list() can name: the most recent stores of this connector (the daemon keeps keyed
# hashes of keys, which cannot be listed back).
LIST_KEYS = 65536


class _Then(enum.Enum):
    """What a load does after one pass over its keys."""

    STOP = enum.auto()  # every key loaded, or the run ends here
    AGAIN = enum.auto()  # a described value ended the pass: ask for the keys after it
    ASK = enum.auto()  # the next key missed: ask for it whole (it may not have fit)


class _Landed(enum.Enum):
    """How one value of a pass landed."""

    FULL = enum.auto()
    PARTIAL = enum.auto()
    DESCRIBED = enum.auto()
    MALFORMED = enum.auto()


class KVTierRemoteConnector(RemoteConnector):  # type: ignore[misc]  # LMCache is untyped
    """A kvtier daemon as LMCache's remote storage. Thread-safe; every call answers.

    Args:
        loop: LMCache's event loop (the coroutines run on it).
        local_cpu_backend: allocates the memory objects that loads fill.
        config: LMCache's engine config; the settings sit in its ``extra_config``.
        plugin_name: the name in ``remote_storage_plugins``; found from ``class_name``
            when LMCache does not pass it (it does not in 0.5.6).

    Raises:
        ConfigError: no ``url``, or a malformed one.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: LocalCPUBackend,
        config: LMCacheEngineConfig | None,
        plugin_name: str | None = None,
        metadata: LMCacheMetadata | None = None,
    ) -> None:
        cfg = config if config is not None else getattr(local_cpu_backend, "config", None)
        meta = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if cfg is None:
            raise ConfigError("remote_storage_plugins", plugin_name, "an LMCache config")
        if meta is not None:
            super().__init__(cfg, meta)
        else:
            # LMCache's scheduler role: no local CPU backend and no chunk geometry.
            # Lookups work; a load has nothing to land in and is a miss.
            self.save_chunk_meta = False
            self.meta_shapes: list[Any] = []
            self.meta_dtypes: list[Any] = []
            self.meta_fmt = None
            self.full_chunk_size_bytes = self.single_token_size = 0
        # The layout bare values are read back with (None in the scheduler role).
        self.geometry: Geometry | None = None
        if meta is not None:
            self.geometry = Geometry(
                self.meta_shapes,
                self.meta_dtypes,
                self.meta_fmt,
                self.full_chunk_size_bytes,
                self.single_token_size,
            )
        extra = cfg.extra_config or {}
        name = plugin_name or _name(cfg, extra)
        self.settings = daemon_settings(extra, f"{REMOTE_PREFIX}.{name}")
        self.shared_bytes = shared_bytes(extra, f"{REMOTE_PREFIX}.{name}")
        local_gb = float(getattr(cfg, "max_local_cpu_size", 0) or 0)
        if local_gb > 0:
            # The pool's objects end up in LMCache's local CPU cache: no larger than it.
            self.shared_bytes = min(self.shared_bytes, int(local_gb * GiB))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.link = DaemonLink(self.settings, pool=IO_THREADS)
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvtier-lmcache")
        # Loads land here when the daemon shares this host (see .pool). Made at the
        # first load (_shared_pool): an engine that never loads maps no shared memory.
        self.load_pool: LoadPool | None = None
        self._load_pool_lock = threading.Lock()
        self._load_pool_retry_at = 0.0
        self._stored_keys: OrderedDict[str, CacheEngineKey] = OrderedDict()
        log.info(
            "kvtier remote plug-in %r: daemon %s, chunk %d B",
            name,
            self.settings.url,
            self.full_chunk_size_bytes,
        )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- presence --------------------------------------------------------------------------

    @override
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self.exists_sync, key)

    @override
    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.link.exists(engine_key(key))

    @override
    def support_batched_contains(self) -> bool:
        return True

    @override
    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """Leading keys the daemon holds: one lookup request, not one per key."""
        return self.link.hits([engine_key(k) for k in keys])

    @override
    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._run(self.batched_contains, keys)

    # -- loads -------------------------------------------------------------------------------

    def _shared_pool(self) -> LoadPool | None:
        """The load pool while the daemon's same-host channel maps it; a new one after the
        channel was replaced (the old one lives on until LMCache frees its objects);
        None without a channel, or with ``shared_bytes = 0``."""
        if self.shared_bytes == 0:
            return None
        with self._load_pool_lock:
            pool = self.load_pool
            if pool is not None and self.link.is_shared(pool.array):
                return pool
            self.load_pool = None
            if time.monotonic() < self._load_pool_retry_at:
                return None
            array = self.link.shared_region(self.shared_bytes)
            if array is None:
                self._load_pool_retry_at = time.monotonic() + POOL_RETRY_S
                return None
            reason = page_lock(array)
            if reason is not None:
                log.warning("kvtier remote plug-in: loads copy once more (%s)", reason)
                self.shared_bytes = 0
                return None
            try:
                self.load_pool = LoadPool(array, self.full_chunk_size_bytes)
            except ValueError as exc:
                log.warning("kvtier remote plug-in: loads copy once more (%s)", exc)
                self.shared_bytes = 0
                return None
            log.info(
                "kvtier remote plug-in: loads land in %d chunk slots shared with the daemon",
                self.load_pool.slots,
            )
            return self.load_pool

    def _allocate(self, n: int) -> list[MemoryObj]:
        """Memory objects for ``n`` loads: from the shared pool first (no copy on this
        side), then from LMCache's allocator."""
        pool = self._shared_pool()
        objs = pool.take(n, self.meta_shapes, self.meta_dtypes, self.meta_fmt) if pool else []
        for _ in range(n - len(objs)):
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                log.debug("kvtier remote plug-in: no local CPU memory for a load; a miss")
                break
            objs.append(obj)
        return objs

    async def _load_run(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of ``keys`` the daemon holds, loaded; the rest freed.

        Into the shared load pool: one hand-off to an I/O thread, which allocates and
        asks (:meth:`_load_in_place`). Otherwise a few requests per span of back-to-back
        memory objects (usually the whole run: see :mod:`.spans`), at most four in
        flight: one request per chunk paid a round trip each; one for the whole run left
        the daemon's reads and the client's receive in sequence. Either way bare values
        land straight in LMCache's memory, in one pass.

        A described value (:mod:`.layout`) ends a pass: it is copied into an object of
        its own layout and the next pass asks for the keys after it. One that did not
        fit where its pass put it (longer than a chunk) comes back as a miss there, so
        the key a pass stopped at is asked for once more, whole.
        """
        if not keys or self.full_chunk_size_bytes == 0:
            return []  # the scheduler role: nothing to load into
        out: list[MemoryObj] = []
        while len(out) < len(keys):
            rest = keys[len(out) :]
            if self.load_pool is not None or (self.shared_bytes and self._load_pool_retry_at == 0):
                # The pool (made at the first load, on an I/O thread) while it serves.
                got, then = await self._run(self._load_in_place, rest)
            else:
                got, then = await self._load_spans(rest)
            out += got
            if then is _Then.ASK:
                whole = await self._run(self._load_whole, rest[len(got)])
                if whole is None:
                    break
                out.append(whole)
            elif then is _Then.STOP:
                break
        return out

    async def _load_spans(self, keys: Sequence[CacheEngineKey]) -> tuple[list[MemoryObj], _Then]:
        objs = await self._run(self._allocate, len(keys))
        span_list = split(spans(objs, self.full_chunk_size_bytes), self.full_chunk_size_bytes, 4)
        ks = [engine_key(k) for k in keys]
        results = await asyncio.gather(
            *(
                self._run(self.link.get_into_many, ks[sp.start : sp.start + sp.count], sp.view)
                for sp in span_list
            )
        )
        return self._collect(objs, results, span_list)

    def _load_in_place(self, keys: Sequence[CacheEngineKey]) -> tuple[list[MemoryObj], _Then]:
        """Allocate and load on this thread, one request per span, in order.

        With the objects in memory the daemon maps, no bytes cross the socket, so
        requests in flight together gain nothing (a 64 MiB load took the same with one
        and with four), while every hand-off between the event loop and an I/O thread
        is a thread wake-up: 0.3-1 ms each on the 2-vCPU VM (docs/benchmarks.md).
        """
        objs = self._allocate(len(keys))
        span_list = spans(objs, self.full_chunk_size_bytes)
        ks = [engine_key(k) for k in keys]
        results: list[tuple[int, ...]] = []
        short = False  # after a short span nothing more is kept: no request for the rest
        for sp in span_list:
            got = (
                ()
                if short
                else self.link.get_into_many(ks[sp.start : sp.start + sp.count], sp.view)
            )
            short = len(got) < sp.count
            results.append(got)
        return self._collect(objs, results, span_list)

    def _collect(
        self, objs: list[MemoryObj], results: Sequence[Sequence[int]], span_list: list[Span]
    ) -> tuple[list[MemoryObj], _Then]:
        """One pass's loaded run, and what the load does next."""
        last: list[_Landed] = []

        def land(obj: MemoryObj, value: memoryview) -> MemoryObj:
            return self._land(obj, value, last)

        got = collect(objs, results, span_list, self.full_chunk_size_bytes, land)
        if len(got) == len(objs) or (last and last[-1] is not _Landed.FULL):
            # Done, out of memory, a partial chunk (the last), or a malformed value;
            # or a described value, after which the keys that follow are asked again.
            described = bool(last) and last[-1] is _Landed.DESCRIBED and len(got) < len(objs)
            return got, _Then.AGAIN if described else _Then.STOP
        return got, _Then.ASK

    def _land(self, obj: MemoryObj, value: memoryview, last: list[_Landed]) -> MemoryObj:
        """A bare value cut to its length (LMCache's ``reshape_partial_chunk``), or a
        described one copied into an object of its own layout (``obj`` released)."""
        assert self.geometry is not None  # loads run only with engine metadata
        n = value.nbytes
        if self.geometry.bare_length(n):
            last.append(_Landed.FULL if n == self.full_chunk_size_bytes else _Landed.PARTIAL)
            return self.reshape_partial_chunk(obj, n)
        last.append(_Landed.MALFORMED)
        got = self._unpack(value)
        last[-1] = _Landed.DESCRIBED
        obj.ref_count_down()
        return got

    def _unpack(self, value: memoryview) -> MemoryObj:
        """A described value, in an object LMCache allocates for its layout.

        Raises:
            ValueError: not a described value, or no memory for it (a miss either way).
        """
        d = parse(value)
        obj = self.local_cpu_backend.allocate(d.shapes, d.dtypes, d.fmt)
        if obj is None:
            raise ValueError("no local CPU memory for a described chunk")
        dst = obj.byte_array.cast("B")
        if dst.nbytes != d.data.nbytes:
            obj.ref_count_down()
            raise ValueError(f"an object of {dst.nbytes} B for a chunk of {d.data.nbytes} B")
        dst[:] = d.data
        return obj

    def _load_whole(self, key: CacheEngineKey) -> MemoryObj | None:
        """One value asked for whole (a described value longer than a chunk); None for a
        miss."""
        value = self.link.get_value(engine_key(key))
        if value is None:
            return None
        try:
            if self.geometry is not None and self.geometry.bare_length(len(value)):
                # Stored between the pass and this request: read it as the pass would.
                obj = self.local_cpu_backend.allocate(
                    self.meta_shapes, self.meta_dtypes, self.meta_fmt
                )
                if obj is None:
                    return None
                obj.byte_array.cast("B")[: len(value)] = value
                return self.reshape_partial_chunk(obj, len(value))
            return self._unpack(memoryview(value))
        except ValueError as exc:
            log.warning("kvtier under LMCache: malformed chunk, a miss: %s", exc)
            return None

    @override
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        got = await self._load_run([key])
        return got[0] if got else None

    @override
    def support_batched_get(self) -> bool:
        return True

    @override
    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        got: list[MemoryObj | None] = list(await self._load_run(keys))
        return got + [None] * (len(keys) - len(got))

    @override
    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        """The leading run of loaded chunks; objects loaded after a miss are freed."""
        return await self._load_run(keys)

    # -- stores ------------------------------------------------------------------------------

    def _value(self, obj: MemoryObj) -> memoryview:
        """What is stored for ``obj``: its bytes, described when LMCache's
        ``save_chunk_meta`` is on and the engine's layout does not imply them."""
        view: memoryview = obj.byte_array.cast("B")
        if (
            not self.save_chunk_meta
            or self.geometry is None
            or self.geometry.implies(obj, view.nbytes)
        ):
            return view
        described = describe(obj, view, self.geometry)
        return view if described is None else memoryview(described)

    def _put_sync(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        views = [self._value(o) for o in objs]
        res = self.link.put_many([engine_key(k) for k in keys], views)
        if res is not None and res.stored + res.present:
            with self._load_pool_lock:
                for k in keys:
                    self._stored_keys[k.to_string()] = k
                    self._stored_keys.move_to_end(k.to_string())
                while len(self._stored_keys) > LIST_KEYS:
                    self._stored_keys.popitem(last=False)

    @override
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # No ref_count_down() here: LMCache's instrumented wrapper releases the object.
        await self._run(self._put_sync, [key], [memory_obj])

    @override
    def support_batched_put(self) -> bool:
        return True

    @override
    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await self._run(self._put_sync, keys, memory_objs)

    # -- the rest ----------------------------------------------------------------------------

    @override
    def remove_sync(self, key: CacheEngineKey) -> bool:
        with self._load_pool_lock:
            self._stored_keys.pop(key.to_string(), None)
        return self.link.delete(engine_key(key))

    def _list_sync(self) -> list[str]:
        with self._load_pool_lock:
            mine = list(self._stored_keys.items())
        held = self.link.present([engine_key(k) for _, k in mine]) or []
        return [name for (name, _), hit in zip(mine, held, strict=False) if hit]

    @override
    async def list(self) -> list[str]:
        """Keys (LMCache's ``to_string()``) this connector stored that the daemon still
        holds, up to the last :data:`LIST_KEYS` stores: the daemon keeps keyed hashes of
        keys, which cannot be listed back, so keys stored by other engines are not named."""
        return await self._run(self._list_sync)

    @override
    def support_ping(self) -> bool:
        """False on purpose: LMCache's health monitor turns a failed ping into
        "recompute everything" (its default ``fallback_policy``), while this connector
        already answers misses per call and reconnects by itself (docs/lmcache.md)."""
        return False

    @override
    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.link.close()
        # The pool's memory goes with the last object LMCache still holds, not with
        # this connector (LMCache may keep a closed connector referenced).
        with self._load_pool_lock:
            self.load_pool = None
            self.shared_bytes = 0

    @override
    def __repr__(self) -> str:
        return f"<KVTierRemoteConnector {self.settings.url}>"


class KVTierConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]  # LMCache is untyped
    """LMCache's connector adapter for kvtier: builds a :class:`KVTierRemoteConnector`
    for the plug-in name LMCache asks for.

    ``remote_storage_plugins`` names of type ``kvtier`` (``kvtier``, or
    ``kvtier.<instance>`` as LMCache spells instances) with ``class_name:
    KVTierConnectorAdapter`` each get a connector with their own settings
    (``remote_storage_plugin.<name>.url`` ...), which the bare connector class cannot
    tell apart.
    """

    TYPE = "kvtier"

    def __init__(self) -> None:
        super().__init__(f"plugin://{self.TYPE}")

    @override
    def can_parse(self, url: str) -> bool:
        if not url.startswith("plugin://"):
            return False
        name = url[len("plugin://") :]
        return name.split(".", 1)[0] == self.TYPE

    @override
    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url[len("plugin://") :]
        return KVTierRemoteConnector(
            context.loop,
            context.local_cpu_backend,
            context.config,
            plugin_name=name,
            metadata=context.metadata,
        )


def _name(cfg: LMCacheEngineConfig, extra: dict[str, Any]) -> str:
    return plugin_name(
        extra, cfg.remote_storage_plugins, REMOTE_PREFIX, KVTierRemoteConnector.__name__
    )
