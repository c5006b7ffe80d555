"""Memory objects for the remote plug-in's loads, in memory shared with the daemon.

LMCache's own memory is private to its process, so a load through the daemon's
same-host channel used to take two copies: the daemon's, from its tier into a scratch
region of this process, and this side's, from there into the object LMCache allocated.
A :class:`LoadPool` hands LMCache memory objects that already lie in a region shared
with the daemon: the daemon's copy lands in them and nothing is copied on this side.

LMCache treats them as its own: it reads them into the GPU, may keep them in its local
CPU cache (a remote hit is written back there) and releases them with
``ref_count_down()``, which returns the slot here (``parent_allocator.free``). When
every slot is held (LMCache keeps many loaded chunks), a load takes LMCache's own
memory and one more copy, as before: the pool only ever makes a load cheaper.

Where CUDA is present the region is page-locked (``cudaHostRegister``), as LMCache's
own buffer is, because LMCache's GPU connectors read host memory by its device
address; a region that cannot be locked is not used.

Thread-safe: slots are taken and returned under one lock.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from typing_extensions import override

log = logging.getLogger(__name__)

_FREE, _TAKEN = 1, 0


def _unregister(addr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(addr)  # type: ignore[no-untyped-call]


def page_lock(array: npt.NDArray[np.uint8]) -> str | None:
    """Page-lock ``array`` for CUDA when a device is present (unlocked at collection).

    Returns:
        None when the memory is usable (locked, or no CUDA device to lock it for); the
        reason it is not, otherwise.
    """
    if not torch.cuda.is_available():
        return None
    addr = int(array.ctypes.data)
    try:
        rc = torch.cuda.cudart().cudaHostRegister(addr, array.nbytes, 0)  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError) as exc:
        return f"cudaHostRegister failed: {exc}"
    if int(rc) != 0:
        return f"cudaHostRegister returned {rc}"
    weakref.finalize(array, _unregister, addr)
    return None


class LoadPool(MemoryAllocatorInterface):  # type: ignore[misc]  # LMCache is untyped
    """Slots of one full chunk each over ``array``, handed out as LMCache memory objects.

    Args:
        array: the memory (a buffer shared with the daemon); its whole chunks are slots.
        chunk_bytes: a full chunk's length in bytes (LMCache's ``full_chunk_size_bytes``).

    Raises:
        ValueError: ``array`` holds no whole chunk.
    """

    def __init__(self, array: npt.NDArray[np.uint8], chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.slots = array.nbytes // chunk_bytes
        if self.slots < 1:
            raise ValueError(f"a pool of {array.nbytes} B holds no chunk of {chunk_bytes} B")
        self.array = array
        self._buffer = torch.from_numpy(array[: self.slots * chunk_bytes])
        self._free = bytearray([_FREE]) * self.slots
        # Reentrant: a collection inside take() may run an object's __del__, which frees.
        self._lock = threading.RLock()
        self.taken_total = 0  # objects handed out since the pool was made

    @property
    def in_use(self) -> int:
        """Slots held by LMCache now."""
        with self._lock:
            return self.slots - self._free.count(_FREE)

    def take(
        self, n: int, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], fmt: Any
    ) -> list[MemoryObj]:
        """Up to ``n`` objects, back to back where free slots allow; fewer when the pool
        is short (none when it is full)."""
        got: list[int] = []
        with self._lock:
            at = 0
            while len(got) < n:
                at = self._free.find(_FREE, at)
                if at < 0:
                    break
                while at < self.slots and len(got) < n and self._free[at] == _FREE:
                    self._free[at] = _TAKEN
                    got.append(at)
                    at += 1
            self.taken_total += len(got)
        return [self._object(i, list(shapes), list(dtypes), fmt) for i in got]

    def _object(
        self, slot: int, shapes: list[torch.Size], dtypes: list[torch.dtype], fmt: Any
    ) -> TensorMemoryObj:
        start = slot * self.chunk_bytes
        meta = MemoryObjMetadata(
            shapes[0],
            dtypes[0],
            start,
            self.chunk_bytes,
            1,
            0,
            fmt,
            shapes=shapes,
            dtypes=dtypes,
        )
        return TensorMemoryObj(self._buffer[start : start + self.chunk_bytes], meta, self)

    # -- LMCache's allocator interface (it calls free through ref_count_down) ---------------

    @override
    def allocate(
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: str | None = None,
    ) -> MemoryObj | None:
        got = self.batched_allocate(shapes, dtypes, 1, fmt, allocator_type)
        return got[0] if got else None

    @override
    def batched_allocate(
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: str | None = None,
    ) -> list[MemoryObj] | None:
        shape_list = [shapes] if isinstance(shapes, torch.Size) else list(shapes)
        dtype_list = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
        got = self.take(batch_size, shape_list, dtype_list, fmt)
        if len(got) == batch_size:
            return got
        self.batched_free(got)
        return None

    @override
    def free(self, memory_obj: MemoryObj, allocator_type: str | None = None) -> None:
        """Return the object's slot. Idempotent: LMCache may free an object twice (its
        ``__del__`` is a safety net behind ``ref_count_down``)."""
        with self._lock:
            if not memory_obj.is_valid():
                return
            memory_obj.invalidate()
            self._free[memory_obj.meta.address // self.chunk_bytes] = _FREE

    @override
    def batched_free(
        self,
        memory_objs: list[MemoryObj],
        allocator_type: str | None = None,
        update_stats: bool = True,
    ) -> None:
        for obj in memory_objs:
            self.free(obj)
