"""glibc's malloc, tuned for a process that moves values of up to tens of MiB.

glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and gives it
back with ``munmap`` on free; the threshold starts at 128 KiB and rises only after a
larger mapped block is freed. Every body piece the HTTP server reads (64-256 KiB
``bytes``) and every value buffer above the threshold then costs a page fault per 4 KiB
page, which costs more than moving the bytes (docs/architecture.md). The daemon fixes
both thresholds at start-up instead of relying on what its first requests happen to
free: blocks up to 32 MiB (glibc's largest allowed threshold) come from the heap and are
reused, and up to 64 MiB of free heap top is kept before trimming.

Other C libraries (musl) and other systems: nothing is changed, with a debug line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def tune() -> bool:
    """Set the thresholds; True when glibc took them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("malloc: no mallopt in this C library; thresholds left as they are")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.debug("malloc: mallopt refused the thresholds; left as they are")
    return ok
