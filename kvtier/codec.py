"""lz4 with byte-plane shuffle: a cheap codec for fp16/bf16 KV on slow tiers.

Plain lz4 finds almost nothing to compress in raw fp16/bf16 KV: the
bytes of one value alternate between a high byte (sign, exponent, top of the
mantissa), whose values repeat a lot, and a low byte that is close to noise. Splitting
the buffer into byte planes first (all low bytes, then all high bytes) puts the
repetitive high bytes next to each other, where lz4 finds them.

Only the high plane is compressed; the low plane is stored as it is (lz4 finds nothing in
it, and skipping it doubles the speed). A chunk whose ratio falls under ``min_ratio`` is
stored raw (codec id 0), so incompressible
data costs one compression attempt and nothing on read. ``lz4`` is imported on first use.
Thread-safe (no shared state); lz4 releases the GIL while it works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import CorruptChunkError, PluginError, TierIOError

if TYPE_CHECKING:
    from kvtier.crypto import Cipher

RAW = 0
LZ4_SHUFFLE = 1
SEALED = 0x80
"""Flag on a stored codec id: the payload is sealed (:mod:`kvtier.crypto`); the codec
bits below it say how the opened payload decodes."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded chunk: ``codec`` is RAW (``payload`` is the input) or LZ4_SHUFFLE."""

    codec: int
    payload: Any  # a buffer: bytes, or the caller's own view when RAW


def shuffle(data: npt.NDArray[Any], width: int = 2) -> npt.NDArray[Any]:
    """Byte planes of ``data`` (uint8, length a multiple of ``width``): plane 0 first."""
    if width == 2:  # shifts and masks: far faster than a strided transpose in numpy
        u = data.view("<u2")
        out = np.empty(data.nbytes, dtype=np.uint8)
        np.bitwise_and(u, 0xFF, out=out[: u.size], casting="unsafe")
        np.right_shift(u, 8, out=out[u.size :], casting="unsafe")
        return out
    return np.ascontiguousarray(data.reshape(-1, width).T).reshape(-1)


def unshuffle(planes: npt.NDArray[Any], out: npt.NDArray[Any], width: int = 2) -> None:
    """Inverse of :func:`shuffle`, written into ``out``."""
    if width == 2:
        n = planes.size // 2
        u = out.view("<u2")
        np.left_shift(planes[n:], 8, out=u, dtype=np.uint16)
        np.bitwise_or(u, planes[:n], out=u)
        return
    out.reshape(-1, width)[:] = planes.reshape(width, -1).T


_LEN = 4  # bytes of the compressed-plane length at the head of a shuffled payload


def encode(data: npt.NDArray[Any], *, width: int = 2, min_ratio: float = 1.1) -> Encoded:
    """Compress one chunk's bytes, or keep them raw when it does not pay.

    With ``width`` 2 the high-byte plane (sign and exponent of bf16/fp16) is lz4-compressed
    and the low-byte plane, close to noise, is stored as it is: the same ratio as
    compressing both, at twice the speed. Payload: u32 length of the compressed plane,
    the compressed plane, the raw plane.

    Args:
        data: the chunk, as a flat uint8 array.
        width: bytes per element (2 for fp16/bf16; 1 turns the shuffle off).
        min_ratio: raw size / compressed size under which the chunk stays raw.
    """
    import lz4.block

    if data.nbytes % width or width not in (1, 2):
        width = 1
    if width == 2:
        planes = shuffle(data, 2)
        half = data.nbytes // 2
        high = lz4.block.compress(planes[half:], store_size=False)
        packed = len(high).to_bytes(_LEN, "little") + high + planes[:half].tobytes()
    else:
        packed = lz4.block.compress(data, store_size=False)
    if len(packed) * min_ratio > data.nbytes:
        return Encoded(RAW, data)
    return Encoded(LZ4_SHUFFLE | (width << 4), packed)


def require(tier: str) -> None:
    """Refuse to start tier ``tier`` with the codec on when lz4 is not installed: a
    start-up error naming the extra, not a ``ModuleNotFoundError`` inside the first put.

    Raises:
        PluginError: lz4 is missing.
    """
    try:
        import lz4.block  # noqa: F401
    except ImportError as exc:
        raise PluginError(
            f"tier {tier}: codec lz4-shuffle needs lz4 (pip install 'kvtier[nvme]')"
        ) from exc


def decode(codec: int, payload: Any, out: npt.NDArray[Any]) -> None:
    """Decode a stored chunk into ``out`` (uint8, the chunk's raw length).

    Raises:
        CorruptChunkError: the payload does not decode to ``out.nbytes`` bytes.
        TierIOError: the chunk is encoded and lz4 is not installed (a miss, not corrupt).
    """
    if codec == RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8, count=out.nbytes)
        return
    try:
        import lz4.block
    except ImportError as exc:
        raise TierIOError(
            "the chunk is stored lz4-encoded and lz4 is not installed (pip install 'kvtier[nvme]')"
        ) from exc

    width = codec >> 4
    buf = memoryview(payload).cast("B")
    try:
        if width == 2:
            half = out.nbytes // 2
            n = int.from_bytes(buf[:_LEN], "little")
            if _LEN + n + half != buf.nbytes:
                raise CorruptChunkError(
                    f"shuffled payload of {buf.nbytes} B does not match its header"
                )
            high = lz4.block.decompress(buf[_LEN : _LEN + n], uncompressed_size=half)
            if len(high) != half:
                raise CorruptChunkError(f"lz4 plane decodes to {len(high)} B, expected {half} B")
            planes = np.empty(out.nbytes, dtype=np.uint8)
            planes[:half] = np.frombuffer(buf[_LEN + n :], dtype=np.uint8)
            planes[half:] = np.frombuffer(high, dtype=np.uint8)
            unshuffle(planes, out, 2)
            return
        raw = lz4.block.decompress(buf, uncompressed_size=out.nbytes)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptChunkError(f"lz4 payload does not decode: {exc}") from exc
    if len(raw) != out.nbytes:
        raise CorruptChunkError(f"lz4 payload decodes to {len(raw)} B, expected {out.nbytes} B")
    out[:] = np.frombuffer(raw, dtype=np.uint8)


def encode_stored(
    chunk: npt.NDArray[Any],
    key: bytes,
    cipher: Cipher | None,
    compress: bool,
    min_ratio: float,
    into: Callable[[int], Any],
) -> tuple[Any, int, int]:
    """What a tier stores for one chunk: compressed when ``compress`` pays, then sealed
    for ``key`` when there is a ``cipher`` (flag :data:`SEALED`), written into the
    buffer ``into(n)`` gives for its ``n`` bytes. Returns (buffer, n, codec id)."""
    enc = encode(chunk, min_ratio=min_ratio) if compress else None
    payload = chunk if enc is None else np.frombuffer(enc.payload, dtype=np.uint8)
    codec = RAW if enc is None else enc.codec
    if cipher is None:
        buf = into(payload.nbytes)
        np.frombuffer(buf, dtype=np.uint8, count=payload.nbytes)[:] = payload
        return buf, payload.nbytes, codec
    n = payload.nbytes + cipher.overhead
    buf = into(n)
    cipher.seal_into(key, payload, memoryview(buf).cast("B")[:n])  # no copy of the plaintext
    return buf, n, codec | SEALED


def decode_stored(
    codec: int, payload: Any, out: npt.NDArray[Any], *, key: bytes, cipher: Cipher | None
) -> None:
    """Inverse of :func:`encode_stored`, into ``out``.

    Raises:
        CorruptChunkError: a sealed payload fails its tag, or the payload does not decode.
        TierIOError: the chunk is sealed and there is no cipher, or lz4 is missing.
    """
    if codec & SEALED:
        if cipher is None:
            raise TierIOError("the chunk is sealed and encryption is off")
        if codec == SEALED:  # raw bytes: opened straight into ``out``
            cipher.open_into(key, payload, out.data.cast("B"))
            return
        payload = cipher.open(key, payload)
    elif cipher is not None:
        raise CorruptChunkError("chunk stored in clear while encryption is on")
    decode(codec & ~SEALED, payload, out)
