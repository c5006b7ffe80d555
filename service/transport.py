"""A lean HTTP/1.1 transport for the sync client: httpx's API over ``http.client``.

httpx's default transport (httpcore + h11, a pure-Python state machine) costs about a
millisecond of CPU per request on a loaded 2-core host and reassembles bodies from
64 KiB pieces. This transport keeps httpx's client API (timeouts, errors, streaming)
but moves bytes with ``http.client``: bodies are sent piece by piece with no join, and
a response body of known length is read with one ``read`` into one buffer.

Connections are pooled (LIFO, so the warmest is reused) and get ``TCP_NODELAY``: a
request's headers and body go out as separate writes, which Nagle's algorithm would
otherwise hold back until the peer's delayed ACK.

Errors are httpx's (``ConnectError``, ``ReadTimeout``, ...), so the client above
translates them once, like those of any httpx transport. A kept-alive connection the
server closed in the meantime is retried once on a fresh one, before any retry policy.
"""

from __future__ import annotations

import http.client
import queue
import socket
from collections.abc import Iterator

import httpx

_READ_PIECE = 4 * 1024 * 1024


class _Conn(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Body(httpx.SyncByteStream):
    """A response body read from its connection, which goes back to the pool once drained."""

    def __init__(self, resp: http.client.HTTPResponse, conn: _Conn, owner: HTTP11Transport) -> None:
        self._resp, self._conn, self._owner = resp, conn, owner

    def __iter__(self) -> Iterator[bytes]:
        try:
            while True:
                # A body of known length comes back whole, in one piece, when it is
                # at most _READ_PIECE bytes: one copy from the socket, no join later.
                piece = self._resp.read(_READ_PIECE)
                if not piece:
                    return
                yield piece
        except TimeoutError as exc:
            self._discard()
            raise httpx.ReadTimeout(str(exc)) from exc
        except (OSError, http.client.HTTPException) as exc:
            self._discard()
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._resp.isclosed() and not self._resp.will_close:
            self._owner._give_back(conn)
        else:
            conn.close()  # not drained or not reusable

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None  # type: ignore[assignment]


class HTTP11Transport(httpx.BaseTransport):
    """Pooled HTTP/1.1 over ``http.client`` for one origin. Thread-safe.

    Args:
        pool: idle connections kept for reuse.
        connect_timeout_s: timeout of the TCP connect, in seconds.
        timeout_s: timeout of each socket read or write, in seconds.
    """

    def __init__(self, *, pool: int = 64, connect_timeout_s: float = 2.0, timeout_s: float = 30.0):
        self._idle: queue.LifoQueue[_Conn] = queue.LifoQueue(maxsize=pool)
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s

    def _new(self, url: httpx.URL) -> _Conn:
        conn = _Conn(url.host, url.port or 80, timeout=self._connect_timeout_s)
        try:
            conn.connect()
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        conn.sock.settimeout(self._timeout_s)
        return conn

    def _give_back(self, conn: _Conn) -> None:
        try:
            self._idle.put_nowait(conn)
        except queue.Full:
            conn.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol("HTTP11Transport speaks plain http:// only")
        try:
            conn, reused = self._idle.get_nowait(), True
        except queue.Empty:
            conn, reused = self._new(request.url), False
        try:
            resp = self._exchange(conn, request)
        except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
            conn.close()
            if not reused:
                raise httpx.RemoteProtocolError("the daemon closed the connection") from None
            # A kept-alive connection the server has since closed: once more, fresh.
            conn = self._new(request.url)
            try:
                resp = self._exchange(conn, request)
            except Exception as exc:
                conn.close()
                raise _translate(exc) from exc
        except Exception as exc:
            conn.close()
            raise _translate(exc) from exc
        return httpx.Response(
            resp.status,
            headers=resp.getheaders(),
            stream=_Body(resp, conn, self),
            extensions={"http_version": b"HTTP/1.1"},
        )

    @staticmethod
    def _exchange(conn: _Conn, request: httpx.Request) -> http.client.HTTPResponse:
        target = request.url.raw_path.decode("ascii")
        conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in request.headers.raw:
            conn.putheader(name.decode("latin-1"), value.decode("latin-1"))
        stream = request.stream
        assert isinstance(stream, httpx.SyncByteStream)
        conn.endheaders()
        for piece in stream:
            if len(piece):  # an empty write would still cost a system call
                conn.send(piece)
        return conn.getresponse()

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def _translate(exc: BaseException) -> httpx.TransportError:
    if isinstance(exc, httpx.TransportError):
        return exc
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(str(exc))
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return httpx.ReadError(f"{type(exc).__name__}: {exc}")
    return httpx.TransportError(f"{type(exc).__name__}: {exc}")
