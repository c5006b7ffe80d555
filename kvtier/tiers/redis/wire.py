"""The value format of the ``redis`` tier: one Redis value per chunk, header then payload.

Layout (little-endian, 32 bytes of header)::

    offset size field
    0      2    magic        b"KV"
    2      1    version      FORMAT_VERSION
    3      1    codec        0 = raw bytes; else a kvtier.codec id (lz4 byte-plane), with
                             flag 0x80 when the payload is sealed (AES-256-GCM, kvtier.crypto)
    4      4    stored_len   payload bytes as stored (after the codec)
    8      8    namespace    xxh3-64 of (tenant, KV spec fingerprint): what the value belongs to
    16     8    raw_len      chunk bytes after decoding (the value the store asked to keep)
    24     8    checksum     xxh3-64 of (chunk key || raw chunk bytes, before the codec)
    32     ...  payload

One value per chunk makes a store a single ``SET`` and a load a single ``GET``: one round
trip, atomic (LMCache writes a metadata key and a data key in two round trips). The
checksum covers the chunk key too, so a value copied or renamed under another key fails
verification. The header alone (``GETRANGE key 0 31``) answers "is it there, how long,
for whom" without moving the payload; :func:`parse_header` is what probes use.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvtier import codec as kvcodec
from kvtier.errors import CorruptChunkError

if TYPE_CHECKING:
    from kvtier.crypto import Cipher

MAGIC = b"KV"
FORMAT_VERSION = 1
CODEC_RAW = kvcodec.RAW

_HEADER = struct.Struct("<2sBBIQQQ")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 32


def namespace_id(tenant: str, spec_fingerprint: str) -> int:
    """The 64-bit namespace a value's header carries."""
    return xxhash.xxh3_64_intdigest(f"kvtier/redis/v1\0{tenant}\0{spec_fingerprint}".encode())


def checksum(key: bytes, payload: memoryview | bytes) -> int:
    """xxh3-64 over the chunk key, then the raw payload (no copy of the payload)."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(payload)
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class Framed:
    """One value as two pieces that go on the wire back to back: the payload is not copied.

    :class:`kvtier.tiers.redis.nodes.FramedPacker` writes it as one RESP bulk string.
    """

    header: bytes
    payload: memoryview

    def __len__(self) -> int:
        return len(self.header) + self.payload.nbytes

    def tobytes(self) -> bytes:
        """The value as one bytes object (a copy; for tests and tools)."""
        return b"".join((self.header, self.payload))


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed value header (see the module docstring for the fields)."""

    codec: int
    stored_len: int
    namespace: int
    raw_len: int
    checksum: int


def encode(
    key: bytes,
    payload: memoryview,
    namespace: int,
    *,
    compress: bool = False,
    width: int = 2,
    cipher: Cipher | None = None,
) -> Framed:
    """One Redis value: header plus ``payload``, framed without copying a raw payload.

    With ``compress``, the chunk is tried with the lz4 byte-plane codec
    (:mod:`kvtier.codec`, ``width`` bytes per element) and kept raw when that does not
    pay. The checksum is over the raw bytes, so it also checks the codec's round trip.
    With a ``cipher`` the (compressed) payload is then sealed for ``key``.
    """
    digest = checksum(key, payload)
    codec_id, body = CODEC_RAW, payload
    if compress:
        enc = kvcodec.encode(np.frombuffer(payload, dtype=np.uint8), width=width)
        if enc.codec != kvcodec.RAW:
            codec_id, body = enc.codec, memoryview(enc.payload)
    if cipher is not None:
        sealed = bytearray(body.nbytes + cipher.overhead)
        cipher.seal_into(key, body, memoryview(sealed))
        codec_id, body = codec_id | kvcodec.SEALED, memoryview(sealed)
    head = _HEADER.pack(
        MAGIC, FORMAT_VERSION, codec_id, body.nbytes, namespace, payload.nbytes, digest
    )
    return Framed(head, body)


def parse_header(value: bytes | memoryview, namespace: int) -> Header:
    """Parse and check the first :data:`HEADER_BYTES` of a value.

    Raises:
        CorruptChunkError: too short, wrong magic, unknown version or codec, a
            length that disagrees, or another namespace's value.
    """
    if len(value) < HEADER_BYTES:
        raise CorruptChunkError(f"value of {len(value)} B is shorter than the header")
    magic, version, codec, stored_len, ns, raw_len, digest = _HEADER.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptChunkError(f"bad magic/version {magic!r}/{version}")
    raw = codec == CODEC_RAW
    base = codec & ~kvcodec.SEALED
    if not (base == CODEC_RAW or base & 0x0F == kvcodec.LZ4_SHUFFLE) or (
        raw and stored_len != raw_len
    ):
        raise CorruptChunkError(f"unknown codec {codec} or lengths {stored_len}/{raw_len}")
    if ns != namespace:
        raise CorruptChunkError(f"value of namespace {ns:#x}, expected {namespace:#x}")
    return Header(codec, stored_len, ns, raw_len, digest)


def decode_into(
    key: bytes, value: bytes, namespace: int, dst: memoryview, cipher: Cipher | None = None
) -> None:
    """Verify a whole value and copy its payload into ``dst`` (exactly its length).

    Raises:
        CorruptChunkError: the header, the length, the checksum or a sealed value's tag
            is wrong, or the value is sealed and there is no ``cipher`` (or in clear and
            there is one); ``dst`` may hold part of the payload.
    """
    head = parse_header(value, namespace)
    if len(value) != HEADER_BYTES + head.stored_len:
        want = HEADER_BYTES + head.stored_len
        raise CorruptChunkError(f"value of {len(value)} B, its header says {want} B")
    if head.raw_len != dst.nbytes:
        raise CorruptChunkError(f"value holds {head.raw_len} B, the slot expects {dst.nbytes}")
    payload = memoryview(value)[HEADER_BYTES:]
    if bool(head.codec & kvcodec.SEALED) != (cipher is not None):
        raise CorruptChunkError("sealed value without a key, or a value in clear")
    if cipher is not None and head.codec == kvcodec.SEALED:  # raw bytes: opened into dst
        cipher.open_into(key, payload, dst)
        if checksum(key, dst) != head.checksum:
            raise CorruptChunkError("checksum mismatch")
        return
    if cipher is not None:
        payload = memoryview(cipher.open(key, payload))
        head = Header(head.codec & ~kvcodec.SEALED, *dataclasses.astuple(head)[1:])
    if head.codec == CODEC_RAW:
        if checksum(key, payload) != head.checksum:
            raise CorruptChunkError("checksum mismatch")
        dst[:] = payload
        return
    kvcodec.decode(head.codec, payload, np.frombuffer(dst, dtype=np.uint8))
    if checksum(key, dst) != head.checksum:
        raise CorruptChunkError("checksum mismatch after decoding")
