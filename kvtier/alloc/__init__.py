"""Adaptive-extent allocation: a buddy allocator over abstract units (slots)."""

from kvtier.alloc.buddy import AllocatorStats, BuddyAllocator, Extent, decompose

__all__ = ["AllocatorStats", "BuddyAllocator", "Extent", "decompose"]
