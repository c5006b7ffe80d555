"""A lean HTTP/1.1 transport for the sync client: httpx's API over ``http.client``.

httpx's default transport (httpcore + h11, a pure-Python state machine) costs more CPU
per request than the daemon spends serving one, and reassembles bodies from 64 KiB
pieces. This transport keeps httpx's client API (timeouts, errors, streaming)
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
from typing import Any, Protocol

import httpx

_READ_PIECE = 4 * 1024 * 1024


class Sink(Protocol):
    """Takes a 200 body as it arrives (:class:`~kvtier.service.protocol.BatchSink`)."""

    def feed(self, data: bytes) -> None:
        """The next piece of the body."""

    def window(self, nbytes: int) -> memoryview | None:
        """Where up to ``nbytes`` of the next body bytes may be received in place (then
        report them with :meth:`wrote`), or None to take them through :meth:`feed`."""

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` were received into the last :meth:`window`."""


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
        _close_idle(self._idle)


def _close_idle(idle: queue.LifoQueue[Any]) -> None:
    """Close the connections waiting in a pool of either transport."""
    while True:
        try:
            idle.get_nowait().close()
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


# -- the sync client's own HTTP/1.1 -----------------------------------------------------------

_HEAD_LIMIT = 64 * 1024
_RECV = 256 * 1024
# The daemon writes a response's head with the first body piece: a peek of this much
# nearly always holds the whole head, which is then consumed exactly (below).
_PEEK = 4096
# A body at least this long, still wholly in the socket, is read by one buffered read
# into the bytes object returned (CPython fills it in place): no zeroed bytearray first
# and no copy into bytes after, which for a 32 MiB value cost more than the transfer.
_DIRECT_BODY = 64 * 1024
# sendmsg takes at most IOV_MAX (1024 on Linux) pieces per call.
_IOV_MAX = 1024


class _Stale(Exception):
    """A kept-alive connection was closed by the daemon before it answered."""


class RawHTTP:
    """HTTP/1.1 for the sync client, on plain sockets: the request's head and body pieces
    go out in one ``sendmsg`` (no join), the response body is read with ``recv_into``
    into one buffer of its ``Content-Length``. Thread-safe: a LIFO pool of connections.

    httpx's request and response models (URL parsing, header objects) cost the client
    more CPU per 256 KiB get than the daemon spends serving it; this keeps the client's
    work to building one head and parsing one. Errors are httpx's (``ConnectError``,
    ``ReadTimeout``, ``RemoteProtocolError``...), so the client translates and retries
    them as for any transport. A kept-alive connection the daemon closed meanwhile is
    retried once on a fresh one.

    Args:
        url: ``http://host:port[/prefix]``.
        pool: idle connections kept for reuse.
        connect_timeout_s: timeout of the TCP connect, in seconds.
        timeout_s: timeout of each socket read or write, in seconds.
    """

    def __init__(
        self, url: str, *, pool: int = 64, connect_timeout_s: float = 2.0, timeout_s: float = 30.0
    ) -> None:
        u = httpx.URL(url)
        if u.scheme != "http" or not u.host:
            raise httpx.UnsupportedProtocol("RawHTTP speaks plain http:// only")
        self._addr = (u.host, u.port or 80)
        host = f"[{u.host}]" if ":" in u.host else u.host
        self._host_line = f"Host: {host}:{u.port or 80}\r\n".encode("ascii")
        self._prefix = u.raw_path.decode("ascii").rstrip("/")
        self._idle: queue.LifoQueue[socket.socket] = queue.LifoQueue(maxsize=pool)
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        headers: bytes,
        body: list[memoryview],
        sink: Sink | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request, return (status, headers, body); with ``sink``, a 200 body
        is fed to it piece by piece instead (and the returned body is empty).

        ``headers`` are complete ``Name: value\\r\\n`` lines (no Host, no Content-Length).
        """
        n = sum(v.nbytes for v in body)
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("ascii") + self._host_line
        head += headers
        if n or method in ("PUT", "POST"):
            head += b"Content-Length: %d\r\n" % n
        parts = [memoryview(head + b"\r\n"), *body]
        try:
            sock, reused = self._idle.get_nowait(), True
        except queue.Empty:
            sock, reused = self._connect(), False
        try:
            try:
                return self._exchange(sock, method, parts, sink)
            except _Stale:
                sock.close()
                if not reused:
                    raise httpx.RemoteProtocolError("the daemon closed the connection") from None
            sock = self._connect()  # a kept-alive connection the daemon had closed: once more
            try:
                return self._exchange(sock, method, parts, sink)
            except _Stale:
                sock.close()
                raise httpx.RemoteProtocolError("the daemon closed the connection") from None
        except BaseException as exc:
            sock.close()
            if isinstance(exc, Exception):
                raise _translate(exc) from exc
            raise

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._addr, timeout=self._connect_timeout_s)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._timeout_s)
        return sock

    def _exchange(
        self,
        sock: socket.socket,
        method: str,
        parts: list[memoryview],
        sink: Sink | None,
    ) -> tuple[int, dict[str, str], bytes]:
        try:
            _send_all(sock, parts)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Stale() from exc
        # Only a GET's answer may be a large body worth reading in place (peek first).
        status, headers, rest = self._read_head(sock, peek=method == "GET")
        keep = headers.get("connection", "").lower() != "close"
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = _read_chunked(sock, rest)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if sink is not None and status == 200:
                _feed(sock, rest, length, sink)
                body = b""
            else:
                body = _read_exact(sock, rest, length)
        else:  # the body runs to the end of the connection
            body, keep = _read_to_close(sock, rest), False
        if keep:
            try:
                self._idle.put_nowait(sock)
            except queue.Full:
                sock.close()
        else:
            sock.close()
        return status, headers, body

    @staticmethod
    def _read_head(sock: socket.socket, peek: bool) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, the body bytes already read with the head)."""
        if peek:
            try:
                first = sock.recv(_PEEK, socket.MSG_PEEK)
            except ConnectionResetError as exc:
                raise _Stale() from exc
            if not first:
                raise _Stale()
            end = first.find(b"\r\n\r\n")
            if end >= 0:
                # The whole head is there: take exactly it, the body stays in the socket.
                _discard(sock, end + 4)
                return (*_parse_head(first[:end]), b"")
        buf = b""
        while True:
            try:
                piece = sock.recv(_RECV)
            except ConnectionResetError as exc:
                if not buf:
                    raise _Stale() from exc
                raise
            if not piece:
                if not buf:
                    raise _Stale()
                raise httpx.RemoteProtocolError("the daemon closed the connection mid-answer")
            buf += piece
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > _HEAD_LIMIT:
                raise httpx.RemoteProtocolError("the daemon sent an answer head over 64 KiB")
        return (*_parse_head(buf[:end]), buf[end + 4 :])

    def close(self) -> None:
        _close_idle(self._idle)


def _send_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """``sendall`` of several pieces, without joining them."""
    parts = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
    while parts:
        sent = sock.sendmsg(parts[:_IOV_MAX])
        while sent:
            if sent >= parts[0].nbytes:
                sent -= parts[0].nbytes
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


def _discard(sock: socket.socket, n: int) -> None:
    """Consume ``n`` bytes a peek has shown are there."""
    while n > 0:
        got = len(sock.recv(n))
        if not got:
            raise httpx.RemoteProtocolError("the daemon closed the connection mid-answer")
        n -= got


def _read_exact(sock: socket.socket, rest: bytes, length: int) -> bytes:
    if not rest and length >= _DIRECT_BODY:
        # Closing the file object leaves the socket open (it only drops a reference).
        with sock.makefile("rb", buffering=_HEAD_LIMIT) as f:
            body: bytes = f.read(length)
        if len(body) != length:
            raise httpx.RemoteProtocolError("the daemon closed the connection mid-body")
        return body
    if len(rest) >= length:
        if len(rest) > length:
            raise httpx.RemoteProtocolError("the daemon sent more than its Content-Length")
        return rest
    buf = bytearray(length)
    view = memoryview(buf)
    view[: len(rest)] = rest
    pos = len(rest)
    while pos < length:
        n = sock.recv_into(view[pos:])
        if not n:
            raise httpx.RemoteProtocolError("the daemon closed the connection mid-body")
        pos += n
    return bytes(buf)


def _feed(sock: socket.socket, rest: bytes, length: int, sink: Sink) -> None:
    if rest:
        sink.feed(rest[:length])
    left = length - len(rest)
    while left > 0:
        # Values go from the socket straight into the caller's buffer (one copy); the
        # head, and bytes the sink does not keep, go through feed.
        window = sink.window(min(left, _READ_PIECE))
        if window is not None:
            n = sock.recv_into(window)
            if not n:
                raise httpx.RemoteProtocolError("the daemon closed the connection mid-body")
            sink.wrote(n)
            left -= n
            continue
        piece = sock.recv(min(left, _READ_PIECE))
        if not piece:
            raise httpx.RemoteProtocolError("the daemon closed the connection mid-body")
        sink.feed(piece)
        left -= len(piece)


def _read_chunked(sock: socket.socket, rest: bytes) -> bytes:
    buf = bytearray(rest)
    out = bytearray()

    def fill() -> None:
        piece = sock.recv(_RECV)
        if not piece:
            raise httpx.RemoteProtocolError("the daemon closed the connection mid-body")
        buf.extend(piece)

    while True:
        while (eol := buf.find(b"\r\n")) < 0:
            fill()
        size = int(bytes(buf[:eol]).split(b";")[0], 16)
        while len(buf) < eol + 2 + size + 2:
            fill()
        out += buf[eol + 2 : eol + 2 + size]
        del buf[: eol + 2 + size + 2]
        if size == 0:
            return bytes(out)  # trailers are not used by the daemon


def _read_to_close(sock: socket.socket, rest: bytes) -> bytes:
    pieces = [rest]
    while piece := sock.recv(_RECV):
        pieces.append(piece)
    return b"".join(pieces)
