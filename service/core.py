"""The daemon's request core: what every front end does with a request, without I/O.

A front end reads bytes and writes answers; the core decides. Three front ends call it:

* the FastAPI app (:mod:`kvtier.service.app`): the gate (:mod:`.guards`) admits every
  request's head here, and the routes of one chunk answer through :meth:`RequestCore.get`,
  :meth:`~RequestCore.put`, :meth:`~RequestCore.exists` and :meth:`~RequestCore.delete`;
* the data-plane front end (:mod:`.dataplane`), which answers one-chunk GETs and PUTs in
  the HTTP protocol: the same admission, then :meth:`RequestCore.get_now` and
  :meth:`RequestCore.start_put`, and the same request metrics (:meth:`RequestCore.observe`);
* the same-host channel (:mod:`.shm`): the same token check (:meth:`RequestCore.tenant`),
  and its lookups, puts and gets through :meth:`RequestCore.lookup_now`,
  :meth:`~RequestCore.put_now` and :meth:`~RequestCore.get_into_now`, counted as the
  HTTP batch routes' are.

So a request is authenticated, bounded, mapped into its tenant's key space, counted and
answered the same way, with the same bytes, whichever front end serves it. Routes come
from one table (:mod:`.routes.table`); errors become answers in one place
(:func:`kvtier.service.errors.reply_for`).

Threads: the event loop's, but for :meth:`RequestCore.tenant` and the ``*_now`` methods of
many keys, which the same-host channel's threads call (the store, the authenticator and
the counters are thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier.errors import InputError
from kvtier.keys import ChunkKey
from kvtier.store.handles import HeldValue, Reservation
from kvtier.store.types import GetResult, LookupResult, PutResult

from . import wire
from .daemon import INLINE_GET_BYTES, Daemon
from .errors import ApiError, ErrorReply, reply_for
from .routes.table import (
    BATCH_PUT,
    CHUNK_TEMPLATE,
    ROUTES,
    BodyLimit,
    Route,
    protected,
    route_of,
)
from .tenants import Tenant

log = logging.getLogger(__name__)

JSON = b"application/json"
OCTET = b"application/octet-stream"
# One key in a JSON list: 32 hex digits, quotes, a comma and a little whitespace.
_JSON_BYTES_PER_KEY = 40
_JSON_SLACK_BYTES = 4096


class _NotNow(Enum):
    NOT_NOW = "not now"


NotNow = Literal[_NotNow.NOT_NOW]
NOT_NOW: Final = _NotNow.NOT_NOW
"""What :meth:`RequestCore.get_now` answers when the get needs I/O (or a shared tier)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer's status, body and headers; every front end sends these bytes as they are.

    ``headers`` are the extra ones (lower-case names); the front end adds the length.
    """

    status: int
    body: bytes | memoryview
    content_type: bytes | None = JSON  # None: no body to describe (a HEAD's answer)
    headers: tuple[tuple[bytes, bytes], ...] = ()


class Head(NamedTuple):
    """What the core reads of a request's headers (names lower-case, as servers give them).

    A named tuple rather than a frozen dataclass: every request builds one, and a tuple is
    built without a ``__setattr__`` call per field.

    Attributes:
        auth: the ``Authorization`` value (the last one, when several were sent).
        auth_headers: how many ``Authorization`` headers were sent.
        length: the declared ``Content-Length``; None when none was declared.
        bad_length: a ``Content-Length`` that is not a number of bytes.
        length_headers: how many ``Content-Length`` headers were sent.
        chunked: a ``Transfer-Encoding`` was sent.
        plain: one token header at most, one well-formed length at most, no chunked
            body: nothing two layers could read differently.
    """

    auth: bytes | None = None
    auth_headers: int = 0
    length: int | None = None
    bad_length: bool = False
    length_headers: int = 0
    chunked: bool = False
    plain: bool = True

    @classmethod
    def read(cls, headers: Iterable[tuple[bytes, bytes]]) -> Head:
        """The one pass over a request's headers that every front end makes."""
        auth: bytes | None = None
        n_auth = n_length = 0
        length: int | None = None
        bad = chunked = False
        for name, value in headers:
            if name == b"authorization":
                auth = value
                n_auth += 1
            elif name == b"content-length":
                n_length += 1
                try:
                    length = int(value)
                except ValueError:
                    length, bad = None, True
                else:
                    bad = bad or length < 0
            elif name == b"transfer-encoding":
                chunked = True
        plain = n_auth <= 1 and n_length <= 1 and not bad and not chunked
        return _new_head(cls, (auth, n_auth, length, bad, n_length, chunked, plain))


_new_head = tuple.__new__


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request head the core lets through.

    Attributes:
        tenant: the caller, for a route that needs a token; None for the open probes.
        limit_bytes: the largest body the route takes.
        setting: the setting that says so (for the 413's message).
    """

    tenant: Tenant | None
    limit_bytes: int
    setting: str


class _Rule:
    """What admission checks of one route, decided when the core is built."""

    __slots__ = ("by_tenant", "limit_bytes", "needs_token", "open", "setting")

    def __init__(self, needs_token: bool, limit_bytes: int, setting: str) -> None:
        self.needs_token = needs_token
        self.limit_bytes = limit_bytes
        self.setting = setting
        self.open = Admitted(None, limit_bytes, setting)
        self.by_tenant: dict[str, Admitted] = {}  # tenant name -> its Admitted


class RequestCore:
    """The request logic of one daemon (see the module docstring). Event-loop only.

    Args:
        d: the daemon's state: store, tenants, limits, budget, counters.
    """

    def __init__(self, d: Daemon) -> None:
        self.d = d
        lim = d.limits
        self._limits = {
            BodyLimit.VALUE: lim.max_value_bytes,
            BodyLimit.BATCH: lim.max_body_bytes,
            BodyLimit.KEYS: min(
                _JSON_SLACK_BYTES + _JSON_BYTES_PER_KEY * lim.max_batch_keys, lim.max_body_bytes
            ),
        }
        # Each route's admission is decided here once, not per request: whether it needs
        # a token, its body limit, and the Admitted answers it gives (one per tenant).
        self._rules = {(r.method, r.template): self._rule(r.protected, r.body) for r in ROUTES}
        self._unrouted = {  # paths the table does not have: the gate answers them
            (needs_token, kind): self._rule(needs_token, kind)
            for needs_token in (False, True)
            for kind in (BodyLimit.BATCH, BodyLimit.KEYS)
        }

    def _rule(self, needs_token: bool, kind: BodyLimit) -> _Rule:
        return _Rule(needs_token, self._limits[kind], kind.value)

    # -- admission ---------------------------------------------------------------------------

    def tenant(self, authorization: bytes | str | None) -> Tenant | None:
        """The tenant an ``Authorization`` value names; None: refused."""
        if isinstance(authorization, str):
            return self.d.auth.authenticate(authorization)
        return self.d.auth.authenticate_header(authorization)

    def body_limit(self, method: str, path: str) -> tuple[int, str]:
        """The largest body a request to ``path`` may send, and the setting that says so."""
        rule = self._rule_of(method, path)
        return rule.limit_bytes, rule.setting

    def _rule_of(self, method: str, path: str) -> _Rule:
        route = route_of(method, path)
        if route is not None:
            return self._rules[route.method, route.template]
        # Any method on the batch put's path has the same bound.
        kind = BodyLimit.BATCH if path == BATCH_PUT.template else BodyLimit.KEYS
        return self._unrouted[protected(path), kind]

    def admit(self, method: str, path: str, head: Head) -> Admitted | ErrorReply:
        """Checks on a request's head, before one body byte is read: one token header at
        most (400), a numeric length (400), a known token where one is needed (401), a
        declared length within the route's limit (413)."""
        return self._admit(self._rule_of(method, path), head)

    def admit_route(self, route: Route, head: Head) -> Admitted | ErrorReply:
        """:meth:`admit` for a request whose route the front end already knows (a path
        that :func:`~kvtier.service.routes.table.route_of` maps to ``route``)."""
        return self._admit(self._rules[route.method, route.template], head)

    def _admit(self, rule: _Rule, head: Head) -> Admitted | ErrorReply:
        auth, auth_headers, length, bad_length, _, _, _ = head
        if auth_headers > 1:
            return ErrorReply(
                400, "duplicate_authorization", "send one Authorization header, not several"
            )
        if bad_length:
            return ErrorReply(400, "bad_length", "Content-Length is not a number")
        tenant = None
        if rule.needs_token:
            tenant = self.d.auth.authenticate_header(auth)
            if tenant is None:
                return unauthorized()
        if length is not None and length > rule.limit_bytes:
            what = f"body of {length} B; the limit is {rule.limit_bytes} B ({rule.setting})"
            return ErrorReply(413, "body_too_large", what)
        if tenant is None:
            return rule.open
        admitted = rule.by_tenant.get(tenant.name)
        if admitted is None:
            admitted = rule.by_tenant[tenant.name] = Admitted(
                tenant, rule.limit_bytes, rule.setting
            )
        return admitted

    # -- one chunk ---------------------------------------------------------------------------

    def get_now(self, t: Tenant, hex_key: str) -> Answer | HeldValue | NotNow:
        """A GET's answer when it needs no I/O: a hit held in place in plain memory (send
        ``view`` and release it), a hit copied here, or a miss with no shared tier to
        ask; :data:`NOT_NOW`, having done nothing, otherwise."""
        key = self.d.key(t, hex_key)
        held = self.d.store.hold_value(key, max_bytes=self.d.limits.max_value_bytes)
        if held is not None:
            try:
                self.d.tenants.add(t.name, get_chunks=1, get_bytes=held.view.nbytes)
            except BaseException:
                held.release()
                raise
            return held
        buf = self.d.values.take(self.d.limits.max_value_bytes)
        res = self.d.store.get_now([key], buf, max_bytes=INLINE_GET_BYTES)
        return NOT_NOW if res is None else self._got(t, hex_key, buf, res)

    async def get(self, t: Tenant, hex_key: str) -> Answer:
        """A GET's answer (200 with the value, or 404)."""
        buf = self.d.values.take(self.d.limits.max_value_bytes)
        # A hit in memory is copied here, on the event loop: cheaper than the round trip
        # through an I/O thread (two wake-ups, the GIL handed over twice).
        key = self.d.key(t, hex_key)
        fut = self.d.store.get([key], buf, inline_memory_bytes=INLINE_GET_BYTES)
        res = fut.result() if fut.done() else await asyncio.wrap_future(fut)
        return self._got(t, hex_key, buf, res)

    def _got(self, t: Tenant, hex_key: str, buf: npt.NDArray[np.uint8], res: GetResult) -> Answer:
        if not res.chunks:
            self.d.tenants.add(t.name, lookup_miss_chunks=1)
            return not_found(hex_key)
        self.d.tenants.add(t.name, get_chunks=1, get_bytes=res.nbytes)
        return Answer(200, buf.data[: res.nbytes], OCTET)

    async def exists(self, t: Tenant, hex_key: str) -> Answer:
        """A HEAD's answer: 200 present, 404 not; no body."""
        hit = (await self.lookup(t, [self.d.key(t, hex_key)])).hits
        return Answer(200 if hit else 404, b"", None)

    async def delete(self, t: Tenant, hex_key: str) -> Answer:
        """A DELETE's answer: whether the key was present."""
        n = await self.d.delete([self.d.key(t, hex_key)])
        return Answer(200, json.dumps({"deleted": n}).encode())

    async def put(self, t: Tenant, hex_key: str, value: bytes | memoryview) -> Answer:
        """A PUT's answer for a value received whole."""
        if not len(value):
            raise ApiError(400, "empty_value", "a value of 0 bytes cannot be stored")
        res: PutResult = await asyncio.wrap_future(
            self.d.store.put([self.d.key(t, hex_key)], value)
        )
        return put_answer(self.counted_put(t, res, len(value)))

    def start_put(self, t: Tenant, hex_key: str, length: int) -> ChunkPut | None:
        """A PUT whose body the front end receives straight into a slot of the store, or
        None, having taken nothing: no room in the in-flight budget now, or no slot to
        fill in place (a present key, a full top tier, a tier behind I/O); then
        :meth:`put` serves it. End it with :meth:`ChunkPut.finish` or :meth:`ChunkPut.abort`.
        """
        if not 0 < length <= self.d.limits.max_value_bytes:
            return None
        if not self.d.budget.take_now(length):
            return None
        res = None
        try:
            res = self.reserve(t, hex_key, length)
        finally:
            if res is None:
                self.d.budget.give(length)
        if res is None:
            return None
        self.d.metrics.in_flight += 1
        return ChunkPut(self, t, res)

    def reserve(self, t: Tenant, hex_key: str, length: int) -> Reservation | None:
        """A slot of the store to receive one value into, or None (see
        :meth:`~kvtier.store.store.TieredStore.reserve`); end it with :meth:`commit`
        or ``abort()``. The caller holds the value's bytes in the budget."""
        return self.d.store.reserve(self.d.key(t, hex_key), length)

    def commit(self, t: Tenant, res: Reservation) -> Answer:
        """A PUT's answer for a value received into ``res``."""
        return put_answer(self.counted_put(t, res.commit(), res.view.nbytes))

    # -- many keys (the batch routes and the same-host channel) ------------------------------

    def counted_lookup(self, t: Tenant, asked: int, res: LookupResult) -> LookupResult:
        """Count a lookup of ``asked`` keys for tenant ``t``; returns ``res``."""
        self.d.tenants.add(t.name, lookup_hit_chunks=res.hits, lookup_miss_chunks=asked - res.hits)
        return res

    async def lookup(self, t: Tenant, ikeys: list[ChunkKey]) -> LookupResult:
        """The store's lookup of a tenant's (mapped) keys, counted."""
        return self.counted_lookup(t, len(ikeys), await self.d.lookup(ikeys))

    def lookup_now(self, t: Tenant, ikeys: list[ChunkKey]) -> LookupResult:
        """:meth:`lookup` on this thread (the same-host channel's). Blocking."""
        return self.counted_lookup(t, len(ikeys), self.d.store.lookup(ikeys))

    def counted_put(self, t: Tenant, res: PutResult, value_bytes: int) -> PutResult:
        """Count values of ``value_bytes`` each that a put of tenant ``t`` stored."""
        self.d.tenants.add(t.name, put_chunks=res.stored, put_bytes=value_bytes * res.stored)
        return res

    def put_now(
        self, t: Tenant, ikeys: list[ChunkKey], view: memoryview, iprefix: list[ChunkKey]
    ) -> PutResult:
        """Store values of equal length packed in ``view``, on this thread, counted.
        Blocking.

        Raises:
            InputError: values the store refuses (a size over its slot).
        """
        res = self.d.store.put(ikeys, view, prefix=iprefix, inline=True).result()
        return self.counted_put(t, res, view.nbytes // len(ikeys))

    def get_into_now(self, t: Tenant, ikeys: list[ChunkKey], view: memoryview) -> GetResult:
        """The leading run of present values that fit whole in ``view``, copied there on
        this thread (as the HTTP batch get answers), counted. Blocking."""
        store = self.d.store
        res = GetResult(0, 0, (), ())
        try:
            # The common case, the whole hit fits: one pass over the index.
            res = store.get(ikeys, view, inline=True).result()
        except InputError:
            # It does not: the leading values that fit whole.
            hit = store.lookup(ikeys)
            n, room = 0, view.nbytes
            for size in hit.value_bytes:
                if size > room:
                    break
                room -= size
                n += 1
            if n:
                # Re-stored with another length since the lookup: misses.
                with contextlib.suppress(InputError):
                    res = store.get(ikeys[:n], view, inline=True).result()
        self._count_get(t, len(ikeys), res.chunks, res.nbytes)
        return res

    def _count_get(self, t: Tenant, asked: int, chunks: int, nbytes: int) -> None:
        self.d.tenants.add(
            t.name,
            get_chunks=chunks,
            get_bytes=nbytes,
            lookup_hit_chunks=chunks,
            lookup_miss_chunks=asked - chunks,
        )

    async def batch_get(
        self, t: Tenant, hex_keys: list[str], scope: MutableMapping[str, Any]
    ) -> memoryview:
        """The batch body (KVTB, :mod:`.wire`) of the leading present keys of tenant ``t``.

        The body is capped at ``max_body_bytes`` (its TRUNCATED flag says more may
        follow); its buffer is sized to the hits and held from the in-flight budget for
        the rest of the request (``scope``).

        Raises:
            ApiError: 413 too many keys, 400 a malformed key, 503 the budget is spent.
        """
        ikeys = self.d.keys(t, hex_keys)
        hit = await self.d.lookup(ikeys)
        n, room = 0, self.d.limits.max_body_bytes - wire.table_bytes(hit.hits)
        for size in hit.value_bytes:
            if n and size > room:
                break
            room -= size
            n += 1
        start = wire.table_bytes(n)
        payload = sum(hit.value_bytes[:n])
        self.d.budget.hold(scope, start + payload)
        view = self.d.values.take(start + payload).data
        chunks, nbytes, lengths = 0, 0, tuple[int, ...]()
        if n:
            try:
                # A hit in memory is copied on the event loop, as a single GET's is.
                fut = self.d.store.get(
                    ikeys[:n], view[start:], inline_memory_bytes=INLINE_GET_BYTES
                )
                res = fut.result() if fut.done() else await asyncio.wrap_future(fut)
                chunks, nbytes, lengths = res.chunks, res.nbytes, res.value_bytes
            except InputError:
                # A key evicted and stored again with another length since the lookup:
                # the run no longer fits its buffer. Answer the misses that it now is.
                pass
        # Keys evicted between lookup and get shorten the run; the table then has gaps
        # before the payload, which payload_offset allows.
        flags = wire.FLAG_TRUNCATED if chunks == n < hit.hits else 0
        wire.write_header(view, chunks, start, flags)
        wire.write_table(view, [ChunkKey(bytes.fromhex(k)) for k in hex_keys[:chunks]], lengths)
        self._count_get(t, len(hex_keys), chunks, nbytes)
        return view[: start + nbytes]

    # -- metrics -----------------------------------------------------------------------------

    def observe(self, method: str, status: int, nout: int, t0: float, nin: int) -> None:
        """Count a one-chunk answer the data plane gave (``status``, ``nout`` body bytes),
        as the ASGI app's metrics count the others (same series, same labels)."""
        m = self.d.metrics
        m.direct += 1
        m.observe(CHUNK_TEMPLATE, method, status, time.perf_counter() - t0, nin, nout)


class ChunkPut:
    """One PUT being received into a reserved slot: fill :attr:`view`, then
    :meth:`finish` (the body ended) or :meth:`abort` (the client went away); exactly one."""

    __slots__ = ("_core", "_res", "_t0", "_tenant", "view")

    def __init__(self, core: RequestCore, tenant: Tenant, res: Reservation) -> None:
        self._core = core
        self._tenant = tenant
        self._res = res
        self._t0 = time.perf_counter()
        self.view = res.view

    def finish(self, filled: bool) -> Answer:
        """The answer once the body has ended (``filled``: it filled :attr:`view` exactly);
        a store error becomes its answer here (:func:`~kvtier.service.errors.reply_for`)."""
        try:
            if filled:
                answer = self._core.commit(self._tenant, self._res)
            else:
                answer = error_answer(bad_length())
        except Exception as exc:
            known = reply_for(exc)
            if known is None:
                log.exception("a PUT received into a slot failed")
                known = ErrorReply(500, "internal", "internal error")
            answer = error_answer(known)
        finally:
            self._end()
        nin = self.view.nbytes if filled else 0
        self._core.observe("PUT", answer.status, len(answer.body), self._t0, nin)
        return answer

    def abort(self) -> None:
        """The client went away mid-body: nothing is stored, the key is free again."""
        self._end()
        d = self._core.d
        d.metrics.observe(CHUNK_TEMPLATE, "PUT", 499, time.perf_counter() - self._t0, 0, 0)

    def _end(self) -> None:
        self._res.abort()  # a no-op once committed
        d = self._core.d
        d.budget.give(self.view.nbytes)
        d.metrics.in_flight -= 1


# -- answers ---------------------------------------------------------------------------------


def put_answer(res: PutResult) -> Answer:
    """A one-chunk PUT's answer. Its counts are 0 or 1, so there are few distinct
    answers: each is built once (an Answer is immutable) rather than per request."""
    counts = (res.stored, res.present, res.rejected, res.failed)
    answer = _PUT_ANSWERS.get(counts)
    if answer is None:
        body = dict(zip(("stored", "present", "rejected", "failed"), counts, strict=True))
        answer = Answer(200, json.dumps(body).encode())
        if max(counts) <= 1:
            _PUT_ANSWERS[counts] = answer
    return answer


_PUT_ANSWERS: dict[tuple[int, int, int, int], Answer] = {}


def not_found(hex_key: str) -> Answer:
    return error_answer(ErrorReply(404, "not_found", f"key {hex_key} is not present"))


def error_answer(reply: ErrorReply) -> Answer:
    extra = tuple(
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()
    )
    return Answer(reply.status, reply.body(), JSON, extra)


def bad_length() -> ErrorReply:
    return ErrorReply(400, "bad_length", "body length differs from its Content-Length")


def unauthorized() -> ErrorReply:
    return ErrorReply(
        401,
        "unauthorized",
        "a valid bearer token is required (Authorization: Bearer <token>)",
        {"WWW-Authenticate": "Bearer"},
    )


__all__ = ["NOT_NOW", "Admitted", "Answer", "ChunkPut", "Head", "RequestCore"]
