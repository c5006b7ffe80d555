"""Contracts of the transfer engine: options, a handle per transfer, and the mover ABC."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvtier.transfer.layout import PagedKV

_MiB = 1 << 20


class HostOrder(enum.Enum):
    """Byte order of the host side of a transfer of ``n`` blocks of ``L`` layers.

    ``LAYER``: ``[layer][run][block][run_bytes]``; a layer group is one contiguous host
    range (what layer-wise loading wants). ``BLOCK``: ``[block][layer][run][run_bytes]``;
    one block of every layer is one contiguous row, so consecutive blocks (a store chunk)
    are one contiguous value (what the vLLM connector's staging rows are).
    """

    LAYER = "layer"
    BLOCK = "block"


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How the engine stages data on the device.

    The staging memory is allocated once, when the engine is created, on the KV cache's
    device, and is logged there: it sits outside vLLM's KV budget, so size
    ``gpu_memory_utilization`` to leave room for it.
    """

    # Device staging memory for each direction (store and load each get this much), bytes.
    staging_bytes: int = 256 * _MiB
    # Staging slots per direction: >= 2 lets the gather of group i+1 overlap the copy of group i.
    slots: int = 4
    # On CPU, gather straight into (and scatter straight out of) the host buffer; off
    # runs the staged pipeline on CPU too (CI uses that to test it without a GPU).
    cpu_direct: bool = True
    # Budget of the first store unit and the last load unit, doubling up to a slot: the
    # steps nothing overlaps stay short (0: every unit is a full slot), bytes.
    ramp_bytes: int = 4 * _MiB
    # CUDA: fill (store) or empty (load) a staging slot with ONE Triton kernel launch
    # for all its layers, instead of one ``index_select`` / ``index_copy_`` per layer
    # (each launch costs host CPU that short transfers wait for); needs Triton.
    gather_kernel: bool = True
    # Programs of that kernel's persistent grid (it moves HBM to HBM and is brief).
    kernel_programs: int = 264

    def __post_init__(self) -> None:
        if self.slots < 1 or self.slots > 16:
            raise ConfigError("transfer.slots", self.slots, "an integer in [1, 16]")
        if not 1 <= self.kernel_programs <= 4096:
            raise ConfigError(
                "transfer.kernel_programs", self.kernel_programs, "an integer in [1, 4096]"
            )
        if self.staging_bytes < self.slots * 4096:
            raise ConfigError(
                "transfer.staging_bytes", self.staging_bytes, f">= {self.slots * 4096}"
            )

    @property
    def slot_bytes(self) -> int:
        """Bytes of one staging slot, rounded down to 256 bytes."""
        return (self.staging_bytes // self.slots) & ~255


class TransferHandle(ABC):
    """One enqueued store or load. Keep it (and the host buffer) alive until ``wait``.

    Thread-safety: a handle is used by the thread that enqueued the transfer.
    """

    @abstractmethod
    def done(self) -> bool:
        """Whether every copy of the transfer has finished (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the transfer has finished."""

    @abstractmethod
    def wait_for_layer(self, layer: int) -> None:
        """Order work on the caller's current stream after ``layer``'s pages landed.

        For loads this is what vLLM's ``wait_for_layer_load`` calls: it does not block
        the host on CUDA (the current stream waits on an event), so layer ``i``'s
        attention is queued while layer ``i+1``'s pages are still crossing PCIe. On
        CPU, transfers complete before they return, so it returns at once. For stores it
        waits for the whole transfer.
        """


class PagedTransfer(ABC):
    """Moves whole blocks of every layer between a paged KV cache and host bytes.

    Asynchronous (handles, per-layer events); :class:`TransferEngine` implements it. Not
    to be confused with the vLLM connector's ``BlockMover``
    (:mod:`kvtier.connectors.vllm.mover`), the connector's synchronous gather/scatter
    seam, one of whose implementations drives this engine.

    Host bytes are ``[layer][run][block][run_bytes]`` for the blocks in the order given
    (see :mod:`kvtier.transfer.layout`), or block-major with ``order=HostOrder.BLOCK``;
    ``PagedKV.nbytes(n)`` is their size either way.
    """

    @abstractmethod
    def store(
        self,
        kv: PagedKV,
        block_ids: Sequence[int],
        dst: torch.Tensor,
        *,
        order: HostOrder = HostOrder.LAYER,
    ) -> TransferHandle:
        """Enqueue a copy of ``block_ids`` of every layer into host ``dst`` (uint8)."""

    @abstractmethod
    def load(
        self,
        src: torch.Tensor,
        kv: PagedKV,
        block_ids: Sequence[int],
        *,
        order: HostOrder = HostOrder.LAYER,
    ) -> TransferHandle:
        """Enqueue a copy of host ``src`` (uint8) into ``block_ids`` of every layer."""

    def gather(
        self,
        kv: PagedKV | Sequence[torch.Tensor],
        block_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy the blocks out and return the host bytes once they are there.

        Args:
            kv: the cache, or its per-layer tensors (described on every call: build a
                :class:`~kvtier.transfer.layout.PagedKV` once where calls repeat).
            block_ids: blocks to copy (any order; repeats allowed).
            out: host uint8 tensor of ``kv.nbytes(len(block_ids))`` bytes, or None to
                allocate one (pinned where CUDA is present).
        """
        import torch

        paged = _paged(kv)
        if out is None:
            pin = paged.device.type == "cuda"
            out = torch.empty(paged.nbytes(len(block_ids)), dtype=torch.uint8, pin_memory=pin)
        self.store(paged, block_ids, out).wait()
        return out

    def scatter(
        self, src: torch.Tensor, kv: PagedKV | Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> None:
        """Copy host bytes into the blocks and return once they are there."""
        self.load(src, _paged(kv), block_ids).wait()


def _paged(kv: PagedKV | Sequence[torch.Tensor]) -> PagedKV:
    from kvtier.transfer.layout import PagedKV

    return kv if isinstance(kv, PagedKV) else PagedKV(kv)
