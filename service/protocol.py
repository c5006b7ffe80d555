"""The client's logic, without I/O: what to send, how to read the answer, when to retry.

Both clients (:class:`~kvtier.service.client.Client` and
:class:`~kvtier.service.client.AsyncClient`) drive the same operations, so the two never
drift apart (STYLE.md, rule 9). An operation is a generator: it yields a :class:`Call`,
receives the :class:`Reply`, and may yield more calls (a batch split under the
daemon's limits, a truncated batch get continued) before it returns its result::

    def lookup(keys):
        reply = yield Call("POST", "/v1/lookup", json={"keys": [...]})
        return LookupResult(...)

A driver only sends calls, retries them per :class:`RetryPolicy`, and feeds streamed
bodies to a :class:`BatchSink`.

Errors (the daemon's JSON error ``code`` is kept in the message)::

    TransportError   could not connect, timed out, a 5xx after retries, a bad answer
    └── AuthError    401/403: a missing or refused token; retrying does not help
    InputError       400/413/422: the daemon refused the request as malformed or too large
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvtier.errors import AuthError, InputError, TransportError
from kvtier.keys import KEY_BYTES, ChunkKey
from kvtier.store.types import LookupResult, PutResult

from . import wire
from .routes import table as routes

T = TypeVar("T")

KeyLike = ChunkKey | bytes | str
"""A key as 16 raw bytes or 32 hex digits."""

_HEX = re.compile(r"[0-9a-fA-F]{32}")
RETRY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Fetched:
    """What a batch get copied into the caller's buffer.

    Attributes:
        chunks: leading keys whose values were copied (a prefix of the keys asked for).
        nbytes: bytes written, packed from the start of the buffer.
        value_bytes: the length of each copied value, in key order.
    """

    chunks: int
    nbytes: int
    value_bytes: tuple[int, ...]


@dataclass(slots=True)
class BatchSink:
    """Parses a streamed batch-get body, copying values straight into a caller buffer.

    Values that do not fit whole into the rest of the buffer are not counted (the run
    stops there). Sans-IO: :meth:`feed` takes the body's pieces as they arrive.

    Args:
        dst: the caller's writable byte view.
        pos: where in ``dst`` the first value lands.
    """

    dst: memoryview
    pos: int = 0
    count: int = 0
    truncated: bool = False
    _start: int = -1
    _head: bytearray = field(default_factory=bytearray)
    _lengths: list[int] = field(default_factory=list)
    _need: int = 0
    _got: int = 0
    _parsed: bool = False

    def reset(self) -> None:
        """Forget a partial body (before a retry)."""
        if self._start < 0:
            self._start = self.pos
        self.pos = self._start
        self._head.clear()
        self._lengths.clear()
        self._need = self._got = self.count = 0
        self._parsed = self.truncated = False

    def feed(self, data: bytes) -> None:
        if self._start < 0:
            self._start = self.pos
        if self._parsed:
            self._write(memoryview(data))
            return
        self._head += data
        if len(self._head) < wire.HEADER_BYTES:
            return
        magic, version, _flags, count, payload_offset = wire.HEADER.unpack_from(self._head, 0)
        if (
            magic != wire.MAGIC
            or version != wire.VERSION
            or payload_offset < wire.table_bytes(count)
        ):
            raise TransportError("the daemon sent a batch body with a bad header")
        if len(self._head) < payload_offset:
            return
        table = np.frombuffer(
            self._head, dtype=wire.TABLE_DTYPE, count=count, offset=wire.HEADER_BYTES
        )
        lengths = table["length"].astype(np.int64)
        packed = np.zeros(count, np.int64)
        np.cumsum(lengths[:-1], out=packed[1:])
        if (lengths < 1).any() or (table["offset"].astype(np.int64) != packed).any():
            raise TransportError("the daemon sent a batch table that is not packed")
        room = self.dst.nbytes - self.pos
        for n in lengths.tolist():
            if n > room:
                break
            self._lengths.append(n)
            room -= n
        self.count = len(self._lengths)
        self.truncated = bool(_flags & wire.FLAG_TRUNCATED)
        self._need = sum(self._lengths)
        self._parsed = True
        self._write(memoryview(self._head)[payload_offset:])

    def window(self, nbytes: int) -> memoryview | None:
        """Where the next up to ``nbytes`` payload bytes go in ``dst``, to be received in
        place (then :meth:`wrote`); None before the table is parsed or once every kept
        value is in."""
        if not self._parsed:
            return None
        take = min(nbytes, self._need - self._got)
        return self.dst[self.pos : self.pos + take] if take > 0 else None

    def wrote(self, nbytes: int) -> None:
        self.pos += nbytes
        self._got += nbytes

    def _write(self, data: memoryview) -> None:
        take = min(data.nbytes, self._need - self._got)
        if take > 0:
            self.dst[self.pos : self.pos + take] = data[:take]
            self.pos += take
            self._got += take

    def result(self) -> tuple[int, tuple[int, ...], bool]:
        """(values copied, their lengths, TRUNCATED flag)."""
        if not self._parsed:
            raise TransportError("the daemon sent a batch body shorter than its header")
        if self._got < self._need:
            raise TransportError(
                f"the batch body ended after {self._got} of {self._need} payload bytes"
            )
        return self.count, tuple(self._lengths), self.truncated


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request an operation wants sent.

    Attributes:
        method, path: the request line (path relative to the daemon's base URL).
        json: a JSON body, or None.
        content: a binary body (or its pieces, sent back to back without joining), or None.
        sink: stream a 200 body into this sink instead of buffering it.
        idempotent: safe to send again after a failure whose outcome is unknown.
            Every v1 call is: keys are write-once, so a replayed put finds them present.
    """

    method: str
    path: str
    json: Any = None
    content: bytes | bytearray | memoryview | list[bytes | memoryview] | None = None
    sink: BatchSink | None = None
    idempotent: bool = True


@dataclass(frozen=True, slots=True)
class Reply:
    """The daemon's answer to one :class:`Call` (``body`` is empty when streamed)."""

    status: int
    body: bytes
    json: Any = None


Op = Generator[Call, Reply, T]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of idempotent calls: exponential backoff with full jitter.

    Attributes:
        retries: extra attempts after the first (0 disables retries).
        backoff_s: the first delay's upper bound; doubles per attempt.
        max_backoff_s: the cap on one delay.
    """

    retries: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def delays(self) -> Iterator[float]:
        for attempt in range(self.retries):
            yield random.uniform(0, min(self.max_backoff_s, self.backoff_s * (2**attempt)))


def hex_key(key: KeyLike) -> str:
    """A key's 32-hex-digit form. Raises InputError for anything else."""
    if isinstance(key, str):
        if not _HEX.fullmatch(key):
            raise InputError(f"key {key[:40]!r} is not 32 hex digits")
        return key.lower()
    if len(key) != KEY_BYTES:
        raise InputError(f"a key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return bytes(key).hex()


def raw_key(key: KeyLike) -> ChunkKey:
    """A key's 16 bytes. Raises InputError as :func:`hex_key` does."""
    if type(key) is bytes and len(key) == KEY_BYTES:
        return ChunkKey(key)  # the common case, without the round trip through hex
    return ChunkKey(bytes.fromhex(hex_key(key)))


def check(reply: Reply, *, allow: tuple[int, ...] = ()) -> None:
    """Map a non-2xx status to kvtier's error tree (``allow`` lists accepted statuses)."""
    if 200 <= reply.status < 300 or reply.status in allow:
        return
    code, message = "", reply.body[:200].decode("utf-8", "replace")
    if isinstance(reply.json, dict):
        code = str(reply.json.get("code", ""))
        message = str(reply.json.get("message", message))
    text = f"daemon answered {reply.status} {code}: {message}"
    if reply.status in (401, 403):
        raise AuthError(text)
    if reply.status in (400, 413, 422):
        raise InputError(text)
    raise TransportError(text)


def _put_result(reply: Reply) -> PutResult:
    check(reply)
    j = reply.json
    try:
        return PutResult(int(j["stored"]), int(j["present"]), int(j["rejected"]), int(j["failed"]))
    except (TypeError, KeyError, ValueError) as exc:
        raise TransportError(f"unexpected put answer {j!r}") from exc


def _groups(n: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)


def call(route: routes.Route, key: str = "", **kw: Any) -> Call:
    """A call of one route of the daemon's table (``key``: for a chunk route)."""
    return Call(route.method, route.path(key), **kw)


# -- operations -----------------------------------------------------------------------------


def op_put(key: KeyLike, value: bytes | bytearray | memoryview) -> Op[PutResult]:
    if memoryview(value).nbytes == 0:
        raise InputError("empty values cannot be stored")
    reply = yield call(routes.PUT_CHUNK, hex_key(key), content=value)
    return _put_result(reply)


def op_get(key: KeyLike) -> Op[bytes | None]:
    reply = yield call(routes.GET_CHUNK, hex_key(key))
    if reply.status == 404:
        return None
    check(reply)
    return reply.body


def op_exists(key: KeyLike) -> Op[bool]:
    reply = yield call(routes.HEAD_CHUNK, hex_key(key))
    check(reply, allow=(404,))
    return reply.status == 200


def op_delete(key: KeyLike) -> Op[bool]:
    reply = yield call(routes.DELETE_CHUNK, hex_key(key))
    check(reply)
    return bool(reply.json and reply.json.get("deleted"))


def op_lookup(keys: Sequence[KeyLike], batch_keys: int) -> Op[LookupResult]:
    hexes = [hex_key(k) for k in keys]
    tiers: list[str] = []
    for lo, hi in _groups(len(hexes), batch_keys):
        reply = yield call(routes.LOOKUP, json={"keys": hexes[lo:hi]})
        check(reply)
        got = [str(t) for t in reply.json["tiers"]]
        tiers.extend(got)
        if len(got) < hi - lo:
            break
    return LookupResult(len(tiers), tuple(tiers))


def op_put_many(
    keys: Sequence[KeyLike],
    values: Sequence[bytes | bytearray | memoryview],
    batch_keys: int,
    max_body_bytes: int,
    prefix: Sequence[KeyLike] = (),
    max_prefix_keys: int = 0,
) -> Op[PutResult]:
    """Put in as few bodies as the limits allow. With ``max_prefix_keys`` (the daemon
    takes prefixes), each body names the sequence's chunks before it: ``prefix``, then
    the call's own earlier bodies, the head first when they are too many."""
    if len(keys) != len(values):
        raise InputError(f"{len(keys)} keys but {len(values)} values")
    raws = [raw_key(k) for k in keys]
    before = [raw_key(k) for k in prefix][:max_prefix_keys]
    sizes = [memoryview(v).nbytes for v in values]
    totals = [0, 0, 0, 0]
    lo = 0
    while lo < len(raws):
        # Fill one body up to the key and byte limits (at least one value per body).
        hi, nbytes = lo, wire.HEADER_BYTES
        while hi < len(raws) and hi - lo < batch_keys:
            more = wire.ENTRY_BYTES + sizes[hi]
            if hi > lo and nbytes + more > max_body_bytes:
                break
            nbytes += more
            hi += 1
        pre = [*before, *raws[: max(0, min(lo, max_prefix_keys - len(before)))]]
        head = wire.pack_head(raws[lo:hi], sizes[lo:hi], pre)
        parts: list[bytes | memoryview] = [head]
        parts += (memoryview(v).cast("B") for v in values[lo:hi])
        res = _put_result((yield call(routes.BATCH_PUT, content=parts)))
        for i, v in enumerate((res.stored, res.present, res.rejected, res.failed)):
            totals[i] += v
        lo = hi
    return PutResult(*totals)


def op_get_into(keys: Sequence[KeyLike], dst: memoryview, batch_keys: int) -> Op[Fetched]:
    hexes = [hex_key(k) for k in keys]
    lengths: list[int] = []
    sink = BatchSink(dst)
    done = 0
    while done < len(hexes):
        want = hexes[done : done + batch_keys]
        reply = yield call(routes.BATCH_GET, json={"keys": want}, sink=sink)
        check(reply)
        count, lens, truncated = sink.result()
        lengths.extend(lens)
        done += count
        # A short answer means a miss (stop), unless the daemon truncated at its size limit.
        if count < len(want) and not (truncated and count > 0):
            break
        sink = BatchSink(dst, pos=sink.pos)
    return Fetched(len(lengths), sum(lengths), tuple(lengths))


def op_get_many(keys: Sequence[KeyLike], batch_keys: int) -> Op[list[bytes]]:
    hexes = [hex_key(k) for k in keys]
    out: list[bytes] = []
    while len(out) < len(hexes):
        want = hexes[len(out) : len(out) + batch_keys]
        reply = yield call(routes.BATCH_GET, json={"keys": want})
        check(reply)
        try:
            batch = wire.parse(reply.body, max_count=len(want), max_value_bytes=1 << 62)
        except InputError as exc:
            raise TransportError(f"the daemon sent a bad batch body: {exc}") from exc
        out.extend(bytes(batch.value(i)) for i in range(len(batch.keys)))
        if not (len(batch.keys) == len(want) or (batch.truncated and batch.keys)):
            break
    return out


def op_stats() -> Op[dict[str, Any]]:
    reply = yield call(routes.STATS)
    check(reply)
    stats: dict[str, Any] = reply.json
    return stats


def op_ready() -> Op[bool]:
    reply = yield call(routes.READYZ)
    return reply.status == 200
