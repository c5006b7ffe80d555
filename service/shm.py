"""The daemon's same-host channel: values through client-owned shared memory.

A client on the daemon's host (:mod:`kvtier.service.shm_client`) connects to a Unix
seqpacket socket (``service.socket``), authenticates with the same bearer token as
over HTTP, and hands the daemon file descriptors of memory it created itself (sealed
memfds, ``SCM_RIGHTS``). Requests then carry keys and (offset, length) ranges into
that memory (:mod:`kvtier.service.shm_wire`); the bytes never cross the socket, and the
store copies them once: a put from the client's mapping into a tier, a get from a tier
into the client's mapping.

Security, as strong as HTTP's (a client only ever maps memory meant for it):

* the daemon maps only descriptors a client sent on its own connection, and a region
  id names a mapping of that connection only; the daemon never hands out its memory;
* the socket sits in a directory of mode 0700, and a peer of another user id (other
  than root) is refused (``SO_PEERCRED``);
* the tenant comes from the token (:class:`~kvtier.service.tenants.Authenticator`), and
  keys are salted per tenant (:class:`~kvtier.service.tenants.KeyMapper`) exactly as
  over HTTP, so two tokens never see each other's chunks;
* a descriptor must be a memfd sealed against shrinking (``F_SEAL_SHRINK``): a client
  truncating its memory under the daemon's mapping would otherwise kill the daemon with
  SIGBUS. Anything else is refused, and the connection keeps serving.

Threads: one accepting thread and one thread per connection, calling the (thread-safe)
store directly; nothing runs on the event loop. Limits are the daemon's: keys per
request (``max_batch_keys``), bytes per request (``max_body_bytes``), value size
(``max_value_bytes``), bytes of requests in flight together (``max_inflight_bytes``),
plus the size of one mapping (``socket_max_region_bytes``) and :data:`MAX_CONNECTIONS`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ClosedError, InputError, KVTierError
from kvtier.files import make_private_dirs
from kvtier.keys import ChunkKey
from kvtier.tiers.memory import owner_pid, pid_alive, populate

from . import shm_wire as w
from .core import RequestCore
from .tenants import Tenant

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
"""Connections served at once; one more is refused (one thread each)."""
AUTO = "auto"
SOCKET_NAME = "daemon.sock"
_LEGACY_NAME = re.compile(r"kvtier-[^-]{8}")  # before the pid: mkdtemp's 8 random characters
_PEERCRED = struct.Struct("3i")


class Refused(Exception):
    """A request the daemon refuses; the connection keeps serving."""

    def __init__(self, status: w.Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def socket_path(setting: str) -> tuple[Path, Path | None] | None:
    """Where ``service.socket`` puts the socket, and the directory the daemon owns.

    ``""`` turns the channel off; ``"auto"`` makes a fresh private directory in
    ``$XDG_RUNTIME_DIR`` (or the system's temp dir), removed at shutdown; a path is used
    as it is, its directory created with mode 0700 if missing.
    """
    if not setting:
        return None
    if setting == AUTO:
        base = os.environ.get("XDG_RUNTIME_DIR") or None
        if base is not None and not os.access(base, os.W_OK):
            base = None
        base_dir = Path(base or tempfile.gettempdir())
        sweep_stale_socket_dirs(base_dir)
        # The pid in the name lets a later daemon sweep this folder if this one is killed.
        own = Path(tempfile.mkdtemp(prefix=f"kvtier-{os.getpid()}-", dir=base_dir))  # 0700
        return own / SOCKET_NAME, own
    path = Path(setting).expanduser()
    make_private_dirs(path.parent)
    return path, None


def sweep_stale_socket_dirs(base: Path) -> int:
    """Remove socket folders left in ``base`` by daemons that died without closing.

    A SIGKILLed daemon cannot remove the private folder ``"auto"`` made for its socket.
    A folder is removed only when all of these hold: it is ours (uid), it holds nothing
    but the socket, nobody listens on that socket (a live daemon of another pid
    namespace still answers), and either it is named ``kvtier-<pid>-...`` with that pid
    gone, or it has the name earlier versions gave (``kvtier-`` and 8 random characters,
    no pid) and its socket is there. Returns how many folders were removed.
    """
    removed = 0
    uid = os.getuid()
    for d in base.glob("kvtier-*"):
        pid = owner_pid(d.name)
        # An earlier name says nothing of whose it was: only its dead socket says stale.
        legacy = pid is None and _LEGACY_NAME.fullmatch(d.name) is not None
        if (pid is None and not legacy) or (pid is not None and pid_alive(pid)):
            continue
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            if any(entry.name != SOCKET_NAME for entry in os.scandir(d)):
                continue
            sock = d / SOCKET_NAME
            if (legacy and not sock.exists()) or _listening(sock):
                continue
            sock.unlink(missing_ok=True)
            d.rmdir()  # fails if anything appeared meanwhile: then it is not stale
            removed += 1
        except OSError:  # gone already, or not ours to remove
            continue
    if removed:
        log.info("removed %d socket folder(s) left by dead daemons in %s", removed, base)
    return removed


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # a timeout, a wrong socket type: leave it alone
            return True
        return True


@dataclass
class _Mapping:
    """One mapping of a client's memfd, shared by every connection that hands it over."""

    mm: mmap.mmap
    key: tuple[int, int, int]  # (st_dev, st_ino, length)
    users: int = 0


@dataclass
class _Region:
    """A connection's region: its own view of a shared :class:`_Mapping`."""

    mapping: _Mapping
    view: memoryview
    owner: _Mappings

    def close(self) -> None:
        try:
            self.view.release()
        except BufferError:  # a store thread still holds a slice: the GC unmaps it later
            log.debug("same-host region still exported at close; left to the GC")
        self.owner.release(self.mapping)


class _Mappings:
    """The daemon's mappings of client memory: one per memfd (and length), however many
    of the client's connections use it. A client pools connections and each maps the
    regions it uses; mapped once, the pages are populated once (see :meth:`open`) and
    page tables are not duplicated per connection. Thread-safe.

    Keyed by the memfd's inode: two connections that hand over the same memfd both hold
    a descriptor of it, so sharing the daemon's mapping gives neither anything new; an
    inode cannot be reused while a mapping of it lives.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int, int], _Mapping] = {}

    def open(self, fd: int, st: os.stat_result, length: int) -> _Region:
        """A region over the mapping of ``fd`` (checked by the caller), mapped if new.

        Raises:
            OSError, ValueError: the memfd cannot be mapped.
        """
        key = (st.st_dev, st.st_ino, length)
        with self._lock:
            m = self._maps.get(key)
            if m is not None:
                m.users += 1
                return _Region(m, memoryview(m.mm), self)
        mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # The page tables are filled now, off every request's clock: a store's first
        # write into a lazily mapped shared page faults, one 4 KiB page at a time
        # (docs/architecture.md, "Memory that is already faulted in"). Only when the
        # client has allocated all its memory (as kvtier's client does): mapping never
        # makes the daemon allocate the holes of a sparse memfd. Outside the lock:
        # populating a large region takes long enough to hold up other connections.
        if st.st_blocks * 512 >= st.st_size:
            populate(mm)
        with self._lock:
            m = self._maps.get(key)
            if m is None:
                m = self._maps[key] = _Mapping(mm, key)
            else:  # another connection mapped it meanwhile
                mm.close()
            m.users += 1
            return _Region(m, memoryview(m.mm), self)

    def release(self, m: _Mapping) -> None:
        with self._lock:
            m.users -= 1
            if m.users > 0:
                return
            if self._maps.get(m.key) is m:
                del self._maps[m.key]
        try:
            m.mm.close()
        except BufferError:  # a slice is still held: the GC unmaps it later
            log.debug("same-host mapping still exported at close; left to the GC")


class _Metrics:
    """Requests and bytes of the channel, by op and status. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[tuple[str, str], int] = {}
        self._bytes: dict[str, int] = {}
        self.connections = 0

    def observe(self, op: str, status: str, nbytes: int) -> None:
        with self._lock:
            self._count[(op, status)] = self._count.get((op, status), 0) + 1
            self._bytes[op] = self._bytes.get(op, 0) + nbytes

    def exposition(self) -> list[str]:
        with self._lock:
            count, nbytes, conns = dict(self._count), dict(self._bytes), self.connections
        out = [
            "# HELP kvtier_same_host_requests_total Same-host (shared memory) requests by op"
            " and status.",
            "# TYPE kvtier_same_host_requests_total counter",
        ]
        out += [
            f'kvtier_same_host_requests_total{{op="{op}",status="{st}"}} {n}'
            for (op, st), n in sorted(count.items())
        ]
        out += [
            "# HELP kvtier_same_host_bytes_total Value bytes moved through shared memory, by op.",
            "# TYPE kvtier_same_host_bytes_total counter",
        ]
        out += [
            f'kvtier_same_host_bytes_total{{op="{op}"}} {n}' for op, n in sorted(nbytes.items())
        ]
        out += [
            "# HELP kvtier_same_host_connections Same-host connections open.",
            "# TYPE kvtier_same_host_connections gauge",
            f"kvtier_same_host_connections {conns}",
        ]
        return out


class SameHostServer:
    """Serves the same-host channel of one daemon until :meth:`close`.

    Args:
        core: the daemon's request core (its token check; its daemon: store, tenants, limits).
        path: the socket's path (an existing file there is replaced).
        own_dir: a directory the server made for the socket and removes at close.
        max_region_bytes: the largest mapping a client may hand over.
        auth_timeout_s: how long a connection may take to authenticate before it is closed.

    Raises:
        OSError: the socket cannot be bound.
    """

    def __init__(
        self,
        core: RequestCore,
        path: Path,
        own_dir: Path | None,
        max_region_bytes: int,
        auth_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.auth_timeout_s = auth_timeout_s
        self.d = d = core.d
        self.path = path
        self._own_dir = own_dir
        self.max_region_bytes = max_region_bytes
        self.metrics = _Metrics()
        self._mappings = _Mappings()
        self._max_request = w.max_request_bytes(d.limits.max_batch_keys)
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stop = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(str(path))
            os.chmod(path, 0o600)
            self._listener.listen(64)
            self._listener.settimeout(0.25)  # the accept loop checks _stop this often
        except OSError:
            self._listener.close()
            raise
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="kvtier-shm-accept", daemon=True
        )
        self._acceptor.start()

    @classmethod
    def start(
        cls, core: RequestCore, setting: str, max_region_bytes: int, auth_timeout_s: float = 10.0
    ) -> SameHostServer | None:
        """The server ``service.socket`` asks for; None when off or when it cannot bind
        (logged: the daemon then serves HTTP only)."""
        try:
            where = socket_path(setting)
            if where is None:
                return None
            server = cls(core, where[0], where[1], max_region_bytes, auth_timeout_s)
        except (OSError, KVTierError) as exc:
            log.warning("same-host socket %r not available, serving HTTP only: %s", setting, exc)
            return None
        log.info("same-host socket (shared memory) at %s", server.path)
        return server

    def close(self, timeout_s: float) -> None:
        """Stop accepting, end every connection (requests in progress finish first, up
        to ``timeout_s``), remove the socket. Blocking; call before closing the store."""
        self._stop.set()
        self._acceptor.join()
        self._listener.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)  # wakes its thread's recvmsg
        deadline = time.monotonic() + timeout_s
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    # -- connections -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("same-host accept failed: %s", exc)
                time.sleep(0.1)
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name="kvtier-shm", daemon=True
                    )
                    self._conns[conn] = thread
                    self.metrics.connections = len(self._conns)
            if full:
                self._send(conn, w.Status.BUSY, f"{MAX_CONNECTIONS} connections already open")
                conn.close()
                continue
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        regions: dict[int, _Region] = {}
        try:
            if not self._peer_allowed(conn):
                return
            tenant: Tenant | None = None
            # Until it authenticates, a connection holds its slot only this long, however
            # many messages it sends; then it is closed.
            deadline = time.monotonic() + self.auth_timeout_s
            while not self._stop.is_set():
                if tenant is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.debug("closing a same-host connection that did not authenticate")
                        return
                    conn.settimeout(left)
                try:
                    msg, anc, flags, _ = conn.recvmsg(
                        self._max_request + 1,
                        socket.CMSG_SPACE(4),
                        socket.MSG_CMSG_CLOEXEC,
                    )
                except OSError:  # TimeoutError too: no HELLO in time
                    return
                # Descriptors are ours from here on, whatever the message: an empty one
                # (which also ends the connection) may carry them too.
                fds = _fds(anc)
                try:
                    if not msg:
                        return  # the client closed (or died), or shutdown woke us
                    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                        raise Refused(w.Status.TOO_LARGE, "frame or descriptors over the bound")
                    authenticated = tenant is not None
                    tenant = self._handle(conn, msg, fds, tenant, regions)
                    if not authenticated and tenant is not None:
                        conn.settimeout(None)
                except (Refused, KVTierError) as exc:
                    # A store failure (closing, a sync commit on a full disk) is the
                    # client's retryable error, as HTTP's 503; the connection stays.
                    status = (
                        exc.status
                        if isinstance(exc, Refused)
                        else w.Status.CLOSED
                        if isinstance(exc, ClosedError)
                        else w.Status.BUSY
                    )
                    self.metrics.observe(_op_name(msg), status.name.lower(), 0)
                    if not self._send(conn, status, str(exc)):
                        return
                    if status is w.Status.UNAUTHORIZED and tenant is None:
                        return  # a refused token gets no second guess on this connection
                finally:
                    for fd in fds:
                        os.close(fd)
        except Exception:  # one connection's bug must never take the daemon down
            log.exception("same-host connection failed")
        finally:
            for r in regions.values():
                r.close()
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._conns.pop(conn, None)
                self.metrics.connections = len(self._conns)

    def _peer_allowed(self, conn: socket.socket) -> bool:
        try:
            pid, uid, _gid = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
        except OSError as exc:
            log.warning("same-host peer credentials unreadable, refusing: %s", exc)
            return False
        if uid not in (os.geteuid(), 0):
            log.warning("same-host peer pid %d of uid %d refused (not this user)", pid, uid)
            self._send(conn, w.Status.UNAUTHORIZED, "a peer of another user")
            return False
        return True

    def _send(self, conn: socket.socket, status: w.Status, message: str) -> bool:
        return _sendall(conn, w.reply(status) + message.encode()[:512])

    # -- requests ----------------------------------------------------------------------------

    def _handle(
        self,
        conn: socket.socket,
        msg: bytes,
        fds: list[int],
        tenant: Tenant | None,
        regions: dict[int, _Region],
    ) -> Tenant | None:
        if len(msg) < w.REQUEST.size:
            raise Refused(w.Status.BAD_REQUEST, f"a frame of {len(msg)} B; the header is longer")
        magic, op_raw, _, region, count, extra, offset, length = w.REQUEST.unpack_from(msg)
        if magic != w.MAGIC:
            raise Refused(w.Status.BAD_REQUEST, "bad magic")
        try:
            op = w.Op(op_raw)
        except ValueError:
            raise Refused(w.Status.BAD_REQUEST, f"unknown op {op_raw}") from None
        if fds and op is not w.Op.MAP:
            raise Refused(w.Status.BAD_REQUEST, "descriptors only come with MAP")
        payload = msg[w.REQUEST.size :]
        if op is w.Op.HELLO:
            if tenant is not None:
                raise Refused(w.Status.BAD_REQUEST, "HELLO twice")
            t = self.core.tenant(f"Bearer {payload.decode('utf-8', 'replace')}")
            if t is None:
                raise Refused(w.Status.UNAUTHORIZED, "a valid bearer token is required")
            info = {
                "tiers": [tier.name for tier in self.d.store.tiers],
                "max_value_bytes": self.d.limits.max_value_bytes,
                "max_request_bytes": self.d.limits.max_body_bytes,
                "max_batch_keys": self.d.limits.max_batch_keys,
                "max_region_bytes": self.max_region_bytes,
                "put_prefix": True,
            }
            self.metrics.observe("hello", "ok", 0)
            _sendall(conn, w.reply(w.Status.OK) + json.dumps(info).encode())
            return t
        if tenant is None:
            raise Refused(w.Status.UNAUTHORIZED, "HELLO with a token first")
        if op is w.Op.MAP:
            self._map(fds, region, length, regions)
            reply = w.reply(w.Status.OK)
        elif op is w.Op.UNMAP:
            r = regions.pop(region, None)
            if r is not None:
                r.close()
            reply = w.reply(w.Status.OK)
        else:
            split = count * w.KEY_BYTES
            keys = self._keys(payload[:split], count)
            prefix = self._keys(payload[split:], extra)  # also refuses bytes past the keys
            if prefix and op is not w.Op.PUT:
                raise Refused(w.Status.BAD_REQUEST, f"only PUT takes prefix keys ({extra} given)")
            ikeys = self.d.mapper.map(tenant, keys)
            iprefix = self.d.mapper.map(tenant, prefix) if prefix else []
            if op is w.Op.LOOKUP:
                reply = self._lookup(tenant, ikeys)
            elif op is w.Op.DELETE:
                reply = w.reply(w.Status.OK, count=self.d.store.delete(ikeys))
            else:
                view = self._range(regions, region, offset, length)
                if not self._take(length):
                    raise Refused(
                        w.Status.BUSY,
                        f"requests in flight are at the daemon's bound of "
                        f"{self.d.budget.limit_bytes} B (service.max_inflight_bytes); retry",
                    )
                try:
                    if op is w.Op.PUT:
                        reply = self._put(tenant, ikeys, view, iprefix)
                    else:
                        reply = self._get(tenant, ikeys, view)
                finally:
                    self._take(-length)
                    view.release()
        self.metrics.observe(op.name.lower(), "ok", length if op in (w.Op.PUT, w.Op.GET) else 0)
        _sendall(conn, reply)
        return tenant

    def _take(self, n: int) -> bool:
        with self._lock:
            if n > 0 and self._inflight_bytes + n > self.d.budget.limit_bytes:
                return False
            self._inflight_bytes += n
            return True

    def _keys(self, payload: bytes, count: int) -> list[ChunkKey]:
        if count > self.d.limits.max_batch_keys:
            raise Refused(
                w.Status.TOO_LARGE,
                f"{count} keys; the limit is {self.d.limits.max_batch_keys} "
                "(service.max_batch_keys)",
            )
        if len(payload) != count * w.KEY_BYTES:
            raise Refused(w.Status.BAD_REQUEST, f"{len(payload)} B of keys for {count} keys")
        return [ChunkKey(payload[i : i + w.KEY_BYTES]) for i in range(0, len(payload), w.KEY_BYTES)]

    def _map(self, fds: list[int], region: int, length: int, regions: dict[int, _Region]) -> None:
        if len(fds) != 1:
            raise Refused(w.Status.BAD_REQUEST, f"MAP takes one descriptor, got {len(fds)}")
        if not 0 < length <= self.max_region_bytes:
            raise Refused(
                w.Status.TOO_LARGE,
                f"a region of {length} B; the daemon maps 1..{self.max_region_bytes} B "
                "(service.socket_max_region_bytes)",
            )
        if region not in regions and len(regions) >= w.MAX_REGIONS:
            raise Refused(w.Status.BAD_REQUEST, f"{w.MAX_REGIONS} regions already mapped")
        fd = fds[0]
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise Refused(w.Status.BAD_REQUEST, "the descriptor is not a sealed memfd") from None
        if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
            raise Refused(w.Status.BAD_REQUEST, "the descriptor must be a memfd with F_SEAL_SHRINK")
        if st.st_size < length:
            raise Refused(w.Status.BAD_REQUEST, f"the memfd holds {st.st_size} B, not {length}")
        try:
            new = self._mappings.open(fd, st, length)
        except (OSError, ValueError) as exc:
            raise Refused(w.Status.BAD_REQUEST, f"the memfd cannot be mapped: {exc}") from None
        old = regions.pop(region, None)
        if old is not None:
            old.close()
        regions[region] = new

    def _range(
        self, regions: dict[int, _Region], region: int, offset: int, length: int
    ) -> memoryview:
        r = regions.get(region)
        if r is None:
            raise Refused(w.Status.BAD_REQUEST, f"region {region} is not mapped")
        if length > self.d.limits.max_body_bytes:
            raise Refused(
                w.Status.TOO_LARGE,
                f"a request of {length} B; the limit is {self.d.limits.max_body_bytes} B "
                "(service.max_body_bytes)",
            )
        if offset + length > r.view.nbytes:
            raise Refused(w.Status.BAD_REQUEST, "the range lies outside the region")
        return r.view[offset : offset + length]

    def _lookup(self, tenant: Tenant, ikeys: list[ChunkKey]) -> bytes:
        res = self.core.lookup_now(tenant, ikeys)
        names = [t.name for t in self.d.store.tiers]
        index = bytes(names.index(n) for n in res.tiers)
        lengths = struct.pack(f"<{res.hits}I", *res.value_bytes)
        return w.reply(w.Status.OK, count=res.hits) + lengths + index

    def _put(
        self, tenant: Tenant, ikeys: list[ChunkKey], view: memoryview, iprefix: list[ChunkKey]
    ) -> bytes:
        n = len(ikeys)
        if not n or not view.nbytes or view.nbytes % n:
            raise Refused(w.Status.BAD_REQUEST, f"{view.nbytes} B do not split into {n} values")
        size = view.nbytes // n
        if size > self.d.limits.max_value_bytes:
            raise Refused(
                w.Status.TOO_LARGE,
                f"values of {size} B; the limit is {self.d.limits.max_value_bytes} B "
                "(service.max_value_bytes)",
            )
        if len(set(ikeys)) != n:
            raise Refused(w.Status.BAD_REQUEST, "a request names the same key twice")
        try:
            res = self.core.put_now(tenant, ikeys, view, iprefix)
        except InputError as exc:
            raise Refused(w.Status.BAD_REQUEST, str(exc)) from None
        return w.reply(w.Status.OK) + w.PUT_COUNTS.pack(
            res.stored, res.present, res.rejected, res.failed
        )

    def _get(self, tenant: Tenant, ikeys: list[ChunkKey], view: memoryview) -> bytes:
        res = self.core.get_into_now(tenant, ikeys, view)
        return w.reply(w.Status.OK, count=res.chunks, nbytes=res.nbytes) + struct.pack(
            f"<{res.chunks}I", *res.value_bytes
        )


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += struct.unpack(f"{usable // 4}i", data[:usable])
    return fds


def _op_name(msg: bytes) -> str:
    try:
        return w.Op(msg[4]).name.lower() if len(msg) > 4 and msg[:4] == w.MAGIC else "invalid"
    except ValueError:
        return "invalid"


def _sendall(conn: socket.socket, data: bytes) -> bool:
    """One reply, one message (seqpacket); False when the client is gone."""
    try:
        conn.sendall(data)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN):
            log.debug("same-host reply not sent: %s", exc)
        return False
    return True
