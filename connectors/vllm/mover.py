"""Moving whole KV blocks between vLLM's paged cache and a contiguous staging buffer.

The connector never copies one block at a time: a save gathers every block of a batch
of chunks with one ``index_select`` per layer into a staging tensor, and the store
then takes that tensor with one copy; a load does the reverse with one ``index_copy_``
per layer. :class:`BlockMover` is the seam where a device-specific transfer engine
plugs in: :class:`EngineBlockMover` drives ``kvtier.transfer.TransferEngine`` (bounded
device staging, copies pipelined across CUDA streams) and is what :func:`select_mover`
picks for CUDA caches; :class:`TorchBlockMover` is the portable implementation, correct
on CPU and CUDA tensors alike, and the fallback when the engine refuses a layout.

Staging layout: ``[n_blocks, n_layers, page_bytes]`` uint8, block-major. One chunk of
``b`` blocks is therefore ``b * n_layers * page_bytes`` consecutive bytes, which is
what the store needs (each key's value packed), and ``staging[:, layer]`` is a 2-D
strided view that ``index_select(out=...)``/``index_copy_`` accept directly, so there
is no second copy to re-order layers.

A *page* is one block of one layer. vLLM keeps dim 0 of every per-layer tensor as the
block index. When the other dims of a layer are dense in memory (LBHNC on CPU,
LBNHC/LBHNC on CUDA: ``KVCacheLayout.is_block_compact``), a page is one contiguous
byte run and is copied as raw bytes, whatever the order inside it. Otherwise (layouts
that split a block across heads) the mover falls back to the logical view, which is
slower but still correct.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from typing_extensions import override

from kvtier.errors import InputError, SpecError
from kvtier.transfer import HostOrder, PagedKV, TransferEngine, TransferHandle, TransferOptions

log = logging.getLogger(__name__)

# Device staging of the connector's engine: 2 slots of 32 MiB per direction, 128 MiB in
# all, outside vLLM's KV budget. 64 MiB x 2 measured within 1-2% of 256 MiB x 4 on the
# H200 (docs/benchmarks.md, "Staging size"), and connector transfers are per step.
CONNECTOR_STAGING = TransferOptions(staging_bytes=64 << 20, slots=2)


def page_view(t: torch.Tensor) -> torch.Tensor | None:
    """A ``[num_blocks, page_bytes]`` uint8 view of a per-layer KV tensor, or None.

    None when one block of the layer is not a single dense byte run (the caller then
    uses the logical view).
    """
    if t.dim() < 2:
        return None
    dims = sorted((st, sz) for sz, st in zip(t.shape[1:], t.stride()[1:], strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return None
        expected *= sz
    es = t.element_size()
    page = math.prod(t.shape[1:]) * es
    view = torch.empty(0, dtype=torch.uint8, device=t.device)
    view.set_(
        t.untyped_storage(), t.storage_offset() * es, (t.shape[0], page), (t.stride(0) * es, 1)
    )
    return view


def _wide(view: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, page_bytes]`` uint8 view as 8-byte words, where its pages allow."""
    try:
        return view.view(torch.int64)
    except RuntimeError:  # a page or an offset that is not a multiple of 8 bytes
        return view


def _as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Staging rows (``[n, page_bytes]`` uint8) as ``dtype`` words, or copied to fit."""
    if rows.dtype == dtype:
        return rows
    try:
        return rows.view(dtype)
    except RuntimeError:  # staging at an odd offset (memory shared with a daemon)
        return rows.contiguous().view(dtype)


def layout_tag(t: torch.Tensor) -> str:
    """Names the byte order inside a page, so KV of two layouts never share a key."""
    if page_view(t) is None:
        return "logical"
    strides = t.stride()
    order = sorted(range(1, t.dim()), key=lambda d: -strides[d])
    return "page-" + "".join(str(d) for d in order)


class BlockMover(ABC):
    """Gathers blocks out of, and scatters them into, a worker's paged KV tensors.

    Implementations are used from two threads: ``scatter`` and ``mark`` from the engine
    thread, ``gather`` from the connector's save thread. ``gather`` must only read
    blocks; the connector guarantees they are not rewritten until it returns.

    Attributes:
        device: where the KV tensors are.
        num_layers: layers (tensors) moved per block.
        page_bytes: bytes of one block of one layer.
        layout: the byte order inside a page (:func:`layout_tag`), part of the rank keys.
        enqueues: whether :meth:`start_scatter` enqueues (a device with its own copy
            engines) rather than answering None.
    """

    device: torch.device
    num_layers: int
    page_bytes: int
    layout: str
    enqueues: bool = False

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: one row of the staging buffer."""
        return self.num_layers * self.page_bytes

    def mark(self) -> object | None:
        """Called on the engine thread after the step's forward; the token goes to gather.

        On CUDA this records an event so that ``gather`` (on another thread and stream)
        waits for the step's writes. The CPU needs nothing.
        """
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    def gather(
        self,
        block_ids: Sequence[int],
        after: object | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy blocks into a host staging tensor ``[len(block_ids), L, page]`` uint8.

        Args:
            block_ids: blocks to copy, in staging order.
            after: the token :meth:`mark` returned; the copy starts after that point.
            out: a C-contiguous CPU tensor of that shape to copy into (memory shared
                with a daemon: the save then moves no byte on this side); default a new
                one from :meth:`host_buffer`.

        Returns:
            ``out``, or the new tensor the caller owns.
        """
        host = self.host_buffer(len(block_ids)) if out is None else out
        if block_ids:
            self._gather(block_ids, after, host)
        return host

    @abstractmethod
    def _gather(self, block_ids: Sequence[int], after: object | None, host: torch.Tensor) -> None:
        """Copy the (non-empty) ``block_ids`` into ``host`` (see :meth:`gather`)."""

    @abstractmethod
    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy staging rows into blocks (row i into ``block_ids[i]``), synchronously.

        When this returns, the bytes are in place for the next kernel on the engine's
        stream.
        """

    def start_scatter(
        self, staging: torch.Tensor, block_ids: Sequence[int]
    ) -> TransferHandle | None:
        """Enqueue :meth:`scatter`'s copies and return at once, or None where this mover
        copies only synchronously (:attr:`enqueues` is False).

        The handle's ``done`` says when the blocks hold the rows; until then the caller
        keeps ``staging`` unchanged and no forward may read the blocks.
        """
        return None

    def host_buffer(self, n_blocks: int) -> torch.Tensor:
        """A host staging tensor for ``n_blocks`` blocks (pinned on CUDA)."""
        return torch.empty(
            (n_blocks, self.num_layers, self.page_bytes),
            dtype=torch.uint8,
            pin_memory=self.device.type == "cuda",
        )

    def close(self) -> None:  # noqa: B027 -- optional hook; most movers hold nothing
        """Release device resources (staging); the mover is unusable afterwards."""


class TorchBlockMover(BlockMover):
    """Portable mover: one ``index_select``/``index_copy_`` per layer, CPU or CUDA.

    On CUDA the gather runs on a side stream, into device staging, then one copy to
    pinned host memory; the scatter copies host staging to the device once, then one
    ``index_copy_`` per layer on the current stream. (The performance work on CUDA has
    its own engine; this one is for correctness on both device types.)

    Args:
        layers: vLLM's per-layer KV tensors, in a fixed layer order.

    Raises:
        SpecError: layers of unequal page size or on different devices.
    """

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise SpecError("no KV cache tensors were registered")
        self.device = layers[0].device
        pages = {math.prod(t.shape[1:]) * t.element_size() for t in layers}
        if len(pages) != 1 or any(t.device != self.device for t in layers):
            devices = sorted({str(t.device) for t in layers})
            raise SpecError(
                "kvtier needs every attention layer to have the same block size in bytes on one "
                f"device; got page sizes {sorted(pages)} on {devices}"
            )
        self.layers = list(layers)
        self.views = [page_view(t) for t in layers]
        # The same pages as wider words: index_copy_ and index_select cost per element,
        # and a byte-wise copy of a page is several times slower than a word-wise one.
        self.words = [None if v is None else _wide(v) for v in self.views]
        self.num_layers = len(layers)
        self.page_bytes = pages.pop()
        self.layout = layout_tag(layers[0])
        self.on_cuda = self.device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        if self.on_cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _gather_into(self, out: torch.Tensor, idx: torch.Tensor) -> None:
        for layer, (t, view, words) in enumerate(
            zip(self.layers, self.views, self.words, strict=True)
        ):
            if view is not None and words is not None:
                dst = out[:, layer]
                try:
                    torch.index_select(words, 0, idx, out=dst.view(words.dtype))
                except RuntimeError:  # staging at an odd offset: byte-wise into it
                    torch.index_select(view, 0, idx, out=dst)
            else:
                rows = t.index_select(0, idx).contiguous().view(torch.uint8)
                out[:, layer].copy_(rows.reshape(len(idx), self.page_bytes))

    @override
    def _gather(self, block_ids: Sequence[int], after: object | None, host: torch.Tensor) -> None:
        if self._stream is None:
            self._gather_into(host, self._index(block_ids))
            return
        with torch.cuda.stream(self._stream):
            if isinstance(after, torch.cuda.Event):
                self._stream.wait_event(after)
            idx = self._index(block_ids)
            dev = torch.empty(host.shape, dtype=torch.uint8, device=self.device)
            self._gather_into(dev, idx)
            host.copy_(dev, non_blocking=True)
        self._stream.synchronize()

    @override
    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        idx = self._index(block_ids)
        src = staging.to(self.device, non_blocking=True) if self.on_cuda else staging
        for layer, (t, view) in enumerate(zip(self.layers, self.words, strict=True)):
            rows = src[:, layer]
            if view is not None:
                view.index_copy_(0, idx, _as(rows, view.dtype))
            else:
                logical = rows.contiguous().view(t.dtype).reshape(len(idx), *t.shape[1:])
                t.index_copy_(0, idx, logical)


class EngineBlockMover(BlockMover):
    """CUDA mover over :class:`kvtier.transfer.TransferEngine`.

    Pages are described as the engine does (:class:`~kvtier.transfer.PagedKV`, block
    index in dim 0 as vLLM 0.32 registers per-layer tensors), and moved whole through the
    engine's bounded staging in its block-major host order, so the staging rows are
    byte-for-byte what :class:`TorchBlockMover` produces for the same cache: both movers
    share keys (same :func:`layout_tag`) and each reads what the other wrote.

    Args:
        layers: vLLM's per-layer KV tensors on one CUDA device, in a fixed layer order.
        options: the engine's staging; default :data:`CONNECTOR_STAGING`.

    Raises:
        InputError: the engine refuses the cache: not on CUDA, a layout whose blocks are
            not contiguous byte runs (head-outer), layers of different geometry, or one
            page larger than a staging slot.
    """

    enqueues = True

    def __init__(
        self, layers: Sequence[torch.Tensor], options: TransferOptions | None = None
    ) -> None:
        if not layers or layers[0].device.type != "cuda":
            raise InputError("the transfer engine mover needs CUDA KV caches")
        self.kv = PagedKV(layers, block_dim=0)
        opts = options or CONNECTOR_STAGING
        if self.kv.geometry.page_bytes > opts.slot_bytes:
            raise InputError(
                f"one page ({self.kv.geometry.page_bytes} bytes) does not fit a staging slot "
                f"({opts.slot_bytes} bytes)"
            )
        self.device = self.kv.device
        self.num_layers = self.kv.num_layers
        self.page_bytes = self.kv.geometry.page_bytes
        self.layout = layout_tag(layers[0])
        self.engine = TransferEngine(self.device, opts)
        self.engine.prepare(self.kv)  # compile the unit kernel now, not on the first save
        # The save thread's copies wait for the engine thread's mark() on this stream;
        # the engine's own streams then wait for it (TransferEngine orders after the
        # caller's current stream).
        self._after = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @override
    def _gather(self, block_ids: Sequence[int], after: object | None, host: torch.Tensor) -> None:
        if isinstance(after, torch.cuda.Event):
            with torch.cuda.stream(self._after):
                self._after.wait_event(after)
                h = self.engine.store(self.kv, block_ids, host.view(-1), order=HostOrder.BLOCK)
        else:
            h = self.engine.store(self.kv, block_ids, host.view(-1), order=HostOrder.BLOCK)
        h.wait()

    @override
    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        src = staging.reshape(-1) if staging.is_contiguous() else staging.contiguous().view(-1)
        # Blocking wait: the caller may reuse the host rows as soon as this returns, and
        # every later kernel, on any stream, then sees the pages.
        self.engine.load(src, self.kv, block_ids, order=HostOrder.BLOCK).wait()

    @override
    def start_scatter(
        self, staging: torch.Tensor, block_ids: Sequence[int]
    ) -> TransferHandle | None:
        src = staging.reshape(-1) if staging.is_contiguous() else staging.contiguous().view(-1)
        return self.engine.load(src, self.kv, block_ids, order=HostOrder.BLOCK)

    @override
    def close(self) -> None:
        self.engine.close()


_fallback_logged = False


def select_mover(
    layers: Sequence[torch.Tensor], options: TransferOptions | None = None
) -> BlockMover:
    """The mover for a worker's KV tensors: the transfer engine on CUDA, else torch.

    When the engine refuses a CUDA cache (see :class:`EngineBlockMover`), the portable
    :class:`TorchBlockMover` moves it instead, correct but slower; that is logged once
    per process.

    Raises:
        SpecError: layers of unequal page size or on different devices.
    """
    torch_mover = TorchBlockMover(layers)  # validates the layers for both paths
    if not torch_mover.on_cuda:
        return torch_mover
    try:
        return EngineBlockMover(layers, options)
    except InputError as exc:
        global _fallback_logged
        if not _fallback_logged:
            _fallback_logged = True
            log.warning(
                "kvtier: the CUDA transfer engine refuses this KV cache (%s); moving blocks "
                "with the portable torch mover (layout %s), which is correct but slower",
                exc,
                torch_mover.layout,
            )
        return torch_mover
