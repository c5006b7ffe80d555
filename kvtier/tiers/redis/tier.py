"""The ``redis`` tier: chunks shared across machines through Redis or Redis Cluster.

Each chunk is one Redis value (header + payload, :mod:`kvtier.tiers.redis.wire`) under
``{key_prefix}:{tenant}:{spec fingerprint}:{chunk key hex}``, so tenants and model
geometries never collide and an operator can find one namespace with ``SCAN MATCH``.
With encryption, the master key's id comes before the chunk key
(``...:{spec fingerprint}:k{key id}:{chunk key hex}``, :attr:`kvtier.crypto.Cipher.key_id`).

The tier keeps the core's slot contract: its allocator is a *logical* bound on how many
chunks this process indexes in Redis, and values are addressed by chunk key, not by
slot. Redis is shared, so the tier is a :class:`~kvtier.tiers.base.SharedTier`: the
store asks :meth:`probe` about chunks its own index lacks (another process may have
stored them) and adopts the ones found. Because the medium is shared, the store evicting
or moving a chunk out of this tier leaves the value in Redis for the others; Redis' own
``maxmemory`` policy and the optional TTL reclaim it. Only :meth:`discard` (the store's
``delete``) removes values.

Failures never wait past a budget and never serve wrong bytes: a down, restarting or
slow node makes its chunks misses (:mod:`kvtier.tiers.redis.nodes`), and a value whose
header, checksum or tag fails is a miss and is deleted.

Deleting a value that fails is safe only because a value under this tier's names can be
none but its own kind: a daemon sealing under another master key (a peer given the wrong
key file, a rotated key) reads and writes under other names, so it never finds this
tier's values, never counts them corrupt and never deletes them, nor they its. Were the
names shared, a peer with the wrong key would see every value fail its tag and delete
the whole shared cache. Under one key id, a value that fails is altered bytes (or a value
in clear or of another key someone copied there): deleting it lets the next put heal it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

from kvtier import codec as kvcodec
from kvtier.crypto import cipher_of
from kvtier.errors import CorruptChunkError, TierIOError
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.base import (
    SharedTier,
    SlotRun,
    TierFaults,
    TierGeometry,
    TierProfile,
    TierSection,
)
from kvtier.tiers.economics import REDIS_10GBE_MANAGED
from kvtier.tiers.redis import reader, wire
from kvtier.tiers.redis.nodes import NodeHealth, Nodes, Op
from kvtier.tiers.redis.options import Options

log = logging.getLogger(__name__)


# How much longer than a chunk a GET reply may be and still be read (a header, a seal,
# and room to spare): a longer one is a damaged reply, dropped with its connection.
MAX_REPLY_SLACK = 1 << 20


class _R(enum.Enum):
    """Outcome of one item of a batch."""

    OK = "ok"
    ABSENT = "absent"
    CORRUPT = "corrupt"
    FAILED = "failed"


# The table's entry (kvtier/tiers/economics.py), so placement and `kvtier calc` agree.
REDIS_PROFILE = REDIS_10GBE_MANAGED.to_tier_profile()


class RedisTier(SharedTier):
    """Chunks in Redis, one value each; shared by every process that uses the same Redis.

    Thread-safety: every method may be called from any thread; per-node parts of a batch
    run on the tier's own small pool.

    Args:
        geometry: see :class:`Tier`;
            ``capacity_bytes`` bounds what this process indexes, not Redis' memory.
        options: connection, budget and batching settings.
        namespace: the chunk keys' namespace (tenant, KV spec); also set by :meth:`bind`.
    """

    kind = "redis"

    def __init__(
        self,
        geometry: TierGeometry,
        options: Options | None = None,
        profile: TierProfile | None = None,
        namespace: Namespace | None = None,
    ) -> None:
        profile = profile or REDIS_PROFILE
        super().__init__(geometry, profile)
        self.options = opts = options or Options()
        self._nodes = Nodes(opts)
        self._px = int(opts.ttl_s * 1000) if opts.ttl_s > 0 else None
        self._compress = opts.codec == "lz4-shuffle"
        if self._compress:
            kvcodec.require(self.name)
        self._cipher = cipher_of(opts.encryption_key_file, f"tiers.{self.name}")
        self._closed = False
        # Values read off the socket into a reused buffer (.reader), unless redis-py's
        # connections expose no socket; then through redis-py's pipeline.
        self._raw_reads = reader.supported()
        self.bind(namespace or Namespace("", "unbound", 0))

    # -- namespace -----------------------------------------------------------------------

    @override
    def bind(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._ns = wire.namespace_id(namespace.tenant, namespace.spec_fingerprint)
        prefix = f"{self.options.key_prefix}:{namespace.tenant}:{namespace.spec_fingerprint}:"
        if self._cipher is not None:
            prefix += f"k{self._cipher.key_id}:"
        self._prefix = prefix.encode()

    def redis_key(self, key: ChunkKey) -> bytes:
        """The Redis key that holds ``key``'s value (for operators and tests)."""
        return self._prefix + key.hex().encode()

    def health(self) -> tuple[NodeHealth, ...]:
        """Each node's breaker state, for stats pages and tests."""
        return self._nodes.health()

    @override
    def faults(self) -> TierFaults:
        """Down while any node's breaker is open (it timed out or refused: a hung Redis)."""
        down = [h for h in self._nodes.health() if not h.up]
        if not down:
            return TierFaults()
        reason = "; ".join(f"{h.node}: {h.last_error}" for h in down[:3])
        return TierFaults(up=False, down_reason=reason)

    # -- the shared-medium hooks ---------------------------------------------------------

    @override
    def probe(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Value lengths of the leading ``keys`` stored in Redis, by reading headers only.

        One pipelined ``GETRANGE key 0 31`` per node. A value with a bad header ends the
        run and is deleted. Never raises; waits at most ``op_budget_s``.
        """
        if not keys or self._closed:
            return ()
        names = [self.redis_key(k) for k in keys]

        def work(client: Any, idx: list[int], op: Op) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for i in idx:
                pipe.getrange(names[i], 0, wire.HEADER_BYTES - 1)
            out: list[Any] = pipe.execute(raise_on_error=False)
            return out

        heads = self._nodes.execute(names, work, Op(self.options.op_budget_s), None)
        lengths: list[int] = []
        for name, head in zip(names, heads, strict=True):
            if not isinstance(head, bytes) or not head:
                if isinstance(head, Exception):
                    self._nodes.note_response_error(head)
                break
            try:
                h = wire.parse_header(head, self._ns)
            except CorruptChunkError as exc:
                log.warning("redis tier %s: dropping %r: %s", self.name, name, exc)
                self._delete([name])
                break
            if not 0 < h.raw_len <= self.slot_bytes:
                break
            lengths.append(h.raw_len)
        return tuple(lengths)

    @override
    def discard(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the values of ``keys`` from Redis; returns how many existed."""
        if not keys or self._closed:
            return 0
        return self._delete([self.redis_key(k) for k in keys])

    def _delete(self, names: list[bytes]) -> int:
        def work(client: Any, idx: list[int], op: Op) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for i in idx:
                pipe.delete(names[i])
            out: list[Any] = pipe.execute(raise_on_error=False)
            return out

        res = self._nodes.execute(names, work, Op(self.options.op_budget_s), 0)
        return sum(r for r in res if isinstance(r, int))

    # -- data movement -------------------------------------------------------------------

    def _pipelined(
        self,
        names: list[bytes],
        item_bytes: int,
        budget_s: float,
        step: Callable[[Any, list[int], Op], list[_R]],
    ) -> list[_R]:
        """Run ``step`` (node client, batch, op) on batches of at most ``batch_bytes`` of
        each node's chunks; chunks of a node that is down, fails or runs past
        ``budget_s`` are FAILED."""

        def work(client: Any, idx: list[int], op: Op) -> list[_R]:
            out: list[_R] = []
            for batch in _batches(idx, item_bytes, self.options.batch_bytes):
                op.check()
                out.extend(step(client, batch, op))
            return out

        return self._nodes.execute(names, work, Op(budget_s), _R.FAILED)

    def _failed(self, exc: Exception, reasons: list[str]) -> _R:
        reasons.append(f"{type(exc).__name__}: {exc}")
        self._nodes.note_response_error(exc)
        return _R.FAILED

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        names = [self.redis_key(k) for k in run.keys]
        vb = run.value_bytes
        reasons: list[str] = []

        def step(client: Any, batch: list[int], op: Op) -> list[_R]:
            pipe = client.pipeline(transaction=False)
            with op.guard():  # encode copies from src: never after the caller gave up
                for i in batch:
                    value = wire.encode(
                        run.keys[i],
                        src[i * vb : (i + 1) * vb],
                        self._ns,
                        compress=self._compress,
                        width=self.options.codec_element_bytes,
                        cipher=self._cipher,
                    )
                    pipe.set(names[i], value, px=self._px)
            results = pipe.execute(raise_on_error=False)
            del pipe  # the encoded values go before the next batch is encoded
            return [
                self._failed(r, reasons) if isinstance(r, Exception) else _R.OK for r in results
            ]

        item = vb + wire.HEADER_BYTES
        res = self._pipelined(names, item, self.options.write_budget_s, step)
        bad = sum(r is not _R.OK for r in res)
        if bad:
            why = reasons[0] if reasons else "node down, failing or over budget"
            raise TierIOError(f"redis tier {self.name}: {bad} of {run.n} values not stored ({why})")

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        names = [self.redis_key(k) for k in run.keys]
        vb = run.value_bytes
        px = self._px
        reasons: list[str] = []

        def step(client: Any, batch: list[int], op: Op) -> list[_R]:
            # GETEX slides the TTL on a hit: hot chunks stay, cold ones expire.
            if not self._raw_reads:
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    if px is None:
                        pipe.get(names[i])
                    else:
                        pipe.getex(names[i], px=px)
                values = pipe.execute(raise_on_error=False)
                with op.guard():  # dst is the caller's: never touched after it gave up
                    return [
                        self._decode(run.keys[i], v, dst[i * vb : (i + 1) * vb], reasons)
                        for i, v in zip(batch, values, strict=True)
                    ]
            out: list[_R] = []
            replies = reader.get_values(
                client.connection_pool, [names[i] for i in batch], px, MAX_REPLY_SLACK + vb
            )
            try:
                for i, v in zip(batch, replies, strict=True):
                    # Verified and copied from this thread's buffer into dst, which is
                    # the caller's: never touched after it gave up.
                    with op.guard():
                        out.append(
                            self._decode(run.keys[i], v, dst[i * vb : (i + 1) * vb], reasons)
                        )
            finally:
                replies.close()  # early (a cancel): the connection is dropped
            return out

        res = self._pipelined(names, vb + wire.HEADER_BYTES, self.options.op_budget_s, step)
        corrupt = [n for n, r in zip(names, res, strict=True) if r is _R.CORRUPT]
        if corrupt:
            # A bad value would fail every reader: remove it so the next put heals it.
            self._delete(corrupt)
            raise CorruptChunkError(
                f"redis tier {self.name}: {len(corrupt)} of {run.n} values failed verification "
                f"and were deleted ({reasons[0] if reasons else 'bad value'})"
            )
        absent = sum(r is _R.ABSENT for r in res)
        failed = sum(r is _R.FAILED for r in res)
        if absent or failed:
            raise TierIOError(
                f"redis tier {self.name}: {absent} of {run.n} values gone (evicted or expired), "
                f"{failed} unreachable or over budget" + (f" ({reasons[0]})" if reasons else "")
            )

    def _decode(self, key: ChunkKey, value: Any, dst: memoryview, reasons: list[str]) -> _R:
        if value is None:
            return _R.ABSENT
        if isinstance(value, Exception):
            return self._failed(value, reasons)
        try:
            wire.decode_into(key, value, self._ns, dst, self._cipher)
        except CorruptChunkError as exc:
            reasons.append(str(exc))
            return _R.CORRUPT
        return _R.OK

    @override
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._nodes.close()


def _batches(idx: list[int], item_bytes: int, batch_bytes: int) -> list[list[int]]:
    """Split indices into batches of at most ``batch_bytes`` (at least one item each)."""
    per = max(1, batch_bytes // item_bytes)
    return [idx[i : i + per] for i in range(0, len(idx), per)]


def create(section: TierSection, geometry: TierGeometry) -> RedisTier:
    return RedisTier(geometry, section.options)
