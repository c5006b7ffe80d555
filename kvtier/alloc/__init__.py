"""Adaptive-extent allocation: a buddy allocator over abstract units (slots)."""

from kvtier.alloc.buddy import (
    AllocatorStats,
    BuddyAllocator,
    Extent,
    NativeBuddyAllocator,
    decompose,
    make_allocator,
)

__all__ = [
    "AllocatorStats",
    "BuddyAllocator",
    "Extent",
    "NativeBuddyAllocator",
    "decompose",
    "make_allocator",
]
