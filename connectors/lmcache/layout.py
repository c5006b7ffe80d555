"""Per-chunk metadata for the remote plug-in: LMCache's ``save_chunk_meta``.

LMCache's connectors store a header (shapes, dtypes, memory format) in front of every
value when ``save_chunk_meta`` is on, its default, so that a value of any layout comes
back as it went in. Most values need none: a chunk the engine stores has the engine's
layout, full or cut short in its token dimension (the prompt's partial last chunk), and
the engine's metadata and the value's length say which (LMCache's
``reshape_partial_chunk``). Those are stored bare, so loads land in place, several
chunks per request, and in memory shared with the daemon with no copy here.

Every other value (another shape or format, a partial chunk of a model with several
KV layer groups, which ``reshape_partial_chunk`` cannot rebuild) is stored *described*:
a header, the bytes, and padding that makes its length one no bare value can have (not
a whole number of tokens, or longer than a chunk). A load tells the two apart by length
alone, so bare values cost nothing, and a described one is copied into a memory object
of its own layout. With ``save_chunk_meta`` off every value is stored bare, as LMCache's
own connectors do.

Layout of a described value (little-endian)::

    magic "KVTLMCM1" | u32 header_bytes | u64 data_bytes | u32 memory format | u32 groups
    per group: u8 len, dtype name (ASCII, e.g. "bfloat16") | u8 ndim | u64 dims[ndim]
    data (data_bytes) | zero padding

Stateless; every function is thread-safe.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

log = logging.getLogger(__name__)

MAGIC = b"KVTLMCM1"
_HEAD = struct.Struct("<8sIQII")
_DIM = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Geometry:
    """The layout a bare value is read back with: the engine's chunk.

    Attributes:
        shapes: per KV layer group, a full chunk's shape (LMCache's ``meta_shapes``).
        dtypes: per group, its dtype (``meta_dtypes``).
        fmt: the memory format (``meta_fmt``).
        chunk_bytes: a full chunk's length (``full_chunk_size_bytes``).
        token_bytes: one token's length (``single_token_size``).
    """

    shapes: Sequence[torch.Size]
    dtypes: Sequence[torch.dtype]
    fmt: MemoryFormat
    chunk_bytes: int
    token_bytes: int

    def bare_length(self, n: int) -> bool:
        """True when a value of ``n`` bytes is read back bare (a whole number of tokens,
        at most a chunk): what ``reshape_partial_chunk`` accepts."""
        return 0 < n <= self.chunk_bytes and n % self.token_bytes == 0

    def implies(self, obj: MemoryObj, nbytes: int) -> bool:
        """True when ``obj`` (``nbytes`` long) comes back as it is from its bytes alone."""
        if obj.get_memory_format() != self.fmt or list(obj.get_dtypes()) != list(self.dtypes):
            return False
        shapes = [torch.Size(s) for s in obj.get_shapes()]
        if nbytes == self.chunk_bytes:
            return shapes == [torch.Size(s) for s in self.shapes]
        if len(self.shapes) != 1 or len(self.shapes[0]) != 4 or not self.bare_length(nbytes):
            return False
        # What reshape_partial_chunk makes of nbytes: the token dimension cut short.
        # LMCache leaves ``shapes`` stale on an object it cut itself: check ``shape`` too.
        cut = list(self.shapes[0])
        cut[2] = nbytes // self.token_bytes
        want = torch.Size(cut)
        return shapes == [want] or torch.Size(obj.meta.shape) == want


def describe(obj: MemoryObj, data: memoryview, geometry: Geometry) -> bytearray | None:
    """``data`` (``obj``'s bytes) with its header and padding; None when the layout
    cannot be written down (an object without dtypes, more than 255 dimensions)."""
    try:
        shapes = [torch.Size(s) for s in obj.get_shapes()]
        dtypes = list(obj.get_dtypes())
        fmt = int(obj.get_memory_format().value)
        groups = bytearray()
        for shape, dtype in zip(shapes, dtypes, strict=True):
            name = str(dtype).removeprefix("torch.").encode("ascii")
            groups += bytes([len(name)]) + name + bytes([len(shape)])
            groups += b"".join(_DIM.pack(d) for d in shape)
    except (AttributeError, TypeError, ValueError, AssertionError, OverflowError) as exc:
        log.debug("kvtier remote plug-in: a layout it cannot describe (%s): stored bare", exc)
        return None
    head = _HEAD.size + len(groups)
    length = head + data.nbytes
    pad = 0
    if geometry.bare_length(length):
        # One byte more is no whole number of tokens; with one-byte tokens, go past a chunk.
        pad = 1 if geometry.token_bytes > 1 else geometry.chunk_bytes + 1 - length
    out = bytearray(length + pad)
    _HEAD.pack_into(out, 0, MAGIC, head, data.nbytes, fmt, len(shapes))
    out[_HEAD.size : head] = groups
    out[head:length] = data
    return out


@dataclass(frozen=True, slots=True)
class Described:
    """A described value, parsed: its layout, and where its bytes lie in the value."""

    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    fmt: MemoryFormat
    data: memoryview


def parse(value: memoryview) -> Described:
    """The layout and bytes of a described value.

    Raises:
        ValueError: not a described value, or one whose header does not add up.
    """
    if value.nbytes < _HEAD.size or bytes(value[:8]) != MAGIC:
        raise ValueError(f"a value of {value.nbytes} B that is neither bare nor described")
    _, head, nbytes, fmt_value, n_groups = _HEAD.unpack_from(value, 0)
    if head > value.nbytes or head + nbytes > value.nbytes:
        raise ValueError(f"a described value of {value.nbytes} B announces {head}+{nbytes} B")
    shapes: list[torch.Size] = []
    dtypes: list[torch.dtype] = []
    at = _HEAD.size
    try:
        for _ in range(n_groups):
            name = bytes(value[at + 1 : at + 1 + value[at]]).decode("ascii")
            at += 1 + len(name)
            dtype = getattr(torch, name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name!r} is no torch dtype")
            ndim = value[at]
            at += 1
            shapes.append(torch.Size(_DIM.unpack_from(value, at + 8 * i)[0] for i in range(ndim)))
            dtypes.append(dtype)
            at += 8 * ndim
        fmt = MemoryFormat(fmt_value)
    except (IndexError, AttributeError, UnicodeDecodeError, struct.error) as exc:
        raise ValueError(f"a described value with a malformed header: {exc}") from exc
    if at != head:
        raise ValueError(f"a described value's header is {at} B, it announces {head} B")
    want = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    if want != nbytes:
        raise ValueError(f"a described value of {nbytes} B whose layout holds {want} B")
    return Described(shapes, dtypes, fmt, value[head : head + nbytes])
