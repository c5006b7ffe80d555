"""I/O engines of the NVMe tier: one small interface, three implementations.

* ``posix``: ``O_DIRECT`` ``pwritev``/``preadv`` on page-aligned buffers over a thread
  pool (the calls release the GIL). Where the filesystem refuses ``O_DIRECT`` (EINVAL at
  open), it falls back to buffered I/O and says so in the log; durability then rests on
  ``fdatasync``, which the journal issues anyway.
* ``kvikio``: NVIDIA kvikio (cuFile): GPUDirect Storage where the driver allows it, and
  kvikio's own POSIX "compat mode" otherwise. Imported lazily; it needs libcuda even for
  host buffers, so ``auto`` picks it only where libcuda loads.
* io_uring was evaluated and dropped (docs/benchmarks.md, "NVMe tier"): it did not beat
  ``posix`` at the 4-64 MiB transfers this tier does.

An engine moves bytes between buffers and slab files; it knows nothing of chunks,
checksums or the journal. Every error is an ``OSError`` (the tier translates it once).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tiers.nvme.sums import PIECE_BYTES

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def buffer_address(buf: Any) -> int:
    """Address of the first byte of a buffer-protocol object."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data)


def is_aligned(buf: Any, align: int = PAGE) -> bool:
    """Whether a buffer's address and length suit O_DIRECT."""
    view = memoryview(buf)
    return view.nbytes % align == 0 and buffer_address(view) % align == 0


class BufferPool:
    """Reusable page-aligned anonymous buffers (``mmap`` memory is page aligned).

    Keeps freed buffers by size so steady-state I/O never faults in fresh pages.
    Thread-safe. Grows to the peak number of buffers in use at once.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> mmap.mmap:
        size = (nbytes + PAGE - 1) // PAGE * PAGE
        with self._lock:
            stack = self._free.get(size)
            if stack:
                return stack.pop()
        return mmap.mmap(-1, size)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.setdefault(len(buf), []).append(buf)

    def close(self) -> None:
        with self._lock:
            stacks, self._free = self._free, {}
        for stack in stacks.values():
            for buf in stack:
                # A numpy view may still point into it; then the GC unmaps it later.
                with contextlib.suppress(BufferError):
                    buf.close()


@dataclass(slots=True)
class IORequest:
    """One transfer between a buffer and a slab file.

    Attributes:
        file: index of the file, as returned by :meth:`IOEngine.open`.
        offset: byte offset in the file (page aligned).
        nbytes: bytes to move (page aligned).
        buffer: the memory, or None when ``prepare`` provides it.
        prepare: called before the transfer (on an engine thread for ``posix``): fills
            a write buffer, or returns the buffer to use. May return None.
        done: called after a successful transfer with the buffer (verify and copy out).
        release: called last whatever happened (return a pooled buffer).
        stream: called with ``(pos, piece)`` for each piece of the transfer, in order:
            after it lands (a read), before it goes (a write); a ``piece`` is the bytes
            at ``pos`` of the buffer. Only engines whose :meth:`IOEngine.streams` says so
            call it (the tier hashes chunks while they are in cache; see ``sums.py``).
    """

    file: int
    offset: int
    nbytes: int
    buffer: Any = None
    prepare: Callable[[], Any] | None = None
    done: Callable[[Any], None] | None = None
    release: Callable[[Any], None] | None = None
    stream: Callable[[int, Any], None] | None = None
    result: int = field(default=0)


class IOEngine(ABC):
    """Moves page-aligned bytes between buffers and files. Thread-safe.

    Args:
        threads: transfers in flight at once.
    """

    name = "abstract"

    def __init__(self, threads: int = 4) -> None:
        self.threads = max(1, threads)
        self.paths: list[Path] = []
        self.direct: list[bool] = []
        # One descriptor per open file, for fstat and fdatasync (and for the I/O itself
        # in the posix engine).
        self._fds: list[int] = []

    @abstractmethod
    def open(self, path: Path, *, direct: bool) -> int:
        """Open an existing file for reading and writing; returns its index.

        Raises:
            OSError: the file cannot be opened.
        """

    @abstractmethod
    def _run(self, reqs: Sequence[IORequest], writing: bool) -> None:
        """Run every request as a write (``writing``) or a read; blocks until all are done."""

    def write(self, reqs: Sequence[IORequest]) -> None:
        """Run every request as a write; blocks until all are done.

        Raises:
            OSError: the first failure (the others still ran to completion).
        """
        self._run(reqs, True)

    def read(self, reqs: Sequence[IORequest]) -> None:
        """Run every request as a read; a short read raises ``OSError(EIO)``."""
        self._run(reqs, False)

    def streams(self, file: int) -> bool:
        """Whether transfers on this file call their requests' ``stream`` per piece."""
        return False

    def sync(self) -> None:
        """``fdatasync`` every file (data and the device's write cache)."""
        for fd in self._fds:
            os.fdatasync(fd)

    def file_status(self, index: int) -> os.stat_result:
        """``fstat`` of an open file (the tier checks for deletion and truncation)."""
        return os.fstat(self._fds[index])

    @abstractmethod
    def close(self) -> None:
        """Close files and threads. Idempotent."""


class PosixEngine(IOEngine):
    """``O_DIRECT`` vectored I/O over a thread pool; buffered where O_DIRECT is refused."""

    name = "posix"

    def __init__(self, threads: int = 4) -> None:
        super().__init__(threads)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvtier-nvme")
        self._closed = False

    def _open_fd(self, path: Path, flags: int) -> int:
        """The one place files are opened (tests inject refusals here)."""
        return os.open(path, flags)

    def open(self, path: Path, *, direct: bool) -> int:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        use_direct = direct and O_DIRECT != 0
        fd = -1
        if use_direct:
            try:
                fd = self._open_fd(path, flags | O_DIRECT)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                log.warning(
                    "nvme: %s refuses O_DIRECT (%s); using buffered I/O plus fdatasync",
                    path,
                    exc.strerror,
                )
                use_direct = False
        if fd < 0:
            fd = self._open_fd(path, flags)
        self._fds.append(fd)
        self.paths.append(path)
        self.direct.append(use_direct)
        return len(self._fds) - 1

    def _pwrite(self, fd: int, buf: Any, offset: int) -> int:
        """The one place bytes are written (tests inject ENOSPC/EIO here)."""
        return os.pwritev(fd, [buf], offset)

    def _pread(self, fd: int, buf: Any, offset: int) -> int:
        """The one place bytes are read (tests inject EIO here)."""
        return os.preadv(fd, [buf], offset)

    def streams(self, file: int) -> bool:
        # Buffered files only: O_DIRECT transfers stay whole, as the device wants them
        # large, and their bytes do not pass through this CPU's cache anyway.
        return not self.direct[file]

    def _move(self, req: IORequest, view: memoryview, pos: int, writing: bool) -> None:
        """Transfer all of ``view``, the bytes at ``pos`` of the request's buffer."""
        fd = self._fds[req.file]
        done, end = 0, view.nbytes
        while done < end:  # a short transfer is legal; carry on from where it stopped
            part = view[done:]
            at = req.offset + pos + done
            n = self._pwrite(fd, part, at) if writing else self._pread(fd, part, at)
            if n <= 0:
                raise OSError(
                    errno.EIO,
                    f"short {'write' if writing else 'read'} at {at}"
                    f" of {self.paths[req.file]} (truncated?)",
                )
            done += n

    def _one(self, req: IORequest, writing: bool) -> None:
        buf = req.buffer
        try:
            if req.prepare is not None:
                got = req.prepare()
                if got is not None:
                    buf = got
            view = memoryview(buf)[: req.nbytes]
            stream = req.stream if self.streams(req.file) else None
            step = PIECE_BYTES if stream is not None else max(req.nbytes, 1)
            for pos in range(0, req.nbytes, step):
                piece = view[pos : pos + step]
                if writing and stream is not None:
                    stream(pos, piece)
                self._move(req, piece, pos, writing)
                if not writing and stream is not None:
                    stream(pos, piece)
            req.result = req.nbytes
            if req.done is not None:
                req.done(buf)
        finally:
            if req.release is not None:
                req.release(buf)

    def _run(self, reqs: Sequence[IORequest], writing: bool) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "engine closed")
        futs: list[Future[None]] = []
        inline: list[IORequest] = []
        for r in reqs[:-1]:
            if not inline:
                try:
                    futs.append(self._pool.submit(self._one, r, writing))
                    continue
                except RuntimeError:
                    # At interpreter exit the pool takes no new work, yet a store closed by
                    # an exit hook (vLLM's engine finalizer) still persists: run the rest here.
                    pass
            inline.append(r)
        # The last request (the only one, often) runs on this thread, which would
        # otherwise only wait: one hand-off fewer, and this core moves bytes too.
        inline.append(reqs[-1])
        first: BaseException | None = None
        for r in inline:
            try:
                self._one(r, writing)
            except BaseException as err:
                first = first or err
        for f in futs:
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


class KvikioEngine(IOEngine):
    """kvikio ``CuFile`` handles: GDS where cuFile allows it, kvikio's compat mode otherwise.

    Buffers may be host memory or CUDA device memory (anything kvikio accepts).
    """

    name = "kvikio"

    def __init__(self, threads: int = 4) -> None:
        super().__init__(threads)
        try:
            # defaults and cufile_driver are submodules that kvikio's package does not
            # import itself (26.x): a bare ``import kvikio`` leaves them unbound.
            import kvikio
            import kvikio.cufile_driver
            import kvikio.defaults
        except ImportError as exc:  # translated by the tier into a ConfigError
            raise OSError(errno.ENOSYS, f"kvikio is not usable: {exc}") from exc
        self._kvikio = kvikio
        # kvikio splits each transfer over its own pool: give it as many threads as posix.
        # In compat mode it writes with O_DIRECT but reads through the page cache unless
        # told otherwise; the tier's reads must come from the device, as posix's do (else
        # they are page-cache hits that say nothing of the disk).
        for setting, val in (("thread_pool_nthreads", self.threads), ("auto_direct_io_read", True)):
            try:
                kvikio.defaults.set(setting, val)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                log.info("nvme: kvikio keeps its own %s (%s)", setting, exc)
        self._files: list[Any] = []

    @property
    def compat_mode(self) -> str:
        """kvikio's compat mode setting (ON: POSIX I/O only, OFF: cuFile only, AUTO)."""
        return str(self._kvikio.defaults.get("compat_mode"))

    @property
    def gds_available(self) -> bool:
        """Whether the cuFile driver reports GPUDirect Storage as usable."""
        try:
            return bool(self._kvikio.cufile_driver.get("is_gds_available"))
        except (RuntimeError, AttributeError):
            return False

    def open(self, path: Path, *, direct: bool) -> int:
        self._files.append(self._kvikio.CuFile(str(path), "r+"))
        self._fds.append(os.open(path, os.O_RDONLY))  # for fstat and fdatasync only
        self.paths.append(path)
        self.direct.append(direct)
        return len(self._files) - 1

    def _run(self, reqs: Sequence[IORequest], writing: bool) -> None:
        futs = []
        bufs = []
        try:
            for req in reqs:
                buf = req.buffer
                if req.prepare is not None:
                    got = req.prepare()
                    if got is not None:
                        buf = got
                bufs.append(buf)
                f = self._files[req.file]
                op = f.pwrite if writing else f.pread
                futs.append(op(buf, req.nbytes, req.offset))
            for req, fut, buf in zip(reqs, futs, bufs, strict=True):
                n = int(fut.get())
                if n != req.nbytes:
                    raise OSError(errno.EIO, f"kvikio moved {n} of {req.nbytes} bytes")
                req.result = n
                if req.done is not None:
                    req.done(buf)
        except RuntimeError as exc:  # kvikio raises RuntimeError for I/O failures
            raise OSError(errno.EIO, f"kvikio: {exc}") from exc
        finally:
            for req, buf in zip(reqs, bufs, strict=False):
                if req.release is not None:
                    req.release(buf)

    def close(self) -> None:
        for f in self._files:
            f.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files, self._fds = [], []


def libcuda_loads() -> bool:
    """Whether the CUDA driver library can be loaded (kvikio fails every call without it)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def kvikio_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("kvikio") is not None


def make_engine(name: str, threads: int) -> IOEngine:
    """The engine a config names; ``auto`` is kvikio where libcuda and a working kvikio exist,
    else posix.

    Raises:
        OSError: kvikio asked for but not importable.
    """
    if name == "auto":
        if libcuda_loads() and kvikio_importable():
            try:
                return KvikioEngine(threads)
            except OSError as exc:
                # An installed kvikio that does not work here (a version whose API moved, a
                # broken install) costs GPU-direct I/O, not the tier: posix serves the same files.
                log.warning("nvme: kvikio unusable (%s); using the posix engine", exc)
        name = "posix"
    if name == "kvikio":
        return KvikioEngine(threads)
    if name == "posix":
        return PosixEngine(threads)
    raise ValueError(f"unknown engine {name!r}")
