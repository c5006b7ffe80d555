"""The index's records: a slot (one stored copy of a chunk) and an entry (a chunk's
record), and how slots group into runs.

Both are mutable and guarded by the index lock. Where the C core is built, the native
index (:mod:`kvtier.store.native`) builds ``kvtier._core.Slot`` and ``Entry`` instead:
the same attributes, without a Python ``__init__`` per record.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import ChunkKey
from kvtier.tiers.base import SlotRun


class Slot:
    """One stored copy of a chunk: where its bytes are, and who is reading them.

    Mutable; guarded by the index lock. ``readers`` counts the holds of gets and movers
    in flight; ``retired`` marks a slot the index no longer points at.
    """

    __slots__ = ("key", "offset", "readers", "retired", "tier", "value_bytes")

    def __init__(self, key: ChunkKey, tier: int, offset: int, value_bytes: int) -> None:
        self.key = key
        self.tier = tier
        self.offset = offset
        self.value_bytes = value_bytes
        self.readers = 0
        self.retired = False


class Entry:
    """Index record of one chunk: its slot, its pins, and whether a mover claimed it."""

    __slots__ = ("moving", "pins", "slot")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.pins = 0
        self.moving = False


def runs_of(slots: Sequence[Slot]) -> list[tuple[int, int, SlotRun]]:
    """Group slots into runs of consecutive offsets of one tier and equal length.

    Returns (index of the first slot, tier, run) triples, in order.
    """
    out: list[tuple[int, int, SlotRun]] = []
    i = 0
    while i < len(slots):
        first = slots[i]
        j = i + 1
        while (
            j < len(slots)
            and slots[j].tier == first.tier
            and slots[j].offset == first.offset + (j - i)
            and slots[j].value_bytes == first.value_bytes
        ):
            j += 1
        keys = tuple(sl.key for sl in slots[i:j])
        out.append((i, first.tier, SlotRun(first.offset, keys, first.value_bytes)))
        i = j
    return out
