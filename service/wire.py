"""The binary batch format of the daemon: many values in one body, with an offset table.

Used by ``POST /v1/batch/put`` (request body) and ``POST /v1/batch/get`` (response
body), by the server and by the client alike. Sans-IO: it only packs and parses bytes.

Layout (all integers little-endian)::

    offset  size        field
    0       4           magic b"KVTB"
    4       2           version (1)
    6       2           flags (bit 0, TRUNCATED: a batch get stopped at the response
                        size limit; more hits may follow from key ``count`` on;
                        bit 1, PREFIX: a batch put names prefix keys, below)
    8       4           count: entries in the table
    12      4           payload_offset: where the payload starts, from byte 0;
                        at least 16 + 32 * count (a writer may pad, e.g. to align)
    16      32 * count  table, one entry per value:
                          16 B key (raw bytes, not hex)
                          8 B  offset of the value from payload_offset
                          8 B  length of the value in bytes (>= 1)
    (PREFIX only, right after the table)
                4           prefix_count: keys of the sequence's chunks before these
                4           reserved (0)
                16 * prefix_count  the prefix keys: the daemon keeps them from
                        eviction while it makes room for this batch (a sequence longer
                        than the store keeps its head); at most ``limits.max_prefix_keys``
    payload_offset ...  payload: the values

Entries are in key order; each value starts at or after the end of the previous one
(no overlap) and ends inside the body. Writers normally pack values back to back,
which lets the server store a run of equal-length values with one copy.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvtier.errors import InputError
from kvtier.keys import KEY_BYTES, ChunkKey

MAGIC = b"KVTB"
VERSION = 1
HEADER = struct.Struct("<4sHHII")
HEADER_BYTES = HEADER.size  # 16
ENTRY_BYTES = 32
FLAG_TRUNCATED = 1
FLAG_PREFIX = 2
PREFIX_HEAD = struct.Struct("<II")  # prefix_count, reserved
MEDIA_TYPE = "application/octet-stream"

TABLE_DTYPE = np.dtype([("key", f"V{KEY_BYTES}"), ("offset", "<u8"), ("length", "<u8")])


@dataclass(frozen=True, slots=True)
class Batch:
    """A parsed batch body. ``payload`` is a view into the body: no bytes copied.

    Attributes:
        keys: the keys, in table order.
        offsets: offset of each value inside ``payload``, in bytes.
        lengths: length of each value, in bytes.
        payload: the body from ``payload_offset`` on.
        truncated: the TRUNCATED flag (batch get responses only).
    """

    keys: tuple[ChunkKey, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    payload: memoryview
    truncated: bool = False
    prefix: tuple[ChunkKey, ...] = ()

    def value(self, i: int) -> memoryview:
        """The ``i``-th value, as a view into the body."""
        return self.payload[self.offsets[i] : self.offsets[i] + self.lengths[i]]


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive entries of equal length packed back to back: one store call."""

    start: int
    count: int
    value_bytes: int
    data: memoryview


def table_bytes(count: int) -> int:
    """Bytes of header plus table for ``count`` entries."""
    return HEADER_BYTES + ENTRY_BYTES * count


def write_header(buf: memoryview, count: int, payload_offset: int, flags: int = 0) -> None:
    """Write the 16-byte header at the start of ``buf``."""
    HEADER.pack_into(buf, 0, MAGIC, VERSION, flags, count, payload_offset)


def write_table(
    buf: memoryview,
    keys: list[ChunkKey] | tuple[ChunkKey, ...],
    lengths: list[int] | tuple[int, ...],
) -> None:
    """Write the table of packed values (offsets follow from the lengths) after the header."""
    n = len(keys)
    table = np.frombuffer(buf, dtype=TABLE_DTYPE, count=n, offset=HEADER_BYTES)
    lens = np.asarray(lengths, dtype="<u8")
    if n:
        table["key"] = np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}")
        table["length"] = lens
        table["offset"][0] = 0
        np.cumsum(lens[:-1], out=table["offset"][1:])


def pack_head(
    keys: list[ChunkKey] | tuple[ChunkKey, ...],
    lengths: list[int],
    prefix: list[ChunkKey] | tuple[ChunkKey, ...] = (),
) -> bytes:
    """Header and table (and ``prefix`` keys, if any) of a body whose values follow
    packed; send the values after it as they are (no copy into one body)."""
    for key in (*keys, *prefix):
        if len(key) != KEY_BYTES:
            raise InputError(f"a key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
    if any(n < 1 for n in lengths):
        raise InputError("empty values cannot be stored")
    start = table_bytes(len(keys))
    extra = PREFIX_HEAD.size + KEY_BYTES * len(prefix) if prefix else 0
    head = bytearray(start + extra)
    view = memoryview(head)
    write_header(view, len(keys), len(head), FLAG_PREFIX if prefix else 0)
    write_table(view, keys, lengths)
    if prefix:
        PREFIX_HEAD.pack_into(view, start, len(prefix), 0)
        view[start + PREFIX_HEAD.size :] = b"".join(prefix)
    return bytes(head)


def pack(
    keys: list[ChunkKey] | tuple[ChunkKey, ...], values: list[bytes | memoryview]
) -> bytearray:
    """One batch body holding ``values`` packed back to back (copies each value once)."""
    if len(keys) != len(values):
        raise InputError(f"{len(keys)} keys but {len(values)} values")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise InputError(f"a key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
    lengths = [memoryview(v).nbytes for v in values]
    if any(n < 1 for n in lengths):
        raise InputError("empty values cannot be stored")
    start = table_bytes(len(keys))
    body = bytearray(start + sum(lengths))
    view = memoryview(body)
    write_header(view, len(keys), start)
    write_table(view, keys, lengths)
    pos = start
    for v, n in zip(values, lengths, strict=True):
        view[pos : pos + n] = memoryview(v).cast("B")
        pos += n
    return body


def parse(
    body: bytes | bytearray | memoryview,
    *,
    max_count: int,
    max_value_bytes: int,
    max_prefix: int = 0,
) -> Batch:
    """Parse and fully validate a batch body (``max_prefix``: most prefix keys taken;
    0 refuses a body that names any).

    Raises:
        InputError: naming the first problem found (bad magic or version, a table that
            does not fit, a value out of bounds or overlapping the one before, too many
            entries or prefix keys, a value too large or empty).
    """
    view = memoryview(body).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise InputError(
            f"batch body of {view.nbytes} B is shorter than the {HEADER_BYTES}-byte header"
        )
    magic, version, flags, count, payload_offset = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise InputError(f"batch body starts with {bytes(magic)!r}, expected magic {MAGIC!r}")
    if version != VERSION:
        raise InputError(f"batch format version {version}; this daemon speaks version {VERSION}")
    if flags & ~(FLAG_TRUNCATED | FLAG_PREFIX):
        raise InputError(f"unknown batch flags {flags:#x}")
    if count > max_count:
        raise InputError(f"batch of {count} entries; the limit is {max_count}")
    need = table_bytes(count)
    prefix = _prefix(view, need, payload_offset, max_prefix) if flags & FLAG_PREFIX else ()
    need += PREFIX_HEAD.size + KEY_BYTES * len(prefix) if flags & FLAG_PREFIX else 0
    if payload_offset < need or payload_offset > view.nbytes:
        raise InputError(
            f"payload_offset {payload_offset} must lie in [{need}, {view.nbytes}] "
            f"(after the table of {count} entries, inside the body)"
        )
    table = np.frombuffer(view, dtype=TABLE_DTYPE, count=count, offset=HEADER_BYTES)
    offsets = table["offset"].astype(np.int64) if count else np.zeros(0, np.int64)
    lengths = table["length"].astype(np.int64) if count else np.zeros(0, np.int64)
    payload_bytes = view.nbytes - payload_offset
    if count:
        # uint64 values above 2**63 wrap negative in int64: caught by the range checks.
        if (table["length"] < 1).any() or (table["length"] > max_value_bytes).any():
            bad = int(np.argmax((table["length"] < 1) | (table["length"] > max_value_bytes)))
            raise InputError(
                f"entry {bad}: value of {int(table['length'][bad])} B; "
                f"values are 1..{max_value_bytes} B"
            )
        if (table["offset"] > payload_bytes).any():
            bad = int(np.argmax(table["offset"] > payload_bytes))
            raise InputError(
                f"entry {bad}: offset {int(table['offset'][bad])} lies past the payload"
            )
        ends = offsets + lengths
        if (ends > payload_bytes).any():
            bad = int(np.argmax(ends > payload_bytes))
            raise InputError(
                f"entry {bad}: value ends at {int(ends[bad])}, "
                f"past the payload of {payload_bytes} B"
            )
        if count > 1 and (offsets[1:] < ends[:-1]).any():
            bad = int(np.argmax(offsets[1:] < ends[:-1])) + 1
            raise InputError(
                f"entry {bad}: value overlaps the one before (values must be in order)"
            )
    keys = tuple(ChunkKey(bytes(k)) for k in table["key"]) if count else ()
    return Batch(
        keys=keys,
        offsets=tuple(int(x) for x in offsets),
        lengths=tuple(int(x) for x in lengths),
        payload=view[payload_offset:],
        truncated=bool(flags & FLAG_TRUNCATED),
        prefix=prefix,
    )


def _prefix(view: memoryview, at: int, payload_offset: int, limit: int) -> tuple[ChunkKey, ...]:
    """The prefix keys at ``at`` (right after the table), checked against ``limit``."""
    end = at + PREFIX_HEAD.size
    if end > min(payload_offset, view.nbytes):
        raise InputError("PREFIX is set but the prefix count does not fit before the payload")
    n, reserved = PREFIX_HEAD.unpack_from(view, at)
    if reserved:
        raise InputError(f"prefix reserved field is {reserved}, must be 0")
    if n > limit:
        raise InputError(f"{n} prefix keys; the limit is {limit} (limits.max_prefix_keys)")
    if end + KEY_BYTES * n > min(payload_offset, view.nbytes):
        raise InputError(f"{n} prefix keys do not fit before the payload")
    raw = bytes(view[end : end + KEY_BYTES * n])
    return tuple(ChunkKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES))


def runs(batch: Batch) -> list[Run]:
    """Split a batch into runs of equal-length values packed back to back, in order."""
    out: list[Run] = []
    i = 0
    n = len(batch.keys)
    while i < n:
        length = batch.lengths[i]
        j = i + 1
        while (
            j < n
            and batch.lengths[j] == length
            and batch.offsets[j] == batch.offsets[j - 1] + length
        ):
            j += 1
        lo = batch.offsets[i]
        out.append(Run(i, j - i, length, batch.payload[lo : lo + (j - i) * length]))
        i = j
    return out
