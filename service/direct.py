"""One-chunk ``GET`` and ``PUT`` answered in the daemon's HTTP protocol, below ASGI.

The protocol (:mod:`kvtier.service.headlimit`) asks :class:`DirectAnswers` when a plain
keep-alive request's head is complete and nothing else is in flight on the connection.
It takes only what it can serve exactly as the ASGI path would (the same token check,
body limits, in-flight budget, tenant counters, request metrics and answer bytes):

* ``GET /v1/chunks/{key}`` of a hit in memory, or a miss with no shared tier to ask,
  answered at once (:meth:`DirectAnswers.get`);
* ``PUT /v1/chunks/{key}`` of a value the store can take into a slot of a memory tier:
  the body's pieces are copied straight into that slot as the parser hands them over,
  and the answer is written when the body is complete (:meth:`DirectAnswers.put`).

Anything else returns None before it has touched anything, and the request takes the
ASGI path, the gate and every check there: no valid token, two ``Authorization``
headers, a query string, a body on a GET, a chunked or out-of-limit PUT, a full budget,
a hit behind I/O, a store that cannot reserve. One difference, in the request metrics
only: a PUT whose client goes away mid-body is counted as status 499 here, where the
ASGI path counts the 400 it could not deliver. What this saves per request is the task,
the request cycle and five ASGI layers: a quarter of a one-client 256 KiB GET's daemon
CPU on the 2-core VM (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from kvtier.errors import KVTierError
from kvtier.store.handles import HeldValue, Reservation

from .daemon import NOT_NOW, Daemon
from .errors import ErrorReply, reply_for
from .headlimit import Answer

log = logging.getLogger(__name__)

ROUTE = "/v1/chunks/{key}"
"""The route template both answers are counted under (as the ASGI fast path counts)."""

_CHUNK_URL = re.compile(rb"/v1/chunks/([0-9a-fA-F]{32})")
_JSON = (b"content-type", b"application/json")
_OCTET = (b"content-type", b"application/octet-stream")


class DirectAnswers:
    """The daemon's answers below ASGI (the protocol's ``direct``)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def get(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> Answer | _Borrowed | None:
        """The answer to a GET, or None for the ASGI path."""
        head = self._head(url, headers)
        if head is None or head[2] is not None:
            return None  # a GET with a body: the routes' business
        tenant, key, _ = head
        t0 = time.perf_counter()
        try:
            held = self.d.hold_value(tenant, key)
            if held is not None:  # sent straight from the tier's slot: no copy here
                try:
                    self.count("GET", (200, [], held.view), t0, 0)
                except BaseException:
                    held.release()
                    raise
                return _Borrowed(held)
            got = self.d.get_value_now(tenant, key)
        except KVTierError:
            return None  # a closed store: the ASGI path answers it as it always did
        if got is NOT_NOW:
            return None
        answer = (404, [_JSON], not_found(key)) if got is None else (200, [_OCTET], got)
        self.count("GET", answer, t0, 0)
        return answer

    def put(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> DirectPut | None:
        """A PUT to receive into a slot of the store, or None for the ASGI path."""
        head = self._head(url, headers)
        if head is None:
            return None
        tenant, key, length = head
        if length is None or not 0 < length <= self.d.limits.max_value_bytes:
            return None  # no length, an empty or an oversized value: the gate's answers
        if not self.d.budget.take_now(length):
            return None  # the gate waits for room, or answers 503
        res = None
        try:
            res = self.d.reserve(tenant, key, length)
        except KVTierError:
            pass  # a closed store: the ASGI path answers it as it always did
        finally:
            if res is None:  # present key, full top tier, a tier behind I/O, an error
                self.d.budget.give(length)
        if res is None:
            return None
        self.d.metrics.in_flight += 1
        return DirectPut(self, tenant, res)

    def _head(
        self, url: bytes, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Any, str, int | None] | None:
        """(tenant, key, Content-Length) of a one-chunk request it may answer, or None."""
        m = _CHUNK_URL.fullmatch(url)
        if m is None:
            return None
        auth: bytes | None = None
        length: int | None = None
        for name, value in headers:
            if name == b"authorization":
                if auth is not None:
                    return None  # the gate answers 400
                auth = value
            elif name == b"content-length":
                if length is not None or not value.isdigit():
                    return None  # the gate's or the parser's business
                length = int(value) or None
            elif name == b"transfer-encoding":
                return None
        tenant = self.d.auth.authenticate(auth.decode("latin-1") if auth is not None else None)
        if tenant is None:
            return None  # the gate answers 401
        return tenant, m.group(1).decode("ascii"), length

    def count(self, method: str, answer: Answer, t0: float, nin: int) -> None:
        """Count an answer given below ASGI, as the metrics middleware counts the others."""
        metrics = self.d.metrics
        metrics.direct += 1
        metrics.observe(ROUTE, method, answer[0], time.perf_counter() - t0, nin, len(answer[2]))


class _Borrowed:
    """A 200 sent from a store slot held in place (:class:`~kvtier.store.store.HeldValue`)."""

    __slots__ = ("_held", "view")
    status = 200
    headers = [_OCTET]

    def __init__(self, held: HeldValue) -> None:
        self._held = held
        self.view = held.view

    def release(self) -> None:
        self._held.release()


class DirectPut:
    """One PUT being received into a reserved slot: fill :attr:`view`, then :meth:`finish`
    (the body ended) or :meth:`abort` (the client went away). Exactly one of the two."""

    __slots__ = ("_answers", "_res", "_t0", "_tenant", "view")

    def __init__(self, answers: DirectAnswers, tenant: Any, res: Reservation) -> None:
        self._answers = answers
        self._tenant = tenant
        self._res = res
        self._t0 = time.perf_counter()
        self.view = res.view

    def finish(self, filled: bool) -> Answer:
        """The answer once the body has ended; ``filled``: it filled :attr:`view` exactly."""
        d = self._answers.d
        nin = self.view.nbytes if filled else 0  # as the ASGI path counts a received body
        try:
            if not filled:
                reply = ErrorReply(400, "bad_length", "body length differs from its Content-Length")
                answer = _error(reply)
            else:
                out = d.commit(self._tenant, self._res)
                body = json.dumps(
                    {
                        "stored": out.stored,
                        "present": out.present,
                        "rejected": out.rejected,
                        "failed": out.failed,
                    }
                ).encode()
                answer = (200, [_JSON], body)
        except Exception as exc:
            known = reply_for(exc)
            if known is None:
                log.exception("a PUT answered in the protocol failed")
                known = ErrorReply(500, "internal", "internal error")
            answer = _error(known)
        finally:
            self._end()
        self._answers.count("PUT", answer, self._t0, nin)
        return answer

    def abort(self) -> None:
        """The client went away mid-body: nothing is stored, the key is free again."""
        self._end()
        d = self._answers.d
        d.metrics.observe(ROUTE, "PUT", 499, time.perf_counter() - self._t0, 0, 0)

    def _end(self) -> None:
        self._res.abort()  # a no-op once committed
        d = self._answers.d
        d.budget.give(self.view.nbytes)
        d.metrics.in_flight -= 1


def not_found(key: str) -> bytes:
    """The body of a GET's 404 (the same on every path)."""
    return json.dumps({"code": "not_found", "message": f"key {key} is not present"}).encode()


def _error(reply: ErrorReply) -> Answer:
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    return reply.status, [_JSON, *extra], reply.body()
