"""One-chunk ``GET`` and ``PUT`` answered in the daemon's HTTP protocol, below ASGI.

The protocol (:mod:`kvtier.service.headlimit`) asks :class:`DirectAnswers` when a plain
keep-alive request's head is complete and nothing else is in flight on the connection.
It takes only what the request core (:mod:`kvtier.service.core`) can answer at once, and
the core answers it exactly as it answers the ASGI path (the same admission, budget,
tenant counters, request metrics and answer bytes):

* ``GET /v1/chunks/{key}`` of a hit in memory, or a miss with no shared tier to ask;
* ``PUT /v1/chunks/{key}`` of a value the store can take into a slot of a memory tier:
  the body's pieces are copied straight into that slot as the parser hands them over,
  and the answer is written when the body is complete.

Anything else returns None before it has touched anything, and the request takes the
ASGI path, the gate and every check there. One difference, in the request metrics
only: a PUT whose client goes away mid-body is counted as status 499 here, where the
ASGI path counts the 400 it could not deliver.
"""

from __future__ import annotations

import logging
import time

from kvtier.errors import KVTierError
from kvtier.store.handles import HeldValue

from .core import NOT_NOW, Admitted, Answer, ChunkPut, Head, RequestCore
from .headlimit import HeldAnswer
from .routes.table import GET_CHUNK, PUT_CHUNK, chunk_key_of_url
from .tenants import Tenant

log = logging.getLogger(__name__)


class DirectAnswers:
    """The daemon's answers below ASGI (the protocol's ``direct``)."""

    def __init__(self, core: RequestCore) -> None:
        self.core = core

    def get(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> Answer | HeldAnswer | None:
        """The answer to a GET, or None for the ASGI path."""
        taken = self._take("GET", url, headers)
        if taken is None or taken[1].length is not None:
            return None  # a GET with a body: the routes' business
        tenant, _, key = taken
        t0 = time.perf_counter()
        try:
            got = self.core.get_now(tenant, key)
        except KVTierError:
            return None  # a closed store: the ASGI path answers it as it always did
        if got is NOT_NOW:
            return None
        if isinstance(got, Answer):
            self.core.observe("GET", got, t0, 0)
            return got
        try:  # sent straight from the tier's slot: no copy here
            self.core.observe("GET", Answer(200, got.view), t0, 0)
        except BaseException:
            got.release()
            raise
        return _Borrowed(got)

    def put(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> ChunkPut | None:
        """A PUT to receive into a slot of the store, or None for the ASGI path."""
        taken = self._take("PUT", url, headers)
        if taken is None or taken[1].length is None:
            return None
        tenant, head, key = taken
        try:
            return self.core.start_put(tenant, key, head.length or 0)
        except KVTierError:
            return None  # a closed store: the ASGI path answers it as it always did

    def _take(
        self, method: str, url: bytes, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Tenant, Head, str] | None:
        """(tenant, head, key) of a one-chunk request the core admits, or None."""
        key = chunk_key_of_url(url)
        if key is None:
            return None
        head = Head.read(headers)
        if not head.plain:
            return None  # the gate's or the parser's business
        route = GET_CHUNK if method == "GET" else PUT_CHUNK
        verdict = self.core.admit(method, route.path(key), head)
        if not isinstance(verdict, Admitted) or verdict.tenant is None:
            return None  # the gate gives the refusal
        return verdict.tenant, head, key


class _Borrowed:
    """A 200 sent from a store slot held in place (:class:`~kvtier.store.store.HeldValue`)."""

    __slots__ = ("_held", "view")
    status = 200
    headers = [(b"content-type", b"application/octet-stream")]

    def __init__(self, held: HeldValue) -> None:
        self._held = held
        self.view = held.view

    def release(self) -> None:
        self._held.release()
