"""The client side of the same-host channel (:mod:`kvtier.service.shm`).

:class:`SameHost` keeps a small pool of connections to the daemon's Unix socket; each
one authenticated with the client's bearer token and given a private scratch region
(shared memory this process created: a memfd sealed against shrinking). Values in
memory from :meth:`SameHost.shared_buffer` go to and from the daemon with no copy on
this side (the daemon copies once, between its tier and this memory); other buffers
are copied through the scratch region once.

:class:`~kvtier.service.client.Client` uses it on its own when its URL is loopback and
the daemon advertises a socket (``GET /v1/same-host``), and falls back to HTTP with a
logged reason when the channel breaks (:class:`SameHostDown`).

Thread-safety: :class:`SameHost` is thread-safe; a connection serves one thread at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import AuthError, InputError, TransportError
from kvtier.keys import ChunkKey
from kvtier.store.types import LookupResult, PutResult
from kvtier.tiers.memory import populate

from . import shm_wire as w
from .protocol import Fetched

log = logging.getLogger(__name__)

MIN_SCRATCH_BYTES = 1 << 20
POOL = 8  # idle connections kept


class SameHostDown(TransportError):
    """The channel cannot be used (no socket, a broken connection): use HTTP instead."""


@dataclass(frozen=True, slots=True)
class ChannelInfo:
    """What the daemon said in its HELLO reply."""

    tiers: tuple[str, ...]
    max_value_bytes: int
    max_request_bytes: int
    max_batch_keys: int
    max_region_bytes: int
    put_prefix: bool = False  # the daemon takes a put's prefix keys (older ones do not)


class Region:
    """Shared memory this process created: a sealed memfd, mapped here (and, once
    registered, by the daemon). ``array`` is the whole region as uint8.

    Raises:
        OSError: the memfd cannot be created, sized or mapped.
    """

    def __init__(self, rid: int, nbytes: int) -> None:
        if rid > 0xFFFF:  # the frame's region field; ids are never reused (no aliasing)
            raise OSError("this channel has made all the regions it can (65535)")
        self.rid = rid
        self.nbytes = nbytes
        self.fd = os.memfd_create("kvtier-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            # The daemon refuses memory that could shrink under its mapping (SIGBUS).
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            # Populated here, so its pages are this process's memory, faulted once, and
            # the daemon sees a whole memfd it may populate too. ``populate`` lets the
            # GIL go, so the host's other threads run meanwhile; MAP_POPULATE holds it
            # for the whole populate, and serves only kernels that refuse the advice
            # (before 5.14).
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self.mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, prot)
            if not populate(self.mm):
                self.mm.close()
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self.mm = mmap.mmap(self.fd, nbytes, flags, prot)
        except OSError:
            os.close(self.fd)
            raise
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def offset_of(self, addr: int, nbytes: int) -> int | None:
        off = addr - self.addr
        return off if off >= 0 and off + nbytes <= self.nbytes else None

    def close(self) -> None:
        """Close the descriptor; the mapping goes when the last array over it does."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def address(view: memoryview) -> int:
    """The address of a byte view's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class _Link:
    """One connection: authenticated, with the regions it mapped on the daemon."""

    def __init__(self, path: str, token: str | None, timeout_s: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout_s)
        self.mapped: dict[int, None] = {}  # region ids, least recently used first
        self.scratch: Region | None = None
        self._recv = 4096
        try:
            self.sock.connect(path)
            secret = (token or "").encode()
            _, _, _, body = self.call(w.request(w.Op.HELLO, count=len(secret)), secret)
        except BaseException:
            self.sock.close()
            raise
        raw = json.loads(body)
        self.info = ChannelInfo(
            tuple(raw["tiers"]),
            int(raw["max_value_bytes"]),
            int(raw["max_request_bytes"]),
            int(raw["max_batch_keys"]),
            int(raw["max_region_bytes"]),
            bool(raw.get("put_prefix", False)),
        )
        self._recv = w.REPLY.size + 5 * self.info.max_batch_keys + 1024

    def call(
        self, header: bytes, payload: bytes = b"", fd: int | None = None
    ) -> tuple[int, int, int, bytes]:
        """Send one request and read its reply: (status, count, nbytes, payload).

        Raises:
            SameHostDown: the connection broke or the reply is malformed.
            InputError, AuthError, TransportError: the daemon refused the request.
        """
        try:
            if fd is None:
                self.sock.send(header + payload)
            else:
                socket.send_fds(self.sock, [header + payload], [fd])
            msg = self.sock.recv(self._recv)
        except OSError as exc:
            raise SameHostDown(f"same-host connection failed: {exc}") from exc
        if len(msg) < w.REPLY.size:
            raise SameHostDown("the daemon closed the same-host connection")
        magic, status, _, _, count, _, nbytes = w.REPLY.unpack_from(msg)
        body = msg[w.REPLY.size :]
        if magic != w.MAGIC:
            raise SameHostDown("the daemon sent a bad same-host reply")
        if status == w.Status.OK:
            return status, count, nbytes, body
        try:
            st = w.Status(status)
        except ValueError:
            raise SameHostDown(f"the daemon sent an unknown status {status}") from None
        # Worded as protocol.check words the same refusal over HTTP.
        why = body.decode("utf-8", "replace")
        text = f"daemon answered {w.HTTP_EQUIVALENT[st]} {st.name.lower()} (same-host): {why}"
        if st in (w.Status.BAD_REQUEST, w.Status.TOO_LARGE):
            raise InputError(text)
        if status == w.Status.UNAUTHORIZED:
            raise AuthError(text)
        raise TransportError(text)

    def map(self, region: Region) -> None:
        if region.rid in self.mapped:
            self.mapped[region.rid] = self.mapped.pop(region.rid)  # now the most recent
            return
        while len(self.mapped) >= w.MAX_REGIONS:
            keep = self.scratch.rid if self.scratch is not None else -1
            old = next(r for r in self.mapped if r != keep)
            self.call(w.request(w.Op.UNMAP, region=old))
            del self.mapped[old]
        self.call(w.request(w.Op.MAP, region=region.rid, length=region.nbytes), fd=region.fd)
        self.mapped[region.rid] = None

    def close(self) -> None:
        self.sock.close()
        if self.scratch is not None:
            self.scratch.close()


class SameHost:
    """A pool of same-host connections to one daemon. Thread-safe.

    Args:
        path: the daemon's socket (from ``GET /v1/same-host``).
        token: the bearer token (the same as over HTTP).
        timeout_s: bound on one request's round trip.

    Raises:
        SameHostDown: the socket cannot be reached.
        AuthError: the daemon refused the token.
    """

    def __init__(self, path: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.path = path
        self._token = token
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._idle: list[_Link] = []
        self._shared: list[Region] = []
        first = self._connect()
        self.info = first.info
        self._idle.append(first)

    def _connect(self) -> _Link:
        try:
            return _Link(self.path, self._token, self._timeout_s)
        except OSError as exc:
            raise SameHostDown(f"same-host socket {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def _link(self) -> Iterator[_Link]:
        with self._lock:
            link = self._idle.pop() if self._idle else None
        if link is None:
            link = self._connect()
        try:
            yield link
        except BaseException:
            # Down, refused or interrupted mid-request: a link whose state is not known is
            # closed here, not left to the garbage collector; the next call opens another.
            link.close()
            raise
        with self._lock:
            if len(self._idle) < POOL:
                self._idle.append(link)
                link = None
        if link is not None:
            link.close()

    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A new buffer of ``nbytes`` in shared memory: puts from it and gets into it
        move no byte on this side. Lives as long as this channel."""
        region = Region(next(self._ids), max(nbytes, 1))
        with self._lock:
            self._shared.append(region)
        # Handed to the daemon now, so that its mapping (populated once, shared by this
        # channel's connections) is made here and not inside the first request that uses
        # the buffer. A failure here is not one: the first request maps it again.
        with contextlib.suppress(TransportError, InputError), self._link() as link:
            link.map(region)
        return region.array[:nbytes]

    def holds(self, view: memoryview) -> bool:
        """True when ``view`` lies whole in a buffer from :meth:`shared_buffer` of this
        channel (the daemon copies straight into or out of it)."""
        return self._locate(view) is not None

    def _locate(self, view: memoryview) -> tuple[Region, int] | None:
        addr = address(view)
        with self._lock:
            for region in self._shared:
                off = region.offset_of(addr, view.nbytes)
                if off is not None:
                    return region, off
        return None

    def _scratch(self, link: _Link, nbytes: int) -> Region:
        have = link.scratch
        if have is not None and have.nbytes >= nbytes:
            return have
        size = max(MIN_SCRATCH_BYTES, 1 << (nbytes - 1).bit_length())
        size = min(size, self.info.max_region_bytes)
        try:
            region = Region(next(self._ids), size)
        except OSError as exc:
            raise SameHostDown(f"no scratch region of {size} B: {exc}") from exc
        try:
            link.map(region)
        except BaseException:
            region.close()
            raise
        if have is not None:
            with contextlib.suppress(SameHostDown, TransportError):
                link.call(w.request(w.Op.UNMAP, region=have.rid))
            link.mapped.pop(have.rid, None)
            have.close()
        link.scratch = region
        return region

    def _request_bytes(self) -> int:
        return min(self.info.max_request_bytes, self.info.max_region_bytes)

    # -- operations (keys are raw 16-byte keys) ------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        tiers: list[str] = []
        lengths: list[int] = []
        step = self.info.max_batch_keys
        with self._link() as link:
            for lo in range(0, len(keys), step):
                part = keys[lo : lo + step]
                _, hits, _, body = link.call(
                    w.request(w.Op.LOOKUP, count=len(part)), b"".join(part)
                )
                lengths += struct.unpack_from(f"<{hits}I", body)
                tiers += [self.info.tiers[i] for i in body[4 * hits : 5 * hits]]
                if hits < len(part):
                    break
        return LookupResult(len(tiers), tuple(tiers), tuple(lengths))

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        step = self.info.max_batch_keys
        with self._link() as link:
            for lo in range(0, len(keys), step):
                part = keys[lo : lo + step]
                n += link.call(w.request(w.Op.DELETE, count=len(part)), b"".join(part))[1]
        return n

    def put(
        self, keys: Sequence[ChunkKey], values: Sequence[Any], prefix: Sequence[ChunkKey] = ()
    ) -> PutResult:
        """Store values; runs of equal length that lie packed in one shared buffer go
        with no copy here, others through the scratch region.

        ``prefix``: the sequence's chunks before ``keys``, protected from eviction while
        the daemon makes room (its first ``max_batch_keys``: the head is what a lookup
        reaches). A run after the first also protects the runs before it. Dropped for a
        daemon that does not take prefixes.
        """
        if len(keys) != len(values):
            raise InputError(f"{len(keys)} keys for {len(values)} values")
        views = [memoryview(v).cast("B") for v in values]
        if any(not v.nbytes for v in views):
            raise InputError("empty values cannot be stored")
        totals = [0, 0, 0, 0]
        with self._link() as link:
            i = 0
            while i < len(views):
                size = views[i].nbytes
                per = max(1, min(self.info.max_batch_keys, self._request_bytes() // size))
                j = i + 1
                while j < len(views) and j - i < per and views[j].nbytes == size:
                    j += 1
                head: list[ChunkKey] = []
                if self.info.put_prefix:
                    head = [*prefix[: self.info.max_batch_keys], *keys[:i]]
                    head = head[: self.info.max_batch_keys]
                res = self._put_run(link, keys[i:j], views[i:j], size, head)
                for k, v in enumerate(res):
                    totals[k] += v
                i = j
        return PutResult(*totals)

    def _put_run(
        self,
        link: _Link,
        keys: Sequence[ChunkKey],
        views: list[memoryview],
        size: int,
        prefix: Sequence[ChunkKey] = (),
    ) -> tuple[int, ...]:
        n = len(views)
        first = address(views[0])
        packed = all(address(v) == first + k * size for k, v in enumerate(views))
        where = self._locate(views[0]) if packed else None
        if where is not None and where[0].offset_of(first, n * size) is not None:
            region, off = where
            link.map(region)
        else:
            region, off = self._scratch(link, n * size), 0
            dst = region.array
            for k, v in enumerate(views):
                dst[k * size : (k + 1) * size] = np.frombuffer(v, dtype=np.uint8)
        _, _, _, body = link.call(
            w.request(
                w.Op.PUT,
                region=region.rid,
                count=n,
                extra=len(prefix),
                offset=off,
                length=n * size,
            ),
            b"".join(keys) + b"".join(prefix),
        )
        return w.PUT_COUNTS.unpack_from(body)

    def get_into(self, keys: Sequence[ChunkKey], dst: memoryview) -> Fetched:
        """Copy the leading run of present values that fit whole into ``dst``, packed."""
        where = self._locate(dst)
        lengths: list[int] = []
        pos = 0
        step = self.info.max_batch_keys
        with self._link() as link:
            while len(lengths) < len(keys) and pos < dst.nbytes:
                part = keys[len(lengths) : len(lengths) + step]
                room = min(dst.nbytes - pos, self._request_bytes())
                if where is not None:
                    region, off = where[0], where[1] + pos
                    link.map(region)
                else:
                    region, off = self._scratch(link, room), 0
                _, got, nbytes, body = link.call(
                    w.request(
                        w.Op.GET, region=region.rid, count=len(part), offset=off, length=room
                    ),
                    b"".join(part),
                )
                if where is None and nbytes:
                    np.frombuffer(dst, dtype=np.uint8)[pos : pos + nbytes] = region.array[:nbytes]
                lengths += struct.unpack_from(f"<{got}I", body)
                pos += nbytes
                # A short run ends the get, unless it was cut by the request's size.
                if got < len(part) and (got == 0 or room == dst.nbytes - (pos - nbytes)):
                    break
        return Fetched(len(lengths), pos, tuple(lengths))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            shared, self._shared = self._shared, []
        for link in idle:
            link.close()
        for region in shared:
            region.close()
