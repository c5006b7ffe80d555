"""Types of the optional C core (kvtier/_core.c)."""

from typing import Any

from kvtier.alloc.buddy import Extent
from kvtier.keys import ChunkKey

class Buddy:
    def __init__(self, capacity_units: int, max_order: int, extent: Any, error: Any) -> None: ...
    @property
    def capacity_units(self) -> int: ...
    @property
    def max_order(self) -> int: ...
    @property
    def free_units(self) -> int: ...
    @property
    def used_units(self) -> int: ...
    @property
    def allocated_count(self) -> int: ...
    def allocate(self, order: int) -> Extent | None: ...
    def allocate_run(self, n_units: int) -> list[Extent] | None: ...
    def free(self, offset: int, n_units: int) -> None: ...
    def claim(self, offset: int, n_units: int) -> None: ...
    def allocated_blocks(self) -> list[Extent]: ...
    def free_blocks(self) -> list[Extent]: ...
    def largest_free_order(self) -> int: ...

def copy_slots(
    arena: Any,
    slot_bytes: int,
    offset: int,
    n: int,
    value_bytes: int,
    buf: Any,
    into_arena: bool,
    /,
) -> None: ...

class Slot:
    key: ChunkKey
    tier: int
    offset: int
    value_bytes: int
    readers: int
    retired: bool
    def __init__(self, key: ChunkKey, tier: int, offset: int, value_bytes: int) -> None: ...

class Entry:
    slot: Slot
    pins: int
    moving: bool
    def __init__(self, slot: Slot) -> None: ...

class IndexVerbs:
    """Hot verbs of StoreIndex; their signatures are StoreIndex's."""
