"""A host memory arena in POSIX shared memory, optionally NUMA-bound and CUDA-pinned.

The arena is a file in ``/dev/shm`` mapped into this process, so engine workers (or a
daemon's clients on the same host) can map the same bytes by path. Pages are taken as
the tier fills (``prefault`` faults them all in at start-up instead, so the first copies
run at memcpy speed, at the price of the whole arena's memory from the first second).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import secrets
import shutil
import weakref
from pathlib import Path

import numpy as np

from kvtier.enums import Switch
from kvtier.errors import TierIOError
from kvtier.tiers import numa

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate(mm: mmap.mmap) -> bool:
    """Fault every page of ``mm`` in for writing, without holding the GIL: ctypes lets
    it go around the call, where ``mmap.mmap(..., MAP_POPULATE)`` and ``mm.madvise``
    hold it (populating a large arena at once stalled every thread of the daemon, its
    event loop too). False where the kernel refuses the advice (before 5.14): the pages
    then fault in on first use."""
    anchor = ctypes.c_char.from_buffer(mm)  # an export of ``mm``, gone with ``anchor``
    try:
        if _libc.madvise(ctypes.addressof(anchor), len(mm), _MADV_POPULATE_WRITE) == 0:
            return True
        log.debug("populate refused: madvise errno %d", ctypes.get_errno())
        return False
    finally:
        del anchor


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def owner_pid(name: str) -> int | None:
    """The pid in a ``kvtier-<pid>-...`` name (arenas, the daemon's socket folders): the
    process that made it, whose death makes it garbage. None for any other name."""
    parts = name.split("-", 2)
    if len(parts) < 3 or parts[0] != "kvtier" or not parts[1].isdigit():
        return None
    return int(parts[1])


def sweep_stale_arenas(base: Path = SHM_DIR) -> int:
    """Remove arenas left in ``base`` by kvtier processes that died without closing them.

    A SIGKILLed process cannot unlink its shared-memory file, and tmpfs keeps it (and its
    RAM) until someone does. Arena names carry the creating pid, so a file whose process
    is gone is garbage. Returns how many files were removed.
    """
    removed = 0
    for f in base.glob("kvtier-*-*"):
        pid = owner_pid(f.name)
        if pid is None or pid_alive(pid):
            continue
        try:
            f.unlink()
            removed += 1
        except OSError:  # another process swept it first, or not ours to remove
            continue
    if removed:
        log.info("removed %d shared-memory arena(s) left by dead processes in %s", removed, base)
    return removed


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _cuda_driver_present() -> bool:
    """Whether the NVIDIA driver library loads: a cheap test before importing torch."""
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    except OSError:
        return False
    return True


class SharedArena:
    """``size_bytes`` of shared memory as a flat ``uint8`` numpy array.

    Args:
        size_bytes: arena size.
        label: part of the shm file name, for operators reading ``/dev/shm``.
        numa_node: bind the pages to this node, or None to leave placement to the kernel.
        pin: register the pages with CUDA (page-locked) so GPU copies run at full speed.
        prefault: touch every page now rather than on first write.
    """

    def __init__(
        self,
        size_bytes: int,
        label: str,
        *,
        numa_node: int | None = None,
        pin: Switch = Switch.AUTO,
        prefault: bool = False,
    ) -> None:
        base = SHM_DIR if SHM_DIR.is_dir() else Path("/tmp")
        sweep_stale_arenas(base)
        safe = "".join(c if c.isalnum() else "-" for c in label)
        self.path = base / f"kvtier-{os.getpid()}-{next(_counter)}-{safe}-{secrets.token_hex(3)}"
        self.size_bytes = size_bytes
        self.pinned = False
        # tmpfs grants a larger file than it can back; touching the missing pages later
        # kills the process with SIGBUS. Refuse up front, with a reason.
        free = shutil.disk_usage(base).free
        if free < size_bytes:
            raise TierIOError(
                f"{base} has {free} bytes free, the {label!r} arena needs {size_bytes}: "
                "lower capacity_bytes or enlarge /dev/shm"
            )
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size_bytes)
                self._mm = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            raise TierIOError(
                f"cannot create a {size_bytes}-byte arena at {self.path}: {exc}"
            ) from exc
        # A process that exits without close() still removes its file (at interpreter
        # exit); only a killed one leaves it, for the next arena's sweep.
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        if numa_node is not None:
            numa.bind(self.address, size_bytes, numa_node)
        if prefault:
            self._prefault()
        if pin is not Switch.OFF:
            self._pin(required=pin is Switch.ON)

    def _prefault(self) -> None:
        if not populate(self._mm):
            self.array[::4096] = 0  # one write per page faults it in

    def _pin(self, *, required: bool) -> None:
        if not required and not _cuda_driver_present():
            return  # importing torch (seconds) only to find no GPU is not worth it
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(self.address, self.size_bytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister returned {rc}")
            self.pinned = True
        except (ImportError, RuntimeError, AttributeError) as exc:
            if required:
                raise TierIOError(f"pinning the host arena failed: {exc}") from exc
            log.debug("host arena not pinned: %s", exc)

    def close(self) -> None:
        """Unmap and remove the shared-memory file. Idempotent."""
        if getattr(self, "_mm", None) is None:
            return
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)  # type: ignore[no-untyped-call]
            self.pinned = False
        del self.array
        try:
            self._mm.close()
        except BufferError:  # a view still exported; the mapping dies with the process
            log.debug("arena %s still has exported views at close", self.path)
        self._mm = None  # type: ignore[assignment]
        self._finalizer()  # unlinks the file, once
