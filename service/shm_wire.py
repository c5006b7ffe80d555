"""Frames of the same-host channel: small binary messages over a Unix seqpacket socket.

The channel (:mod:`kvtier.service.shm` serves it, :mod:`kvtier.service.shm_client`
speaks it) carries keys and offsets; values lie in shared memory that the *client*
created (a sealed memfd) and handed to the daemon with ``SCM_RIGHTS``. A seqpacket
socket keeps message boundaries, so every frame is one ``recvmsg``: a frame longer than
the daemon's bound arrives truncated and is refused whole.

Request (client -> daemon), little-endian, :data:`REQUEST` then a payload::

    magic "KVS1" | op u8 | 0 u8 | region u16 | count u32 | extra u32 | offset u64 | length u64

    HELLO   payload: the bearer token (count = its length); must come first
    MAP     with one fd (SCM_RIGHTS): map ``length`` bytes of it as ``region``
    UNMAP   forget ``region``
    PUT     payload: ``count`` keys of 16 bytes, then ``extra`` prefix keys (the
            sequence's chunks before them, protected from eviction while the put
            makes room; only to a daemon whose HELLO says ``put_prefix``); values
            packed, equal length, in region[offset : offset + length]
    GET     payload: keys; the leading run of present values that fit whole is copied
            packed into region[offset : offset + length]
    LOOKUP  payload: keys
    DELETE  payload: keys

Reply (daemon -> client), :data:`REPLY` then a payload::

    magic "KVS1" | status u8 | 0 u8 | 0 u16 | count u32 | 0 u32 | nbytes u64

    OK HELLO   payload: JSON (limits, tier names, ``put_prefix``)
    OK PUT     payload: stored, present, rejected, failed (4 x u32)
    OK GET     count = values copied, nbytes = bytes; payload: count x u32 lengths
    OK LOOKUP  count = hits; payload: hits x u32 lengths, then hits x u8 tier indexes
    OK DELETE  count = keys that were present
    not OK     payload: a one-line UTF-8 reason
"""

from __future__ import annotations

import enum
import struct

MAGIC = b"KVS1"
REQUEST = struct.Struct("<4sBBHIIQQ")
REPLY = struct.Struct("<4sBBHIIQ")
PUT_COUNTS = struct.Struct("<IIII")
KEY_BYTES = 16
MAX_TOKEN_BYTES = 4096
MAX_REGIONS = 16
"""Regions one connection may have mapped at once (the client unmaps its least recently
used one to map another)."""


class Op(enum.IntEnum):
    HELLO = 1
    MAP = 2
    UNMAP = 3
    PUT = 4
    GET = 5
    LOOKUP = 6
    DELETE = 7


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed or over a limit: the client's InputError
    UNAUTHORIZED = 2  # HELLO with a refused token, or a request before HELLO
    BUSY = 3  # the daemon's in-flight bound or its connection bound: retry later
    CLOSED = 4  # the daemon is shutting down
    TOO_LARGE = 5  # over a size or count limit: the client's InputError (HTTP's 413)


HTTP_EQUIVALENT = {
    Status.BAD_REQUEST: 400,
    Status.TOO_LARGE: 413,
    Status.UNAUTHORIZED: 401,
    Status.BUSY: 503,
    Status.CLOSED: 503,
}
"""The HTTP status the same refusal gets over HTTP (clients word both alike)."""


def request(
    op: Op, *, region: int = 0, count: int = 0, extra: int = 0, offset: int = 0, length: int = 0
) -> bytes:
    return REQUEST.pack(MAGIC, op, 0, region, count, extra, offset, length)


def reply(status: Status, *, count: int = 0, nbytes: int = 0) -> bytes:
    return REPLY.pack(MAGIC, status, 0, 0, count, 0, nbytes)


def max_request_bytes(max_keys: int) -> int:
    """The longest valid request: a header and ``max_keys`` keys and as many prefix
    keys (or a token)."""
    return REQUEST.size + max(2 * max_keys * KEY_BYTES, MAX_TOKEN_BYTES)
