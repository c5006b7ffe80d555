"""``KVTierL2Adapter``: a kvtier daemon as the L2 of LMCache's multiprocess server.

Start LMCache's server on it::

    lmcache server --l2-adapter '{"type": "plugin",
        "module_path": "kvtier.connectors.lmcache", "class_name": "KVTierL2Adapter",
        "adapter_params": {"url": "http://127.0.0.1:8470", "token": "..."}}'

``adapter_params``: ``url`` (required), ``token`` (the daemon's tenant token),
``timeout_s`` (per request, default 5), ``capacity_bytes`` (what LMCache's eviction
counts against; default: the daemon's tiers together, as it reports them at start).

The interface (LMCache 0.5.6, ``l2_adapters/base.py``) is non-blocking: each
``submit_*`` returns a task id at once, a worker thread runs the task against the
daemon, records the result and signals the task kind's event fd; LMCache's controllers
pop the results. Keys are ``ObjectKey`` (model, KV rank, object group, chunk hash and
``cache_salt``), mapped by :func:`.keys.object_key`, so two salts never share a chunk.

What "lock" means here: the daemon's REST API has no pins, so lookup-and-lock only
reports presence, key by key, and unlock has nothing to release. A chunk the daemon
evicts between lookup and load fails that key's load bit, which LMCache already treats
as a miss.

LMCache's books: the adapter tells LMCache (``_notify_keys_*``, which keep its byte
accounting and feed its listeners: the eviction policy, the coordinator's cache events)
of each key it stored, once (a key stored again is not news), of each key it loaded and
of each key it deleted. It keeps the size of each key it announced, so a delete gives
back exactly what the store counted. ``max_capacity_bytes`` is the daemon's capacity
(or ``capacity_bytes``), so LMCache's global eviction can run over it; the daemon's own
eviction still applies underneath.
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
from kvtier.units import parse_size

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
        ConfigError: no ``url``, a malformed one, a bad ``capacity_bytes``, or an
            unknown parameter.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError("adapter_params", config, "a JSON object with url (and token)")
        params = dict(config or {})
        capacity = _capacity(params.pop("capacity_bytes", None))
        self.settings = params_settings(params)
        self.link = DaemonLink(self.settings, pool=WORKERS)
        super().__init__(
            max_capacity_bytes=self.link.capacity_bytes if capacity is None else capacity
        )
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        # Size of each key announced to LMCache as stored (and not yet as deleted).
        self._sizes: dict[ObjectKey, int] = {}
        self._closed = False
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
        ok, moved = False, 0
        try:
            views = [o.byte_array.cast("B") for o in objects]
            sizes = [v.nbytes for v in views]
            res = self.link.put_many([object_key(k) for k in keys], views)
            ok = res is not None and res.stored + res.present == len(keys)
            if ok:
                # Announced once: a key stored again (present) is not new bytes.
                with self._lock:
                    new = [(k, n) for k, n in zip(keys, sizes, strict=True) if k not in self._sizes]
                    self._sizes.update(new)
                moved = sum(n for _, n in new)
                if new:
                    self._notify_keys_stored([k for k, _ in new], [n for _, n in new])
        finally:
            # Inside the finally, whatever raised above: LMCache waits for every task.
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
            # Key by key, as the contract says: LMCache's prefetch plans use every hit,
            # not only the leading run (one request per run of hits).
            for i, hit in enumerate(self.link.present([object_key(k) for k in keys]) or ()):
                if hit:
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
        """Remove ``keys`` from the daemon and tell LMCache which left (with the sizes
        announced at their store). A key the daemon no longer held but LMCache was told
        of (the daemon evicted it) has left too; a key it could not be asked about stays.
        A no-op after :meth:`close`. Blocks on one request per key."""
        if self._closed or not keys:
            return
        answers = self.link.delete_many([object_key(k) for k in keys])
        gone: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            for key, answer in zip(keys, answers, strict=True):
                known = self._sizes.pop(key, None) if answer is not None else None
                if answer or known is not None:
                    gone.append(key)
                    sizes.append(known or 0)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    @override
    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": self.link.available(),
            "type": type(self).__name__,
            "url": self.settings.url,
            "daemon_failures": self.link.failures_total,
            "capacity_bytes": self._max_capacity_bytes,
        }

    @override
    def close(self) -> None:
        """Wait for running tasks, then release the link and the event fds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self.link.close()
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()


def _capacity(raw: object) -> int | None:
    """``capacity_bytes``: None when not given (the daemon's capacity applies)."""
    if raw is None:
        return None
    try:
        n = parse_size(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError("adapter_params.capacity_bytes", raw, "a size such as 64GiB") from exc
    if n < 0:
        raise ConfigError("adapter_params.capacity_bytes", raw, "a size >= 0")
    return n
