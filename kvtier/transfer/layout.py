"""Byte geometry of a paged KV cache, as vLLM hands it to a connector.

vLLM gives a connector one tensor per attention layer. Whatever the attention backend,
the tensor has a *block* dimension, and one block of one layer is a small number of
contiguous byte runs (vLLM calls a block of one layer a page):

==========================  ===================================  ============  =======
layout                      per-layer tensor (logical)           block dim     runs
==========================  ===================================  ============  =======
``LBHNC`` (vLLM 0.32)        ``[B, H, N, 2*D]``, identity         0             1
``LBNHC`` (vLLM 0.32, FA)    ``[B, H, N, 2*D]``, stored B,N,H,C   0             1
``BLHNC`` (cross-layer)      ``[B, H, N, 2*D]``, stride(0)=L*page 0             1
``KV_NHD`` (older FA)        ``[2, B, N, H, D]``                  1             2 (K, V)
``KV_HND`` (older FlashInfer) ``[2, B, H, N, D]``                 1             2 (K, V)
==========================  ===================================  ============  =======

(B blocks, H KV heads, N tokens per block, D head size, C = 2*D channels.) A
:class:`PagedLayer` records that geometry in bytes and exposes the layer as a strided
``(runs, num_blocks, run_words)`` integer view of the same storage, so one
``index_select`` / ``index_copy_`` on dim 1 moves whole pages of any layout and any
dtype (bf16, fp16, fp8) bit-exactly. The block interior is backend-specific, so pages
are opaque bytes here and are never split into K/V or tokens beyond what the layout
itself separates.

The host format of ``n`` blocks is ``[layer][run][block][run_bytes]``, contiguous: a
layer group's bytes are one contiguous host range, so each pipeline step is one copy.

Layouts that split a block across heads (vLLM's ``LHBNC``, ``BHLNC``) are refused with
:class:`~kvtier.errors.InputError`; no CUDA backend of vLLM 0.32 picks them by default.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import InputError

if TYPE_CHECKING:
    import torch


class Layout(enum.Enum):
    """Paged KV layouts :func:`make_paged_cache` can build (tests and benchmarks)."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    BLHNC = "BLHNC"
    KV_NHD = "KV_NHD"
    KV_HND = "KV_HND"


# Stride order of vLLM's logical [L, B, H, N, C] per layout (vllm/v1/kv_cache_layout.py).
_VLLM_ORDER: dict[Layout, tuple[int, ...]] = {
    Layout.LBHNC: (0, 1, 2, 3, 4),
    Layout.LBNHC: (0, 1, 3, 2, 4),
    Layout.BLHNC: (1, 0, 2, 3, 4),
}


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """The byte geometry one layer's pages share (all layers of a cache must match).

    Attributes:
        runs: contiguous byte runs per page (1, or 2 when K and V are separate planes).
        run_bytes: bytes of one run.
        num_blocks: blocks in the layer.
    """

    runs: int
    run_bytes: int
    num_blocks: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.runs * self.run_bytes


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One layer's paged KV as a strided word view of its storage.

    Attributes:
        geometry: runs, run bytes and block count.
        words: ``(runs, num_blocks, run_words)`` integer view aliasing the layer's bytes.
        word_bytes: size of one element of ``words`` (8, 4, 2 or 1).
    """

    geometry: PageGeometry
    words: torch.Tensor
    word_bytes: int


def _word_bytes(*values: int) -> int:
    for w in (8, 4, 2, 1):
        if all(v % w == 0 for v in values):
            return w
    return 1  # unreachable: 1 divides everything


def describe(t: torch.Tensor, block_dim: int | None = None) -> PagedLayer:
    """Describe one layer's KV tensor as pages of contiguous byte runs.

    Args:
        t: the per-layer tensor vLLM registered (any dtype, any stride permutation).
        block_dim: the dimension that indexes blocks; None infers it: 1 for a 5-D
            tensor whose first dimension is 2 (K/V planes), else 0.

    Returns:
        The layer's page geometry and a word view of its bytes.

    Raises:
        InputError: the layer's blocks are not made of contiguous runs (head-outer
            layouts such as LHBNC), or the tensor's strides are negative or overlapping.
    """
    import torch

    if block_dim is None:
        block_dim = 1 if t.dim() == 5 and t.shape[0] == 2 else 0
    if block_dim not in (0, 1) or t.dim() <= block_dim + 1:
        raise InputError(f"block_dim {block_dim} does not fit a tensor of shape {tuple(t.shape)}")
    elem = t.element_size()
    inner = sorted(range(block_dim + 1, t.dim()), key=lambda d: t.stride(d))
    expect = 1
    for d in inner:
        if t.shape[d] != 1 and t.stride(d) != expect:
            raise InputError(
                f"a block of this layer is not one contiguous run (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); head-outer layouts (LHBNC, BHLNC) are not supported"
            )
        expect *= t.shape[d]
    run_elems = expect
    runs = t.shape[0] if block_dim == 1 else 1
    run_stride = t.stride(0) if block_dim == 1 else run_elems
    block_stride = t.stride(block_dim)
    if min(run_stride, block_stride) <= 0:
        raise InputError(f"negative or zero strides {t.stride()} are not supported")
    run_bytes = run_elems * elem
    offset_bytes = int(t.storage_offset()) * elem
    w = _word_bytes(run_bytes, run_stride * elem, block_stride * elem, offset_bytes)
    geo = PageGeometry(runs=runs, run_bytes=run_bytes, num_blocks=t.shape[block_dim])
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(
        t.untyped_storage(),
        offset_bytes,
        (runs, geo.num_blocks, run_bytes),
        (run_stride * elem, block_stride * elem, 1),
    )
    words = raw.view(_WORD_DTYPES[w]())
    return PagedLayer(geometry=geo, words=words, word_bytes=w)


def _i64() -> torch.dtype:
    import torch

    return torch.int64


def _i32() -> torch.dtype:
    import torch

    return torch.int32


def _i16() -> torch.dtype:
    import torch

    return torch.int16


def _u8() -> torch.dtype:
    import torch

    return torch.uint8


_WORD_DTYPES = {8: _i64, 4: _i32, 2: _i16, 1: _u8}


class PagedKV:
    """All layers of one paged KV cache, described once (at ``register_kv_caches``).

    Args:
        layers: per-layer tensors in layer order (as vLLM registers them).
        block_dim: see :func:`describe`.

    Raises:
        InputError: no layers, layers on several devices, or layers of different
            page geometry.
    """

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int | None = None) -> None:
        if not layers:
            raise InputError("a paged KV cache needs at least one layer")
        described = [describe(t, block_dim) for t in layers]
        geo = described[0].geometry
        for i, d in enumerate(described):
            if d.geometry != geo:
                raise InputError(f"layer {i} has geometry {d.geometry}, layer 0 has {geo}")
            if layers[i].device != layers[0].device:
                raise InputError(
                    f"layer {i} is on {layers[i].device}, layer 0 on {layers[0].device}"
                )
        self.geometry = geo
        self.device = layers[0].device
        # One word size for all layers, so staging and host views share one dtype.
        self.word_bytes = min(d.word_bytes for d in described)
        self.layers = [self._rewiden(d) for d in described]
        self.names: list[str] = [str(i) for i in range(len(layers))]
        self._index: dict[str, int] = {name: i for i, name in enumerate(self.names)}

    def _rewiden(self, d: PagedLayer) -> torch.Tensor:
        if d.word_bytes == self.word_bytes:
            return d.words
        w = d.words.view(_WORD_DTYPES[1]())
        return w.view(_WORD_DTYPES[self.word_bytes]())

    @classmethod
    def from_named(
        cls, kv_caches: Mapping[str, torch.Tensor], block_dim: int | None = None
    ) -> PagedKV:
        """Describe the dict vLLM passes to ``register_kv_caches`` (layer name -> tensor).

        Layers keep the dict's order (vLLM registers them in model order), so layer ``i``
        of the host format and of :meth:`TransferHandle.wait_for_layer` is the i-th name;
        :meth:`layer_index` maps a name (as ``wait_for_layer_load`` receives it) back.
        """
        kv = cls(list(kv_caches.values()), block_dim)
        kv.names = list(kv_caches)
        kv._index = {name: i for i, name in enumerate(kv.names)}
        return kv

    def layer_index(self, name: str) -> int:
        """Position of layer ``name`` (built with :meth:`from_named`).

        Raises:
            InputError: an unknown name.
        """
        try:
            return self._index[name]
        except KeyError:
            raise InputError(f"no layer named {name!r} in this cache") from None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def word_dtype(self) -> torch.dtype:
        return _WORD_DTYPES[self.word_bytes]()

    def nbytes(self, n_blocks: int) -> int:
        """Host bytes that ``n_blocks`` blocks of every layer take."""
        return self.num_layers * self.geometry.page_bytes * n_blocks


def make_paged_cache(
    layout: Layout,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Allocate a KV cache shaped and strided the way vLLM allocates it.

    vLLM 0.32 layouts (LBHNC, LBNHC, BLHNC) are per-layer ``[B, H, N, 2*D]`` views of
    one shared buffer, with strides built like ``vllm.v1.kv_cache_interface.
    compute_layout_strides``; the KV-first layouts are one ``[2, B, ...]`` tensor per
    layer, as older FlashAttention/FlashInfer backends allocated them. Contents are
    uninitialised: fill them before use.
    """
    import torch

    shape5 = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
    if layout in _VLLM_ORDER:
        order = _VLLM_ORDER[layout]
        strides = [0] * 5
        cur = 1
        for dim in reversed(order):
            strides[dim] = cur
            cur *= shape5[dim]
        raw = torch.empty(math.prod(shape5), dtype=dtype, device=device)
        return [
            raw.as_strided(shape5[1:], tuple(strides[1:]), storage_offset=layer * strides[0])
            for layer in range(num_layers)
        ]
    if layout is Layout.KV_NHD:
        shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    else:
        shape = (2, num_blocks, num_kv_heads, block_size, head_size)
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
