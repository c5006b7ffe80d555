"""lz4 with byte-plane shuffle: a cheap codec for fp16/bf16 KV on slow tiers.

Plain lz4 finds almost nothing to compress in raw fp16/bf16 KV (about 1.00x): the
bytes of one value alternate between a high byte (sign, exponent, top of the
mantissa), whose values repeat a lot, and a low byte that is close to noise. Splitting
the buffer into byte planes first (all low bytes, then all high bytes) puts the
repetitive high bytes next to each other, where lz4 finds them.

A chunk whose ratio falls under ``min_ratio`` is stored raw (codec id 0), so incompressible
data costs one compression attempt and nothing on read. ``lz4`` is imported on first use.
Thread-safe (no shared state); lz4 releases the GIL while it works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import CorruptChunkError

RAW = 0
LZ4_SHUFFLE = 1


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded chunk: ``codec`` is RAW (``payload`` is the input) or LZ4_SHUFFLE."""

    codec: int
    payload: Any  # a buffer: bytes, or the caller's own view when RAW


def shuffle(data: np.ndarray, width: int = 2) -> np.ndarray:
    """Byte planes of ``data`` (uint8, length a multiple of ``width``): plane 0 first."""
    return np.ascontiguousarray(data.reshape(-1, width).T).reshape(-1)


def unshuffle(planes: np.ndarray, out: np.ndarray, width: int = 2) -> None:
    """Inverse of :func:`shuffle`, written into ``out``."""
    out.reshape(-1, width)[:] = planes.reshape(width, -1).T


def encode(data: np.ndarray, *, width: int = 2, min_ratio: float = 1.1) -> Encoded:
    """Compress one chunk's bytes, or keep them raw when it does not pay.

    Args:
        data: the chunk, as a flat uint8 array.
        width: bytes per element (2 for fp16/bf16; 1 turns the shuffle off).
        min_ratio: raw size / compressed size under which the chunk stays raw.
    """
    import lz4.block

    if data.nbytes % width:
        width = 1
    packed = lz4.block.compress(shuffle(data, width) if width > 1 else data, store_size=False)
    if len(packed) * min_ratio > data.nbytes:
        return Encoded(RAW, data)
    return Encoded(LZ4_SHUFFLE | (width << 4), packed)


def decode(codec: int, payload: Any, out: np.ndarray) -> None:
    """Decode a stored chunk into ``out`` (uint8, the chunk's raw length).

    Raises:
        CorruptChunkError: the payload does not decode to ``out.nbytes`` bytes.
    """
    if codec == RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8, count=out.nbytes)
        return
    import lz4.block

    width = codec >> 4
    try:
        raw = lz4.block.decompress(payload, uncompressed_size=out.nbytes)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptChunkError(f"lz4 payload does not decode: {exc}") from exc
    if len(raw) != out.nbytes:
        raise CorruptChunkError(f"lz4 payload decodes to {len(raw)} B, expected {out.nbytes} B")
    planes = np.frombuffer(raw, dtype=np.uint8)
    if width > 1:
        unshuffle(planes, out, width)
    else:
        out[:] = planes
