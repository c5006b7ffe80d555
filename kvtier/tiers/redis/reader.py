"""Pipelined GETs of the ``redis`` tier, read off the socket into one reused buffer.

redis-py with hiredis copies every value three times on its way in: from the socket
into a 64 KiB read buffer, into hiredis' growing reply buffer, then into a new ``bytes``
object of the value's size. Values here are megabytes, and each fresh ``bytes`` of that
size comes from the C allocator; on the tier's fan-out threads glibc hands it pages it
has just returned to the kernel, so every value also pays a page fault per 4 KiB. That
cost more CPU than the rest of a read (a GET ran at 0.6x raw redis-py on one server
while the same bytes through one thread ran at 1x).

This reader sends the pipelined ``GET``/``GETEX`` commands on one of the client's pooled
connections and parses the RESP replies itself: a reply's line is read through a small
buffer, its value straight from the socket (``recv_into``) into a buffer that each
thread keeps and grows to the largest value it has read. The value is then verified and
copied into the caller's slot by the tier, under its fence (:class:`~.nodes.Op`), so a
late worker still never writes into a buffer its caller gave up on.

It uses one private attribute of redis-py's connections, ``_sock`` (present in redis-py
5 to 8); a connection without it is read by redis-py's pipeline as before
(:func:`raw_socket`). Any failure mid-reply disconnects the connection, so no reply is
ever left on a pooled socket.
"""

from __future__ import annotations

import inspect
import socket
import threading
from collections.abc import Generator, Sequence
from typing import Any

# A reply's line (``$3670048``, ``-ERR ...``) is read in pieces this small, so that little
# of the value that follows it goes through the line buffer rather than straight in.
_LINE_READ = 4096
_LINE_LIMIT = 64 * 1024  # a longer reply line is not RESP from a Redis server

_local = threading.local()
_NEEDS_NAME: dict[type, bool] = {}  # pool class -> get_connection wants a command name


def _staging(nbytes: int) -> memoryview:
    """This thread's value buffer, at least ``nbytes`` long (kept for its next reads)."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = bytearray(nbytes)
    return memoryview(buf)


def raw_socket(conn: Any) -> socket.socket | None:
    """The connected socket of a redis-py connection, or None when it exposes none."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class _Replies:
    """RESP replies of one socket: lines through a small buffer, values read in place."""

    __slots__ = ("buf", "pos", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                out = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return out
            if len(self.buf) - self.pos > _LINE_LIMIT:
                raise ProtocolFault("a reply line over 64 KiB")
            del self.buf[: self.pos]
            self.pos = 0
            piece = self.sock.recv(_LINE_READ)
            if not piece:
                raise ConnectionResetError("redis closed the connection mid-reply")
            self.buf += piece

    def into(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the stream."""
        n = view.nbytes
        have = min(len(self.buf) - self.pos, n)
        if have:
            view[:have] = self.buf[self.pos : self.pos + have]
            self.pos += have
        while have < n:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionResetError("redis closed the connection mid-reply")
            have += got


class ProtocolFault(OSError):
    """A reply that is not what a GET answers: the connection is dropped, the node failed."""


def _command(args: Sequence[bytes]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(parts)


def supported() -> bool:
    """Whether redis-py's connections expose their socket (asked without connecting)."""
    import redis

    return hasattr(redis.Connection(), "_sock")  # type: ignore[no-untyped-call]


def _connection(pool: Any) -> Any:
    """A connection of ``pool``: redis-py before 5.3 requires a command name, later
    versions warn that it is deprecated."""
    cls = type(pool)
    needs = _NEEDS_NAME.get(cls)
    if needs is None:
        param = inspect.signature(cls.get_connection).parameters.get("command_name")
        needs = _NEEDS_NAME[cls] = param is not None and param.default is param.empty
    return pool.get_connection("GET") if needs else pool.get_connection()


def _skip(replies: _Replies, nbytes: int) -> None:
    """Read ``nbytes`` of ``replies`` into a small scratch buffer, and drop them."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 16)))
    while nbytes:
        k = min(nbytes, scratch.nbytes)
        replies.into(scratch[:k])
        nbytes -= k


def get_values(
    pool: Any, names: Sequence[bytes], px: int | None, max_bytes: int
) -> Generator[memoryview | Exception | None, None, None]:
    """Send one pipeline of ``GET`` (``GETEX .. PX px`` with a TTL) of ``names`` on a
    connection of ``pool``, and yield each reply in order: the value (a view of this
    thread's buffer, valid until the next one is read), None for an absent key, or the
    server's error as a redis-py exception.

    Closing the iterator before its end disconnects the connection (replies remain).
    A value longer than ``max_bytes`` is read off the socket in small pieces, never
    buffered, and yielded empty: the tier finds it corrupt (a length damaged beyond what
    the server sends times the read out: the node failed).

    Raises:
        OSError: the socket failed or timed out, or a reply was not RESP.
    """
    conn = _connection(pool)
    done = False
    try:
        if px is None:
            cmds = [_command((b"GET", n)) for n in names]
        else:
            p = b"%d" % px
            cmds = [_command((b"GETEX", n, b"PX", p)) for n in names]
        conn.send_packed_command([b"".join(cmds)], check_health=False)
        sock = raw_socket(conn)
        if sock is None:  # checked by the tier before choosing this reader
            raise ProtocolFault("the connection exposes no socket")
        replies = _Replies(sock)
        for _ in names:
            line = replies.line()
            kind = line[:1]
            if kind == b"$":
                try:
                    n = int(line[1:])
                except ValueError:
                    raise ProtocolFault(f"bad bulk length {line[:40]!r}") from None
                if n < 0:
                    yield None
                    continue
                if n > max_bytes:
                    _skip(replies, n + 2)
                    yield memoryview(b"")
                    continue
                view = _staging(n + 2)[: n + 2]
                replies.into(view)
                if view[n:].tobytes() != b"\r\n":
                    raise ProtocolFault("a value not followed by CRLF")
                yield view[:n]
            elif kind == b"-":
                yield _error(line[1:].decode("utf-8", "replace"))
            else:
                raise ProtocolFault(f"unexpected reply {line[:40]!r} to GET")
        done = True
    finally:
        if not done:  # replies may remain on the socket: never hand it to the next caller
            conn.disconnect()
        pool.release(conn)


def _error(text: str) -> Exception:
    from redis import exceptions as errors

    code = text.split(" ", 1)[0]
    cls = {
        "ASK": errors.AskError,
        "MOVED": errors.MovedError,
        "CLUSTERDOWN": errors.ClusterDownError,
        "TRYAGAIN": errors.TryAgainError,
    }.get(code, errors.ResponseError)
    exc: Exception = cls(text)
    return exc
