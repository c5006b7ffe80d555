"""Chunk checksums computed piece by piece, while each piece is still in the CPU cache.

The nvme tier keeps an xxh3-64 of every chunk. Computed over a whole 32 MiB chunk after
its read (or before its write), the hash reads the chunk from DRAM a second time. The
posix engine therefore moves buffered transfers in pieces of :data:`PIECE_BYTES` and
hands each piece to :class:`PieceSums` right after it lands (a read) or right before it
goes (a write): the hash then reads from cache, and while one engine thread hashes
another is inside its ``preadv`` (python-xxhash hashes without the GIL, so two threads
hash at twice one thread's rate). Hashed this way, a read from the page cache costs
little more than the read alone (docs/benchmarks.md, "Through the page cache").

A request holds ``m`` chunks of ``value_bytes`` each, ``stride`` bytes apart (the slot
size). Pieces must come in order and cover every chunk; a chunk that was not covered so
(an engine that does not stream, a piece out of order) has no streamed sum, and the tier
hashes it whole as before.
"""

from __future__ import annotations

from typing import Any

import xxhash

PIECE_BYTES = 2 << 20
"""Piece size: about one core's L2 cache, so a piece is still there when it is hashed."""


class PieceSums:
    """Running xxh3-64 sums of ``m`` chunks laid ``stride`` apart in one transfer."""

    __slots__ = ("_done", "_hashes", "_stride", "_value_bytes")

    def __init__(self, m: int, value_bytes: int, stride: int) -> None:
        self._value_bytes = value_bytes
        self._stride = stride
        self._hashes = [xxhash.xxh3_64() for _ in range(m)]
        self._done = [0] * m  # bytes of each chunk hashed so far, in order

    def feed(self, pos: int, piece: Any) -> None:
        """Hash ``piece``, the bytes at ``pos`` of the transfer's buffer."""
        view = memoryview(piece).cast("B")
        end = pos + view.nbytes
        first = pos // self._stride
        last = min((end - 1) // self._stride, len(self._hashes) - 1) if view.nbytes else -1
        for k in range(first, last + 1):
            lo = max(pos, k * self._stride)
            hi = min(end, k * self._stride + self._value_bytes)
            if hi <= lo:
                continue
            if lo != k * self._stride + self._done[k]:
                self._done[k] = -1 << 62  # out of order: this chunk is hashed whole instead
                continue
            self._hashes[k].update(view[lo - pos : hi - pos])
            self._done[k] += hi - lo

    def sum(self, k: int, whole: Any) -> int:
        """Chunk ``k``'s sum: the streamed one, or, when its bytes did not all come
        through :meth:`feed` (an engine that does not stream), that of ``whole``, the
        chunk's bytes."""
        if self._done[k] != self._value_bytes:
            return xxhash.xxh3_64_intdigest(memoryview(whole))
        return self._hashes[k].intdigest()
