"""``KVTierL2Adapter``: a kvtier daemon as the L2 of LMCache's multiprocess server.

Start LMCache's server on it::

    lmcache server --l2-adapter '{"type": "plugin",
        "module_path": "kvtier.connectors.lmcache", "class_name": "KVTierL2Adapter",
        "adapter_params": {"url": "http://127.0.0.1:8470", "token": "..."}}'

``adapter_params``: ``url`` (required), ``token`` (the daemon's tenant token),
``timeout_s`` (per request, default 5).

The interface (LMCache 0.5.6, ``l2_adapters/base.py``) is non-blocking: each
``submit_*`` returns a task id at once, a worker thread runs the task against the
daemon, records the result and signals the task kind's event fd; LMCache's controllers
pop the results. Keys are ``ObjectKey`` (model, KV rank, object group, chunk hash and
``cache_salt``), mapped by :func:`.keys.object_key`, so two salts never share a chunk.

What "lock" means here: the daemon's REST API has no pins, so lookup-and-lock only
reports presence and unlock has nothing to release. A chunk the daemon evicts between
lookup and load fails that key's load bit, which LMCache already treats as a miss.
Capacity and eviction are the daemon's (``max_capacity_bytes`` is 0, so LMCache does
not run its own global eviction over it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier
from typing_extensions import override

from kvtier.errors import ConfigError

from .keys import object_key
from .link import DaemonLink
from .settings import params_settings

R = TypeVar("R")

log = logging.getLogger(__name__)

# Tasks run at once: LMCache has two controller threads (store and prefetch).
WORKERS = 4


class KVTierL2Adapter(L2AdapterInterface):  # type: ignore[misc]  # LMCache is untyped
    """LMCache's L2 adapter over a kvtier daemon. Thread-safe.

    Args:
        config: ``adapter_params`` as LMCache's plugin factory passes them (a dict).
        l1_memory_desc: LMCache's L1 description (unused: values are copied).

    Raises:
        ConfigError: no ``url``, a malformed one, or an unknown parameter.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(max_capacity_bytes=0)
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError("adapter_params", config, "a JSON object with url (and token)")
        self.settings = params_settings(dict(config or {}))
        self.link = DaemonLink(self.settings, pool=WORKERS)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvtier-l2")
        log.info("kvtier L2 adapter: daemon %s", self.settings.url)

    def _submit(self, fn: Callable[..., None], *args: Any) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        self._pool.submit(self._guard, fn, task_id, *args)
        return task_id

    def _finish(self, done: dict[L2TaskId, R], efd: Any, task_id: L2TaskId, result: R) -> None:
        """Record a task's result, then wake LMCache's controller on the kind's event fd."""
        with self._lock:
            done[task_id] = result
        efd.notify()

    def _take(self, done: dict[L2TaskId, R], task_id: L2TaskId) -> R | None:
        with self._lock:
            return done.pop(task_id, None)

    @staticmethod
    def _guard(fn: Callable[..., None], task_id: L2TaskId, *args: Any) -> None:
        try:
            fn(task_id, *args)
        except Exception:  # a bug here must still complete the task, or LMCache waits forever
            log.exception("kvtier L2 adapter: task %d failed", task_id)

    # -- event fds ----------------------------------------------------------------------------

    @override
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    @override
    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    @override
    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- store --------------------------------------------------------------------------------

    @override
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._store, keys, objects)

    def _store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        sizes = [int(o.get_size()) for o in objects]
        res = None
        try:
            views = [o.byte_array.cast("B") for o in objects]
            res = self.link.put_many([object_key(k) for k in keys], views)
        finally:
            ok = res is not None and res.stored + res.present == len(keys)
            moved = sum(sizes) if ok and res is not None and res.stored else 0
            if ok:
                self._notify_keys_stored(keys, sizes)
            self._finish(self._stores, self._store_efd, task_id, L2StoreResult(ok, moved))

    @override
    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ----------------------------------------------------------------------

    @override
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(self._lookup, keys)

    def _lookup(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            # The daemon answers the leading run: LMCache asks for a prefix and uses
            # only the leading hits, so a key after the first miss counts as missing.
            for i in range(self.link.hits([object_key(k) for k in keys])):
                bitmap.set(i)
        finally:
            self._finish(self._lookups, self._lookup_efd, task_id, bitmap)

    @override
    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._lookups, task_id)

    @override
    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to release: lookups lock nothing (see the module docstring)."""

    # -- load ---------------------------------------------------------------------------------

    @override
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._load, keys, objects)

    def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        try:
            for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
                dst = obj.byte_array.cast("B")
                # A value of another length (another layout under the same key) is a miss.
                if self.link.get_into(object_key(key), dst) == dst.nbytes:
                    bitmap.set(i)
                    loaded.append(key)
        finally:
            if loaded:
                self._notify_keys_accessed(loaded)
            self._finish(self._loads, self._load_efd, task_id, bitmap)

    @override
    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._loads, task_id)

    # -- the rest -----------------------------------------------------------------------------

    @override
    def delete(self, keys: list[ObjectKey]) -> None:
        for key in keys:
            self.link.delete(object_key(key))

    @override
    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": self.link.available(),
            "type": type(self).__name__,
            "url": self.settings.url,
            "daemon_failures": self.link.failures_total,
        }

    @override
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.link.close()
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()
