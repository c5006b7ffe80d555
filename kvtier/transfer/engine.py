"""The transfer engine: paged device KV <-> contiguous host bytes through bounded staging.

Store (device to host), per pipeline *unit* (a group of whole layers, or a block range of
one layer when a layer does not fit a slot)::

    gather stream:  gather every layer of the unit into staging slot s
    d2h stream:     wait for it, then one copy of slot s into the host range

On CUDA with Triton, the gather of a unit is ONE kernel launch for all its layers
(:mod:`kvtier.transfer.kernels`); elsewhere it is one ``index_select`` per layer.

Load is the mirror image (h2d copy into a slot, then ``index_copy_`` out of it on the
scatter stream). Slots rotate, so unit i+1's kernels run while the copy engine moves
unit i; a slot is reused only after the event of its last copy (store) or scatter
(load). A load records, per layer, the event after which that layer's pages are in
place; :meth:`TransferHandle.wait_for_layer` turns it into a stream wait, which is what
layer-wise loading needs.

Why gather then one copy: a page copied alone crosses PCIe far below the large-copy
rate, while an ``index_select`` at HBM speed costs a small part of the copy it feeds and
overlaps with it (docs/benchmarks.md, "GPU data path").

The engine is device-agnostic torch code; CUDA specifics live in
:mod:`kvtier.transfer.cuda`, imported only for a CUDA device. On CPU, operations run as
they are issued; by default they read and write the host buffer directly
(``TransferOptions.cpu_direct``), since a staging copy buys nothing there.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from kvtier.errors import ClosedError, InputError
from kvtier.transfer.base import HostOrder, PagedTransfer, TransferHandle, TransferOptions
from kvtier.transfer.kernels import LayerTable, compile_for, launch, unavailable
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.sync import CpuSync, Sync

try:
    from kvtier._speedups import pack_i32
except ImportError:  # the optional C extension was not built
    pack_i32 = None

log = logging.getLogger(__name__)

_STORE, _LOAD = 0, 1
# Bound on cached staging views (:meth:`TransferEngine._view`): shapes vary with the
# block count of a transfer, so the cache is emptied when it reaches this many.
_MAX_VIEWS = 512


@dataclass(frozen=True, slots=True)
class Unit:
    """Layers ``[l0, l1)`` and blocks ``[j0, j1)`` (positions in the id list) of one step."""

    l0: int
    l1: int
    j0: int
    j1: int


@functools.lru_cache(maxsize=256)
def plan(
    num_layers: int,
    n_blocks: int,
    page_bytes: int,
    slot_bytes: int,
    *,
    ramp_bytes: int = 0,
    ramp_at_end: bool = False,
) -> tuple[Unit, ...]:
    """Split a transfer into units that each fit one staging slot.

    Whole layers are grouped while they fit; a layer larger than a unit's budget is
    cut into block ranges. Each unit's host bytes are one contiguous range per run.

    The first unit of a store (a gather nothing overlaps) and the last unit of a load
    (a scatter nothing overlaps) are pure latency, so with ``ramp_bytes`` the budget
    starts there and doubles per unit up to ``slot_bytes``: at the start, or, with
    ``ramp_at_end``, at the end (units still run in layer order).

    Cached: it is a pure function of its arguments, and computing it (tens of
    microseconds of Python) delays the first copy of every transfer.

    Raises:
        InputError: a single page is larger than a slot.
    """
    if page_bytes > slot_bytes:
        raise InputError(
            f"one page ({page_bytes} bytes) does not fit a staging slot ({slot_bytes} bytes)"
        )
    layer_bytes = page_bytes * n_blocks
    units: list[Unit] = []
    layer, j, k = 0, 0, 0
    while layer < num_layers:
        budget = slot_bytes if ramp_bytes <= 0 else min(slot_bytes, ramp_bytes << min(k, 40))
        k += 1
        if j == 0 and layer_bytes <= budget:
            g = min(budget // layer_bytes, num_layers - layer)
            units.append(Unit(layer, layer + g, 0, n_blocks))
            layer += g
            continue
        j1 = min(n_blocks, j + max(1, budget // page_bytes))
        units.append(Unit(layer, layer + 1, j, j1))
        layer, j = (layer + 1, 0) if j1 == n_blocks else (layer, j1)
    if ramp_at_end and ramp_bytes > 0:
        # Plan the mirrored transfer (last page first), then mirror it back.
        mirrored = plan(num_layers, n_blocks, page_bytes, slot_bytes, ramp_bytes=ramp_bytes)
        units = [
            Unit(num_layers - u.l1, num_layers - u.l0, n_blocks - u.j1, n_blocks - u.j0)
            for u in reversed(mirrored)
        ]
    return tuple(units)


def _id_tensor(block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Block ids as a CPU int64 tensor.

    ``torch.as_tensor`` of a list converts id by id in Python, all of it before the first
    copy of the transfer can be enqueued; a list or tuple of ints is packed by the C
    helper first instead. Ids that do not fit int32 (never a valid block) take the
    general path, whose range check names them.
    """
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device="cpu", dtype=torch.int64)
    if pack_i32 is not None and isinstance(block_ids, (list, tuple)) and block_ids:
        try:
            packed = bytearray(pack_i32(block_ids))
        except (OverflowError, TypeError):
            pass
        else:
            return torch.frombuffer(packed, dtype=torch.int32).to(torch.int64)
    return torch.as_tensor(block_ids, dtype=torch.int64, device="cpu")


def unit_kernel_reason(device: torch.device, options: TransferOptions) -> str | None:
    """Why an engine for ``device`` with ``options`` moves units one launch per layer,
    or None when it uses the unit kernel (:attr:`TransferEngine.unit_kernel`)."""
    if device.type != "cuda":
        return f"a {device.type} device"
    if not options.gather_kernel:
        return "turned off"
    return unavailable()


class _Handle(TransferHandle):
    def __init__(
        self, sync: Sync, done: Any, layer_events: list[Any] | None, keep: tuple[Any, ...]
    ) -> None:
        self._sync = sync
        self._done = done
        self._layer_events = layer_events
        # Tensors the queued copies still read or write; dropped once they are done.
        self._keep: tuple[Any, ...] = keep

    @override
    def done(self) -> bool:
        ok = self._sync.query(self._done)
        if ok:
            self._keep = ()
        return ok

    @override
    def wait(self) -> None:
        self._sync.synchronize(self._done)
        self._keep = ()

    @override
    def wait_for_layer(self, layer: int) -> None:
        if self._layer_events is None:
            self._sync.current_waits(self._done)
            return
        if not 0 <= layer < len(self._layer_events):
            raise InputError(f"layer {layer} out of range [0, {len(self._layer_events)})")
        self._sync.current_waits(self._layer_events[layer])


class TransferEngine(PagedTransfer):
    """Moves blocks between one device's paged KV caches and host memory.

    Args:
        device: the KV cache's device (``"cuda:0"``, ``"cpu"``).
        options: staging size and slots.

    Thread-safety: ``store`` and ``load`` may be called from several threads; enqueueing
    is serialised by a lock (the copies themselves run asynchronously on CUDA).

    Raises:
        InputError: a device type other than CPU or CUDA, or CUDA without a device.
    """

    def __init__(self, device: torch.device | str, options: TransferOptions | None = None) -> None:
        self.device = torch.device(device)
        self.options = options or TransferOptions()
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(f"torch {torch.__version__} sees no CUDA device for {self.device}")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            from kvtier.transfer.cuda import CudaSync

            self._sync: Sync = CudaSync(self.device)
            self._direct = False
        elif self.device.type == "cpu":
            self._sync = CpuSync()
            self._direct = self.options.cpu_direct
        else:
            raise InputError(f"no transfer path for device type {self.device.type!r}")
        reason = unit_kernel_reason(self.device, self.options)
        if reason is not None and self.device.type == "cuda":
            log.info("transfer engine: one launch per layer (no unit kernel: %s)", reason)
        self._kernels_off = reason is not None
        self._lock = threading.Lock()
        self._tables: weakref.WeakKeyDictionary[PagedKV, LayerTable] = weakref.WeakKeyDictionary()
        slot_bytes = self.options.slot_bytes
        self._staging: list[list[torch.Tensor]] = []
        if not self._direct:
            self._staging = [
                [
                    torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                    for _ in range(self.options.slots)
                ]
                for _ in (_STORE, _LOAD)
            ]
            log.info(
                "transfer engine: %d MiB of staging on %s (%d slots each way, not in KV budget)",
                2 * self.options.slots * slot_bytes >> 20,
                self.device,
                self.options.slots,
            )
        self._free: list[list[Any]] = [[None] * self.options.slots for _ in (_STORE, _LOAD)]
        self._next = [0, 0]
        self._views: dict[tuple[int, int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._closed = False

    @property
    def unit_kernel(self) -> bool:
        """Whether staging slots are filled and emptied by one kernel launch per unit
        (``TransferOptions.gather_kernel`` on a CUDA device with Triton)."""
        return not self._kernels_off

    @property
    def staging_bytes(self) -> int:
        """Device bytes this engine holds for staging (0 on the CPU direct path)."""
        return sum(t.numel() for side in self._staging for t in side)

    def _ids(
        self, kv: PagedKV, block_ids: Sequence[int] | torch.Tensor, *, unique: bool
    ) -> torch.Tensor:
        ids = _id_tensor(block_ids)
        if ids.dim() != 1:
            raise InputError(f"block_ids must be one-dimensional, got shape {tuple(ids.shape)}")
        if ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(ids))
            if lo < 0 or hi >= kv.geometry.num_blocks:
                raise InputError(
                    f"block ids span [{lo}, {hi}], the cache has {kv.geometry.num_blocks} blocks"
                )
            if unique and torch.unique(ids).numel() != ids.numel():
                raise InputError("a load names the same block twice")
        return ids

    def _host(
        self, kv: PagedKV, buf: torch.Tensor, n: int, order: HostOrder = HostOrder.LAYER
    ) -> torch.Tensor:
        want = kv.nbytes(n)
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise InputError("the host buffer must be a contiguous uint8 CPU tensor")
        if buf.numel() != want:
            raise InputError(f"the host buffer has {buf.numel()} bytes, {n} blocks need {want}")
        if buf.data_ptr() % kv.word_bytes:
            raise InputError(f"the host buffer must be {kv.word_bytes}-byte aligned")
        g = kv.geometry
        words = buf.view(kv.word_dtype)
        if order is HostOrder.BLOCK:
            return words.view(n, kv.num_layers, g.runs, g.run_bytes // kv.word_bytes)
        return words.view(kv.num_layers, g.runs, n, g.run_bytes // kv.word_bytes)

    def _device_ids(self, stream: str, ids_cpu: torch.Tensor) -> torch.Tensor:
        """The block ids on the device, copied on ``stream`` once it has waited for the
        caller's current stream (the first thing every transfer does; under the lock and
        inside ``issuing``)."""
        s = self._sync
        s.after_current(stream)
        s.use(stream)
        if self.device.type == "cuda" and not ids_cpu.is_pinned():
            # From pageable memory CUDA first syncs the stream: the caller would wait for
            # everything queued before the transfer (a step's forward) to run.
            ids_cpu = ids_cpu.pin_memory()
        return ids_cpu.to(self.device, non_blocking=True)

    def _slot(self, side: int, kv: PagedKV, u: Unit) -> tuple[int, torch.Tensor]:
        s = self._next[side]
        self._next[side] = (s + 1) % self.options.slots
        g = kv.geometry
        shape = (u.l1 - u.l0, g.runs, u.j1 - u.j0, g.run_bytes // kv.word_bytes)
        return s, self._view(side, s, kv.word_dtype, shape)

    def _view(self, side: int, s: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot ``s`` of ``side`` as a tensor of ``shape``. Cached: the view calls would
        otherwise run once per unit, in the host time before a copy can start, and a
        transfer's units repeat few shapes."""
        key = (side, s, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            n_bytes = math.prod(shape) * dtype.itemsize
            view = self._staging[side][s][:n_bytes].view(dtype).view(shape)
            self._views[key] = view
        return view

    @override
    def store(
        self,
        kv: PagedKV,
        block_ids: Sequence[int] | torch.Tensor,
        dst: torch.Tensor,
        *,
        order: HostOrder = HostOrder.LAYER,
    ) -> TransferHandle:
        self._check_kv(kv)
        ids_cpu = self._ids(kv, block_ids, unique=False)
        n = ids_cpu.numel()
        host = self._host(kv, dst, n, order)
        if n == 0:
            return _Handle(self._sync, None, None, ())
        if order is HostOrder.BLOCK:
            return self._store_rows(kv, ids_cpu, host, dst)
        s = self._sync
        units = self._plan(kv, n, ramp_at_end=False)
        with self._lock, s.issuing():
            ids = self._device_ids("gather", ids_cpu)
            if self._direct:
                for u in units:
                    for layer in range(u.l0, u.l1):
                        for r in range(kv.geometry.runs):
                            torch.index_select(
                                kv.layers[layer][r],
                                0,
                                ids[u.j0 : u.j1],
                                out=host[layer, r, u.j0 : u.j1],
                            )
                return _Handle(s, None, None, ())
            table = self._table(kv)
            for u in units:
                slot, stage = self._slot(_STORE, kv, u)
                s.wait("gather", self._free[_STORE][slot])
                s.use("gather")
                self._move(True, kv, table, ids[u.j0 : u.j1], stage, (u.l0, u.l1))
                s.order("gather", "d2h")
                s.use("d2h")
                if u.j1 - u.j0 == n:
                    host[u.l0 : u.l1].copy_(stage, non_blocking=True)
                else:
                    for r in range(kv.geometry.runs):
                        host[u.l0, r, u.j0 : u.j1].copy_(stage[0, r], non_blocking=True)
                self._free[_STORE][slot] = s.record("d2h")
            done = self._free[_STORE][slot]
        return _Handle(s, done, None, (ids, dst))

    @override
    def load(
        self,
        src: torch.Tensor,
        kv: PagedKV,
        block_ids: Sequence[int] | torch.Tensor,
        *,
        order: HostOrder = HostOrder.LAYER,
    ) -> TransferHandle:
        self._check_kv(kv)
        ids_cpu = self._ids(kv, block_ids, unique=True)
        n = ids_cpu.numel()
        host = self._host(kv, src, n, order)
        if n == 0:
            return _Handle(self._sync, None, [None] * kv.num_layers, ())
        if order is HostOrder.BLOCK:
            return self._load_rows(src, kv, ids_cpu, host)
        s = self._sync
        units = self._plan(kv, n, ramp_at_end=True)
        layer_events: list[Any] = [None] * kv.num_layers
        with self._lock, s.issuing():
            # Blocks vLLM zeroed (or attention still reads) on the compute stream come first.
            ids = self._device_ids("scatter", ids_cpu)
            if self._direct:
                for u in units:
                    for layer in range(u.l0, u.l1):
                        for r in range(kv.geometry.runs):
                            kv.layers[layer][r].index_copy_(
                                0, ids[u.j0 : u.j1], host[layer, r, u.j0 : u.j1]
                            )
                return _Handle(s, None, layer_events, ())
            table = self._table(kv)
            for u in units:
                slot, stage = self._slot(_LOAD, kv, u)
                s.wait("h2d", self._free[_LOAD][slot])
                s.use("h2d")
                if u.j1 - u.j0 == n:
                    stage.copy_(host[u.l0 : u.l1], non_blocking=True)
                else:
                    for r in range(kv.geometry.runs):
                        stage[0, r].copy_(host[u.l0, r, u.j0 : u.j1], non_blocking=True)
                s.order("h2d", "scatter")
                s.use("scatter")
                self._move(False, kv, table, ids[u.j0 : u.j1], stage, (u.l0, u.l1))
                ev = s.record("scatter")
                self._free[_LOAD][slot] = ev
                if u.j1 == n:
                    for layer in range(u.l0, u.l1):
                        layer_events[layer] = ev
            done = self._free[_LOAD][slot]
        return _Handle(s, done, layer_events, (ids, src))

    # -- block-major host order ------------------------------------------------------------
    #
    # The same pipeline with the roles of layers and blocks swapped: ``plan`` over
    # (blocks, layers) groups whole blocks (every layer) while they fit a slot, else cuts
    # one block into layer ranges, so each unit's host range ``host[b0:b1, l0:l1]`` is
    # contiguous. The slot holds the unit block-major too; the per-layer gather writes a
    # strided view of it (rows of ``run_bytes``), so the d2h copy is still one copy.

    def _row_slot(self, side: int, kv: PagedKV, b: int, nl: int) -> tuple[int, torch.Tensor]:
        s = self._next[side]
        self._next[side] = (s + 1) % self.options.slots
        g = kv.geometry
        shape = (b, nl, g.runs, g.run_bytes // kv.word_bytes)
        return s, self._view(side, s, kv.word_dtype, shape)

    def _store_rows(
        self, kv: PagedKV, ids_cpu: torch.Tensor, host: torch.Tensor, dst: torch.Tensor
    ) -> TransferHandle:
        s = self._sync
        with self._lock, s.issuing():
            ids = self._device_ids("gather", ids_cpu)
            if self._direct:
                for layer in range(kv.num_layers):
                    for r in range(kv.geometry.runs):
                        torch.index_select(kv.layers[layer][r], 0, ids, out=host[:, layer, r])
                return _Handle(s, None, None, ())
            slot, table = 0, self._table(kv)
            for u in self._plan(kv, ids_cpu.numel(), ramp_at_end=False, rows=True):
                b0, b1, l0, l1 = u.l0, u.l1, u.j0, u.j1  # plan's "layers" are blocks here
                slot, stage = self._row_slot(_STORE, kv, b1 - b0, l1 - l0)
                s.wait("gather", self._free[_STORE][slot])
                s.use("gather")
                self._move(True, kv, table, ids[b0:b1], stage, (l0, l1), block_major=True)
                s.order("gather", "d2h")
                s.use("d2h")
                host[b0:b1, l0:l1].copy_(stage, non_blocking=True)
                self._free[_STORE][slot] = s.record("d2h")
            done = self._free[_STORE][slot]
        return _Handle(s, done, None, (ids, dst))

    def _load_rows(
        self, src: torch.Tensor, kv: PagedKV, ids_cpu: torch.Tensor, host: torch.Tensor
    ) -> TransferHandle:
        s = self._sync
        layer_events: list[Any] = [None] * kv.num_layers
        with self._lock, s.issuing():
            ids = self._device_ids("scatter", ids_cpu)
            if self._direct:
                for layer in range(kv.num_layers):
                    for r in range(kv.geometry.runs):
                        kv.layers[layer][r].index_copy_(0, ids, host[:, layer, r])
                return _Handle(s, None, layer_events, ())
            slot, table = 0, self._table(kv)
            for u in self._plan(kv, ids_cpu.numel(), ramp_at_end=True, rows=True):
                b0, b1, l0, l1 = u.l0, u.l1, u.j0, u.j1
                slot, stage = self._row_slot(_LOAD, kv, b1 - b0, l1 - l0)
                s.wait("h2d", self._free[_LOAD][slot])
                s.use("h2d")
                stage.copy_(host[b0:b1, l0:l1], non_blocking=True)
                s.order("h2d", "scatter")
                s.use("scatter")
                self._move(False, kv, table, ids[b0:b1], stage, (l0, l1), block_major=True)
                ev = s.record("scatter")
                self._free[_LOAD][slot] = ev
                # Units run in block order: a layer is whole after the last unit naming it.
                for layer in range(l0, l1):
                    layer_events[layer] = ev
            done = self._free[_LOAD][slot]
        return _Handle(s, done, layer_events, (ids, src))

    # -- one gather/scatter launch per unit (CUDA, Triton) ------------------------------

    def _table(self, kv: PagedKV) -> LayerTable | None:
        """The cache's layer table when units can move in one kernel launch, else None."""
        if self._kernels_off:
            return None
        table = self._tables.get(kv)
        if table is None:
            table = LayerTable(kv.layers)
            self._tables[kv] = table
            if not table.usable:
                log.info("transfer engine: one launch per layer for this cache: %s", table.reason)
        return table if table.usable else None

    def prepare(self, kv: PagedKV) -> bool:
        """Get ready to move ``kv``'s pages: build its layer table and compile the unit
        kernel for it (call once, where the caches are registered). Returns whether the
        unit kernel will run for it; without this call, the first transfer compiles it."""
        table = self._table(kv)
        if table is None:
            return False
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        stage = self._staging[_STORE][0].view(kv.word_dtype)
        with torch.cuda.device(self.device):
            compile_for(
                table,
                ids,
                stage,
                kv.geometry.run_bytes // kv.word_bytes,
                kv.geometry.runs,
                self.options.kernel_programs,
            )
        return True

    def _move(
        self,
        store: bool,
        kv: PagedKV,
        table: LayerTable | None,
        ids: torch.Tensor,
        stage: torch.Tensor,
        layers: tuple[int, int],
        *,
        block_major: bool = False,
    ) -> None:
        """Pages ``ids`` of ``layers`` into (store) or out of the staging view ``stage``,
        on the current stream: one kernel launch for a unit of several layers, else one
        ``index_select`` / ``index_copy_`` per layer."""
        l0, l1 = layers
        # One Triton launch costs more host CPU than one ``index_select``: a one-layer
        # unit keeps the plain kernel.
        if table is not None and l1 - l0 >= 2:
            g = kv.geometry
            launch(
                store,
                table,
                ids,
                stage,
                first_layer=l0,
                num_layers=l1 - l0,
                runs=g.runs,
                n=ids.numel(),
                run_words=g.run_bytes // kv.word_bytes,
                block_major=block_major,
                programs=self.options.kernel_programs,
            )
            return
        for layer in range(l0, l1):
            view = stage[:, layer - l0].transpose(0, 1) if block_major else stage[layer - l0]
            if store:
                torch.index_select(kv.layers[layer], 1, ids, out=view)
            else:
                kv.layers[layer].index_copy_(1, ids, view)

    def _plan(
        self, kv: PagedKV, n: int, *, ramp_at_end: bool, rows: bool = False
    ) -> tuple[Unit, ...]:
        """Units of an ``n``-block transfer; loads ramp at the end, stores at the start.

        ``rows``: for the block-major host order (staged only), over (blocks, layers).
        """
        outer, inner = (n, kv.num_layers) if rows else (kv.num_layers, n)
        return plan(
            outer,
            inner,
            kv.geometry.page_bytes,
            self._unit_bytes(kv, n),
            ramp_bytes=0 if self._direct else self.options.ramp_bytes,
            ramp_at_end=ramp_at_end,
        )

    def _unit_bytes(self, kv: PagedKV, n: int) -> int:
        if self._direct:
            # No staging: one unit per layer keeps the loop simple and memory flat.
            return max(kv.geometry.page_bytes * n, kv.geometry.page_bytes)
        return self.options.slot_bytes

    def _check_kv(self, kv: PagedKV) -> None:
        if self._closed:
            raise ClosedError("the transfer engine was closed")
        if kv.device != self.device:
            raise InputError(
                f"the cache is on {kv.device}, this engine moves data for {self.device}"
            )

    def close(self) -> None:
        """Wait for queued transfers and release the staging memory. Idempotent."""
        self._sync.drain()
        self._staging = []
        self._views.clear()
        self._closed = True
