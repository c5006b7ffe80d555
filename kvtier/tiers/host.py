"""The ``host`` tier: DRAM in shared memory, CUDA-pinned where present, NUMA-bound on request."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from kvtier._native import native_enabled
from kvtier.enums import Switch
from kvtier.errors import ConfigError
from kvtier.tiers.base import SlotRun, TierGeometry, TierProfile, TierSection, ViewableTier
from kvtier.tiers.economics import DDR5_HOST
from kvtier.tiers.memory import SharedArena

try:
    from kvtier._speedups import copy as _copy_c
except ImportError:  # built without a C compiler: numpy copies every value
    _copy_c = None
try:
    if not native_enabled():
        raise ImportError("KVTIER_NATIVE turns the C core off")
    from kvtier._core import copy_slots as _copy_slots
except ImportError:  # built without a C compiler, or turned off: Tier.write and copy_in
    _copy_slots = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "host"`` options."""

    # Bind the arena to this NUMA node; unset leaves placement to the kernel.
    numa_node: int | None = None
    # Page-lock the arena with cudaHostRegister: auto (when CUDA is present), on, off.
    pin: Switch = Switch.AUTO
    # Fault every page in at start-up, so first writes run at memcpy speed. Off by
    # default: the arena then takes memory as it fills, not all of it at start.
    prefault: bool = False
    # Threads that share one large copy (>= 4 MiB); 1 copies on the calling I/O thread
    # only; 0 picks one per 4 usable cores, 1 to 4 (:func:`auto_copy_threads`).
    copy_threads: int = 0

    def __post_init__(self) -> None:
        if self.copy_threads < 0:
            raise ConfigError(
                "copy_threads", self.copy_threads, "0 (one per 4 cores) or a thread count"
            )


# Copies at least this large are split across threads: one core's memcpy leaves DRAM
# bandwidth unused (bench/host.py measured 1.7x at 64 MiB with two threads).
PARALLEL_COPY_BYTES = 4 << 20
MAX_AUTO_COPY_THREADS = 4
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_workers = 0
_copy_pool_lock = threading.Lock()


def auto_copy_threads(cores: int | None = None) -> int:
    """``copy_threads = 0``: one thread per 4 usable cores (``cores``, by default those
    this process may run on), at least 1 and at most :data:`MAX_AUTO_COPY_THREADS`.

    One core's memcpy leaves DRAM bandwidth unused, but the cores also serve the I/O
    threads and whatever shares the host (an inference engine): a quarter of them, and
    no split at all below 8 cores, where a split measured no gain under shared load.
    """
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_COPY_THREADS, cores // 4))


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's copy helpers, at least ``threads - 1`` of them (the caller copies a
    piece itself). Shared by every host tier; a tier that asks for more than the pool has
    gets a larger pool. The old one is dropped, not shut down: a copy that took it a
    moment ago may still submit to it, and its threads end once nothing refers to it."""
    global _copy_pool, _copy_pool_workers
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool_workers < threads - 1:
            _copy_pool_workers = max(1, threads - 1)
            _copy_pool = ThreadPoolExecutor(
                max_workers=_copy_pool_workers, thread_name_prefix="kvtier-copy"
            )
        return _copy_pool


def parallel_copy(dst: npt.NDArray[Any], src: npt.NDArray[Any], threads: int) -> None:
    """``dst[:] = src`` for flat byte arrays, split into ``threads`` pieces when large.

    numpy releases the GIL while it copies, so the pieces run on separate cores.
    """
    n = src.size
    if threads <= 1 or n < PARALLEL_COPY_BYTES:
        np.copyto(dst, src)
        return
    step = ((n // threads + 4095) // 4096) * 4096  # page-aligned pieces
    pool = _pool(threads)
    futs = [
        pool.submit(np.copyto, dst[lo : lo + step], src[lo : lo + step])
        for lo in range(step, n, step)
    ]
    np.copyto(dst[:step], src[:step])
    for f in futs:
        f.result()


def _values(arena: npt.NDArray[Any], slot_bytes: int, run: SlotRun) -> npt.NDArray[Any]:
    """The run's values in a flat byte array of slots: one contiguous range when they fill
    their slots (or there is one), else an (n, value_bytes) view that skips slot padding."""
    base = run.offset * slot_bytes
    if run.value_bytes == slot_bytes or run.n == 1:
        return arena[base : base + run.nbytes]
    window = arena[base : base + run.n * slot_bytes].reshape(run.n, slot_bytes)
    return window[:, : run.value_bytes]


def _one_copy_at(slot_bytes: int, run: SlotRun, nbytes: int, threads: int) -> int | None:
    """Byte offset of the run's values when one memcpy can move them (they lie packed in
    one range, the buffer is the run's size, and the copy is not split over threads),
    else None: numpy copies, and refuses a buffer of another size."""
    if nbytes != run.nbytes:
        return None
    if threads > 1 and nbytes >= PARALLEL_COPY_BYTES:
        return None
    if run.value_bytes == slot_bytes or run.n == 1:
        return run.offset * slot_bytes
    return None


def copy_in(
    arena: npt.NDArray[Any], slot_bytes: int, run: SlotRun, src: memoryview, threads: int = 1
) -> None:
    """Copy packed values into consecutive slots of a flat byte array."""
    base = _one_copy_at(slot_bytes, run, src.nbytes, threads)
    if base is not None and _copy_c is not None:
        _copy_c(arena, base, src, 0, src.nbytes)  # one memcpy, no arrays built
        return
    slots = _values(arena, slot_bytes, run)
    packed = np.frombuffer(src, dtype=np.uint8).reshape(slots.shape)
    if slots.ndim == 1:  # contiguous: worth splitting over threads
        parallel_copy(slots, packed, threads)
    else:
        slots[:] = packed


def copy_out(
    arena: npt.NDArray[Any], slot_bytes: int, run: SlotRun, dst: memoryview, threads: int = 1
) -> None:
    """Copy consecutive slots of a flat byte array out as packed values."""
    base = _one_copy_at(slot_bytes, run, dst.nbytes, threads)
    if base is not None and _copy_c is not None:
        _copy_c(dst, 0, arena, base, dst.nbytes)
        return
    slots = _values(arena, slot_bytes, run)
    packed = np.frombuffer(dst, dtype=np.uint8).reshape(slots.shape)
    if slots.ndim == 1:
        parallel_copy(packed, slots, threads)
    else:
        packed[:] = slots


class HostTier(ViewableTier):
    """Pinned, shared host DRAM. Copies are numpy memcpys that release the GIL."""

    kind = "host"

    def __init__(
        self,
        geometry: TierGeometry,
        options: Options | None = None,
        profile: TierProfile | None = None,
    ) -> None:
        super().__init__(geometry, profile)
        opts = options or Options()
        self.copy_threads = opts.copy_threads or auto_copy_threads()
        self.arena = SharedArena(
            self.capacity_bytes,
            self.name,
            numa_node=opts.numa_node,
            pin=opts.pin,
            prefault=opts.prefault,
        )
        # One native call checks and copies a run (write / read below), where this
        # class's own _write / _read would run: a subclass that overrides them (the
        # emulated CXL tier) keeps them.
        cls = type(self)
        self._native_copy = (
            _copy_slots is not None
            and cls._write is HostTier._write
            and cls._read is HostTier._read
        )

    @property
    def shm_path(self) -> str:
        """Path of the shared-memory file other processes can map."""
        return str(self.arena.path)

    @override
    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        if not 0 < nbytes <= self.slot_bytes or not 0 <= offset < self.capacity_slots:
            return None
        base = offset * self.slot_bytes
        return self.arena.array[base : base + nbytes].data

    @override
    def run_view(self, run: SlotRun) -> memoryview | None:
        # slot_view decides whether this tier gives views at all (an emulated CXL tier
        # does not); the run must lie in the arena and be laid out as packed values.
        if self.slot_view(run.offset, run.value_bytes) is None:
            return None
        if run.n > 1 and run.value_bytes != self.slot_bytes:
            return None
        if run.offset + run.n > self.capacity_slots:
            return None
        base = run.offset * self.slot_bytes
        return self.arena.array[base : base + run.nbytes].data

    def _copy_natively(self, run: SlotRun, buf: memoryview, into_arena: bool) -> bool:
        """Copy ``run`` in one native call, where the core is built; False to go the Python
        way (a large copy split over threads, copy_threads > 1, is Python's)."""
        if not self._native_copy or (self.copy_threads > 1 and run.nbytes >= PARALLEL_COPY_BYTES):
            return False
        _copy_slots(
            self.arena.array,
            self.slot_bytes,
            run.offset,
            len(run.keys),
            run.value_bytes,
            buf,
            into_arena,
        )
        return True

    @override
    def write(self, run: SlotRun, src: memoryview) -> None:
        if self._copy_natively(run, src, True):
            self.note_written(run.nbytes)
        else:
            super().write(run, src)

    @override
    def read(self, run: SlotRun, dst: memoryview) -> None:
        if self._copy_natively(run, dst, False):
            self.count_read(run.nbytes)
        else:
            super().read(run, dst)

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        copy_in(self.arena.array, self.slot_bytes, run, src, self.copy_threads)

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        copy_out(self.arena.array, self.slot_bytes, run, dst, self.copy_threads)

    @override
    def close(self) -> None:
        self.arena.close()


# DDR5 host memory behind PCIe Gen5 x16, priced and timed by the one table of tier
# economics that placement and kvtier calc use too.
HOST_PROFILE = DDR5_HOST.to_tier_profile()


def create(section: TierSection, geometry: TierGeometry) -> HostTier:
    return HostTier(geometry, section.options, HOST_PROFILE)
