"""Connections of the ``redis`` tier: one Redis server, or the masters of a Redis Cluster.

A batch operation is split by node (in a cluster: by the hash slot of each key, so a
sequence's chunks spread over every master) and the per-node parts run in parallel on a
small thread pool, each as pipelined round trips bounded in bytes. The caller waits at
most its budget: parts that are late become failures, and a late part can no longer
touch the caller's buffers (:class:`Op` fences them).

Each node has a circuit breaker. A node that fails (refused, reset, timed out, loading
its dataset after a restart) is skipped, so its keys are misses at once, until a backoff
that doubles from ``backoff_min_s`` to ``backoff_max_s``; the next call after it tries
again. The reason is logged at the transition, then at most once a minute. redis-py's own
retries are off: they would wait past the budget.

Values go out without a copy: :class:`FramedPacker` writes a :class:`~.wire.Framed` value's
header and the caller's payload as one RESP bulk string, so ``sendall`` reads the payload
straight from the caller's buffer. (redis-py's hiredis packer copies every value twice;
its Python packer copies none but cannot frame a header.) Replies are parsed by hiredis
when it is installed, redis-py's Python parser otherwise.

redis-py is imported here, lazily: only a configured ``redis`` tier loads it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from kvtier.errors import ConfigError, PluginError
from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.wire import Framed

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

T = TypeVar("T")

_RELOG_S = 60.0  # a node that stays down is logged again at most this often


class Cancelled(Exception):
    """The caller gave up on this operation (its budget ran out)."""


class Op:
    """One tier call's deadline, and the fence that keeps late workers off its buffers.

    Workers touch the caller's buffers only inside :meth:`guard`; once the caller has
    called :meth:`cancel` (which waits for a guard in progress), no worker touches them.
    """

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self._lock = threading.Lock()
        self._cancelled = False

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise :class:`Cancelled` when the caller is gone or the budget is spent."""
        if self._cancelled or time.monotonic() > self.deadline:
            raise Cancelled("operation budget exceeded")

    def guard(self) -> _Guard:
        return _Guard(self)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True


class _Guard:
    def __init__(self, op: Op) -> None:
        self.op = op

    def __enter__(self) -> None:
        self.op._lock.acquire()
        if self.op._cancelled:
            self.op._lock.release()
            raise Cancelled("operation cancelled")

    def __exit__(self, *exc: object) -> None:
        self.op._lock.release()


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """What the tier knows about one Redis node.

    Attributes:
        node: ``host:port``.
        up: False while the breaker is open (calls skip the node).
        failures: consecutive failed calls (0 when up).
        last_error: the last failure's reason, empty if none yet.
    """

    node: str
    up: bool
    failures: int
    last_error: str


class _Breaker:
    """Consecutive failures of one node and when to try it again. Guarded by its lock."""

    def __init__(self, name: str, backoff_min_s: float, backoff_max_s: float) -> None:
        self.name = name
        self.lo = backoff_min_s
        self.hi = backoff_max_s
        self.failures = 0
        self.down_until = 0.0
        self.last_error = ""
        self.last_log = -_RELOG_S
        self.lock = threading.Lock()

    def available(self) -> bool:
        with self.lock:
            return time.monotonic() >= self.down_until

    def failed(self, reason: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.failures += 1
            backoff = min(self.hi, self.lo * 2 ** min(self.failures - 1, 30))
            # Jitter keeps many engines from reconnecting to a restarted Redis in lockstep.
            self.down_until = now + backoff * random.uniform(0.5, 1.0)
            self.last_error = reason
            first = self.failures == 1
            due = first or now - self.last_log >= _RELOG_S
            if due:
                self.last_log = now
            n = self.failures
        if due:
            log.warning(
                "redis node %s unavailable (%s): its chunks are misses; retry in up to %.2f s "
                "(%d consecutive failures)",
                self.name,
                reason,
                backoff,
                n,
            )

    def succeeded(self) -> None:
        with self.lock:
            n = self.failures
            self.failures = 0
            self.down_until = 0.0
        if n:
            log.warning("redis node %s reachable again after %d failed calls", self.name, n)

    def health(self) -> NodeHealth:
        with self.lock:
            return NodeHealth(
                self.name, time.monotonic() >= self.down_until, self.failures, self.last_error
            )


_CRLF = b"\r\n"
_CUTOFF = 6000  # redis-py's: smaller arguments are joined into one buffer


def _encode_arg(arg: object) -> bytes | memoryview:
    if isinstance(arg, bytes | memoryview):
        return arg
    if isinstance(arg, bytearray):
        return bytes(arg)
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return repr(arg).encode()
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


class FramedPacker:
    """redis-py command packer (``Connection(command_packer=...)``) that frames values.

    Packs RESP like redis-py's Python packer: small arguments joined, large ones and
    memoryviews as separate pieces (sent by ``sendall`` without a copy). A
    :class:`~.wire.Framed` argument becomes one bulk string: its header joined to the
    length prefix, then the payload view. Stateless, so one instance serves every
    connection.
    """

    def pack(self, *args: object) -> list[bytes | memoryview]:
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for raw in args:
            if isinstance(raw, Framed):
                out.append(b"".join((buff, b"$%d\r\n" % len(raw), raw.header)))
                out.append(raw.payload)
                buff = _CRLF
                continue
            arg = _encode_arg(raw)
            n = len(arg) if isinstance(arg, bytes) else arg.nbytes
            if len(buff) > _CUTOFF or n > _CUTOFF or isinstance(arg, memoryview):
                out.append(b"".join((buff, b"$%d\r\n" % n)))
                out.append(arg)
                buff = _CRLF
            else:
                buff = b"".join((buff, b"$%d\r\n" % n, arg, _CRLF))
        out.append(buff)
        return out


NodeWork = Callable[["redis.Redis", list[int], Op], list[T]]
"""Runs one node's part of a batch: (client, item indices, op) -> one result per index."""


class Nodes:
    """The Redis servers behind one tier, and parallel per-node execution.

    Args:
        opts: the tier's options; the pool reads ``url`` or ``cluster_nodes``, the
            connect and socket timeouts, the breaker's backoff, ``fanout_threads`` and
            ``streams_per_node``.
    """

    def __init__(self, opts: Options) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise PluginError(
                f"the redis tier needs redis-py: pip install 'kvtier[redis]' ({exc})"
            ) from exc
        self._redis = redis
        self._kwargs: dict[str, Any] = {
            "socket_timeout": opts.socket_timeout_s,
            "socket_connect_timeout": opts.connect_timeout_s,
            # Retries would wait past the op budget; the breaker does the backing off.
            "retry": Retry(NoBackoff(), 0),
        }
        self._packer = FramedPacker()
        self._clients: dict[str, Any] = {}  # cluster mode: node name -> our own client
        self._lo, self._hi = opts.backoff_min_s, opts.backoff_max_s
        self._streams = opts.streams_per_node
        self._cluster_seeds = [_host_port(s, "cluster_nodes") for s in opts.cluster_nodes]
        self._single: redis.Redis | None = None
        self._cluster: Any = None  # redis.RedisCluster, built lazily (the cluster may be down)
        self._cluster_breaker = _Breaker("cluster-seeds", self._lo, self._hi)
        self._refreshing = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(opts.fanout_threads, thread_name_prefix="kvtier-redis")
        url = opts.url
        if not self._cluster_seeds:
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise ConfigError("url", url, "a redis://host:port/db URL")
            try:
                pool = redis.ConnectionPool.from_url(
                    url, command_packer=self._packer, **self._kwargs
                )
                self._single = redis.Redis(connection_pool=pool)
            except ValueError as exc:
                raise ConfigError("url", url, f"a redis://host:port/db URL ({exc})") from exc
            kw = self._single.connection_pool.connection_kwargs
            self._single_name = (
                f"{kw.get('host')}:{kw.get('port')}" if "host" in kw else str(kw.get("path"))
            )

    @property
    def is_cluster(self) -> bool:
        return bool(self._cluster_seeds)

    def breaker(self, name: str) -> _Breaker:
        with self._lock:
            b = self._breakers.get(name)
            if b is None:
                b = self._breakers[name] = _Breaker(name, self._lo, self._hi)
            return b

    def health(self) -> tuple[NodeHealth, ...]:
        with self._lock:
            breakers = list(self._breakers.values())
        return tuple(sorted((b.health() for b in breakers), key=lambda h: h.node))

    # -- routing -----------------------------------------------------------------------

    def _cluster_client(self) -> Any:
        """The cluster client, built on first use; None while no seed answers."""
        if self._cluster is not None:
            return self._cluster
        if not self._cluster_breaker.available():
            return None
        with self._refreshing:
            if self._cluster is None:
                from redis.cluster import ClusterNode, RedisCluster
                from redis.exceptions import RedisClusterException

                try:
                    self._cluster = RedisCluster(
                        startup_nodes=[
                            ClusterNode(h, p)  # type: ignore[no-untyped-call]
                            for h, p in self._cluster_seeds
                        ],
                        # Serve the slots of live masters while another is down.
                        require_full_coverage=False,
                        **self._kwargs,
                    )
                except (self._redis.RedisError, RedisClusterException, OSError) as exc:
                    self._cluster_breaker.failed(f"no cluster seed answers: {exc}")
                    return None
                self._cluster_breaker.succeeded()
        return self._cluster

    def route(self, names: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        """Group item indices by node: {name: (client, indices)}; unroutable ones left out."""
        if self._single is not None:
            return {self._single_name: (self._single, list(range(len(names))))}
        rc = self._cluster_client()
        if rc is None:
            return {}
        groups: dict[str, tuple[Any, list[int]]] = {}
        by_slot: dict[int, tuple[str, Any]] = {}
        for i, name in enumerate(names):
            slot = rc.keyslot(name)
            hit = by_slot.get(slot)
            if hit is None:
                try:
                    node = rc.nodes_manager.get_node_from_slot(slot)
                except self._redis.exceptions.SlotNotCoveredError:
                    self.refresh_topology()
                    continue
                client = self._node_client(node.name, node.host, node.port)
                hit = by_slot[slot] = (node.name, client)
            groups.setdefault(hit[0], (hit[1], []))[1].append(i)
        return groups

    def _node_client(self, name: str, host: str, port: int) -> Any:
        """Our own client of one cluster node: the cluster's clients cannot take our packer."""
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                pool = self._redis.ConnectionPool(
                    host=host, port=port, command_packer=self._packer, **self._kwargs
                )
                client = self._clients[name] = self._redis.Redis(connection_pool=pool)
            return client

    def refresh_topology(self) -> None:
        """Re-read the cluster's slot map in the background (after MOVED or a dead master)."""
        rc = self._cluster
        if rc is None or not self._refreshing.acquire(blocking=False):
            return

        def run() -> None:
            try:
                rc.nodes_manager.initialize()
            except Exception as exc:  # any failure here just means "try again later"
                log.debug("redis cluster topology refresh failed: %s", exc)
            finally:
                self._refreshing.release()

        try:
            self._pool.submit(run)
        except RuntimeError:  # pool shut down
            self._refreshing.release()

    # -- execution -----------------------------------------------------------------------

    def execute(self, names: Sequence[bytes], work: NodeWork[T], op: Op, failed: T) -> list[T]:
        """Run ``work`` for each node's items in parallel; wait at most until ``op``'s deadline.

        Items of a node that is down, fails, or is late get ``failed``. Never raises for
        Redis errors. On return, no worker touches buffers guarded by ``op``.
        """
        out: list[T] = [failed] * len(names)
        futures: dict[Future[list[T] | None], tuple[_Breaker, list[int]]] = {}
        for node, (client, idx) in self.route(names).items():
            b = self.breaker(node)
            if not b.available():
                continue
            # Several connections per node overlap one stream's reply parsing and copies
            # with the server sending the next stream's values.
            k = min(self._streams, len(idx))
            step = -(-len(idx) // k)
            for part in (idx[i : i + step] for i in range(0, len(idx), step)):
                futures[self._pool.submit(self._run_node, b, client, part, work, op)] = (b, part)
        if not futures:
            return out
        done, late = wait(futures, timeout=max(0.0, op.remaining_s()))
        op.cancel()  # from here on, late workers cannot touch the caller's buffers
        for fut in done:
            b, idx = futures[fut]
            results = fut.result()
            if results is None:
                continue
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        for fut in late:
            # A part still queued behind our own pool is not the node's fault: drop it
            # without tripping the breaker. One that started and ran late is.
            if not fut.cancel():
                futures[fut][0].failed("operation budget exceeded")
        return out

    def _run_node(
        self, b: _Breaker, client: Any, idx: list[int], work: NodeWork[T], op: Op
    ) -> list[T] | None:
        r = self._redis
        try:
            results = work(client, idx, op)
        except Cancelled:
            return None
        except (r.ConnectionError, r.TimeoutError, OSError) as exc:
            b.failed(f"{type(exc).__name__}: {exc}")
            if self.is_cluster:
                self.refresh_topology()
            return None
        except r.RedisError as exc:  # protocol-level surprises: treat like a failed node
            b.failed(f"{type(exc).__name__}: {exc}")
            return None
        b.succeeded()
        return results

    def note_response_error(self, exc: Exception) -> None:
        """A per-command error came back (MOVED, OOM, ...): refresh topology on redirects."""
        e = self._redis.exceptions
        if isinstance(exc, e.AskError | e.ClusterDownError):
            self.refresh_topology()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._single is not None:
            self._single.close()
        if self._cluster is not None:
            self._cluster.close()
        for client in self._clients.values():
            client.close()


def _host_port(text: str, key: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(key, text, "host:port entries")
    return host, int(port)
