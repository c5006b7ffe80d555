"""A buddy allocator over an arena of equal units, with no idea of what backs them.

The unit is one chunk slot (a chunk's bytes rounded up to the I/O alignment), so host
memory, GPU memory and NVMe slab files all share this code. A run of n new chunks is
laid out as the binary decomposition of n: extents of 2**k units, largest first, each
capped at ``2**max_order`` units. A 48K-token sequence of 256-token chunks (188 chunks)
becomes 128 + 32 + 16 + 8 + 4 units: five extents instead of 188 pages.

Every chunk stays addressable inside its extent: freeing any aligned sub-range (one
slot, or a sequence's tail) splits the owning block and coalesces what becomes free.

Not thread-safe: the owning tier serialises calls under its lock.

Two implementations, one behaviour: :class:`BuddyAllocator` here is the reference, and
:class:`NativeBuddyAllocator` (``kvtier/_core.c``, built where a C compiler was found)
does the same operations in C and hands out the same extents in the same order
(``tests/unit/test_buddy_native.py`` runs random operation sequences on both).
:func:`make_allocator` picks the native one where it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier._native import native_enabled
from kvtier.errors import InputError

try:
    if not native_enabled():
        raise ImportError("KVTIER_NATIVE turns the C core off")
    from kvtier._core import Buddy as _Buddy
except ImportError:  # built without a C compiler, or turned off: the reference serves
    _Buddy = None  # type: ignore[assignment,misc]

NATIVE_MAX_UNITS = 1 << 26
"""Largest arena (in units) the native allocator takes: it keeps 10 bytes per unit of
address space (taken by the kernel only where touched), where the reference keeps
state only per block. Larger arenas use the reference."""


@dataclass(frozen=True, slots=True, order=True)
class Extent:
    """A contiguous, buddy-aligned run of ``2**order`` units starting at ``offset`` units."""

    offset: int
    order: int

    @property
    def units(self) -> int:
        return 1 << self.order

    @property
    def end(self) -> int:
        return self.offset + (1 << self.order)


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """Point-in-time figures of one allocator.

    Attributes:
        capacity_units: units in the arena.
        used_units: units inside allocated blocks.
        free_units: units inside free blocks.
        allocated_blocks: number of allocated buddy blocks.
        largest_free_units: size of the largest free block.
        external_fragmentation: 1 - largest free block / min(free units, largest extent);
            0 when nothing is free or the free space is as unbroken as it can be.
    """

    capacity_units: int
    used_units: int
    free_units: int
    allocated_blocks: int
    largest_free_units: int
    external_fragmentation: float


def decompose(n: int, max_order: int) -> list[int]:
    """Orders of the binary decomposition of ``n`` units, largest first, capped at max_order.

    >>> decompose(188, 10)
    [7, 5, 4, 3, 2]
    >>> decompose(5, 1)
    [1, 1, 0]
    """
    if n < 0:
        raise InputError(f"cannot decompose a negative unit count {n}")
    cap = 1 << max_order
    orders = [max_order] * (n // cap)
    rest = n % cap
    for order in range(max_order - 1, -1, -1):
        if rest & (1 << order):
            orders.append(order)
    return orders


def _check_arena(capacity_units: int, max_order: int) -> None:
    if capacity_units < 1:
        raise InputError(f"allocator needs at least one unit, got {capacity_units}")
    if max_order < 0:
        raise InputError(f"max_order must be >= 0, got {max_order}")


def _stats(
    capacity_units: int, free_units: int, blocks: int, largest: int, max_order: int
) -> AllocatorStats:
    # Measured against the largest block the free space could form, so an empty
    # arena made of many capped blocks reads 0, not 1 - cap/capacity.
    ideal = min(free_units, 1 << max_order)
    ext = 0.0 if ideal == 0 else 1.0 - largest / ideal
    return AllocatorStats(
        capacity_units=capacity_units,
        used_units=capacity_units - free_units,
        free_units=free_units,
        allocated_blocks=blocks,
        largest_free_units=largest,
        external_fragmentation=ext,
    )


class BuddyAllocator:
    """Allocates buddy-aligned extents of ``2**k`` units from ``[0, capacity_units)``.

    The reference implementation (see the module docstring).

    Args:
        capacity_units: arena size in units; need not be a power of two.
        max_order: largest extent is ``2**max_order`` units (the byte cap, in units).
    """

    def __init__(self, capacity_units: int, max_order: int) -> None:
        _check_arena(capacity_units, max_order)
        self.capacity_units = capacity_units
        # An order larger than the arena can never be used; clamp it.
        self.max_order = min(max_order, capacity_units.bit_length() - 1)
        self._free: list[dict[int, None]] = [{} for _ in range(self.max_order + 1)]
        self._free_order: dict[int, int] = {}
        self._alloc: dict[int, int] = {}
        self._free_units = 0
        offset = 0
        for order in decompose(capacity_units, self.max_order):
            self._push_free(offset, order)
            self._free_units += 1 << order
            offset += 1 << order

    # -- queries -----------------------------------------------------------------------

    @property
    def free_units(self) -> int:
        return self._free_units

    @property
    def used_units(self) -> int:
        return self.capacity_units - self._free_units

    def stats(self) -> AllocatorStats:
        largest = 0
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                largest = 1 << order
                break
        return _stats(
            self.capacity_units, self._free_units, len(self._alloc), largest, self.max_order
        )

    def allocated_blocks(self) -> list[Extent]:
        """Every allocated block, sorted by offset (for checks and journals)."""
        return sorted(Extent(o, k) for o, k in self._alloc.items())

    def free_blocks(self) -> list[Extent]:
        return sorted(Extent(o, k) for o, k in self._free_order.items())

    # -- allocation --------------------------------------------------------------------

    def allocate(self, order: int) -> Extent | None:
        """One extent of ``2**order`` units, or None when no free block is large enough."""
        if not 0 <= order <= self.max_order:
            raise InputError(f"order {order} not in [0, {self.max_order}]")
        src = order
        while src <= self.max_order and not self._free[src]:
            src += 1
        if src > self.max_order:
            return None
        offset = next(iter(self._free[src]))
        self._pop_free(offset, src)
        free, free_order = self._free, self._free_order  # the split loop runs per op: inlined
        while src > order:
            src -= 1
            half = offset + (1 << src)
            free[src][half] = None
            free_order[half] = src
        self._alloc[offset] = order
        self._free_units -= 1 << order
        return Extent(offset, order)

    def allocate_run(self, n_units: int) -> list[Extent] | None:
        """Extents holding ``n_units`` units in order, following the binary decomposition.

        When fragmentation leaves no block for an order, that piece falls back to two
        pieces of the next order down, so the call succeeds whenever ``n_units`` units
        are free. All-or-nothing: on failure nothing stays allocated.
        """
        if n_units < 1:
            raise InputError(f"allocate_run needs n_units >= 1, got {n_units}")
        if n_units > self._free_units:
            return None
        out: list[Extent] = []
        pending = decompose(n_units, self.max_order)
        pending.reverse()  # used as a stack, largest first
        while pending:
            order = pending.pop()
            ext = self.allocate(order)
            if ext is not None:
                out.append(ext)
            elif order > 0:
                pending.extend((order - 1, order - 1))
            else:  # unreachable while free_units >= n_units; kept as a guard
                for done in out:
                    self.free(done.offset, done.units)
                return None
        return out

    def free(self, offset: int, n_units: int) -> None:
        """Free ``[offset, offset + n_units)``, which must lie inside allocated blocks (one
        or several adjacent ones).

        Any sub-range of an allocated block may be freed; the block is split so the rest
        stays allocated. Raises InputError on a double free or a range never allocated,
        before changing anything.
        """
        if n_units < 1 or offset < 0 or offset + n_units > self.capacity_units:
            raise InputError(f"free range [{offset}, {offset + n_units}) outside the arena")
        pieces: list[tuple[int, int]] = []
        todo = _aligned_pieces(offset, n_units)
        todo.reverse()  # a stack, lowest offset on top
        while todo:
            o, k = todo.pop()
            if self._owner(o, k) is not None:
                pieces.append((o, k))
            elif k > 0:
                # The range spans several allocated blocks (adjacent extents freed
                # together): free its halves, each inside one block.
                todo += ((o + (1 << (k - 1)), k - 1), (o, k - 1))
            else:
                raise InputError(f"free of [{o}, {o + 1}): not allocated (double free?)")
        for o, k in pieces:
            owner = self._owner(o, k)  # earlier pieces may have split the owner
            assert owner is not None
            self._split_out(owner, o, k)
            del self._alloc[o]
            self._free_units += 1 << k
            self._coalesce(o, k)

    def claim(self, offset: int, n_units: int) -> None:
        """Mark the free range ``[offset, offset + n_units)`` allocated, as aligned blocks.

        Used by persistent tiers to rebuild allocation state from their journal. Raises
        InputError, changing nothing, when any part of the range is not free.
        """
        if n_units < 1 or offset < 0 or offset + n_units > self.capacity_units:
            raise InputError(f"claim range [{offset}, {offset + n_units}) outside the arena")
        pieces = _aligned_pieces(offset, n_units)
        if any(self._free_owner(o, k) is None for o, k in pieces):
            raise InputError(f"claim of [{offset}, {offset + n_units}): not free")
        for o, k in pieces:
            base = self._free_owner(o, k)
            assert base is not None
            order = self._free_order[base]
            self._pop_free(base, order)
            while order > k:
                order -= 1
                half = 1 << order
                if o >= base + half:
                    self._push_free(base, order)
                    base += half
                else:
                    self._push_free(base + half, order)
            self._alloc[o] = k
            self._free_units -= 1 << k

    # -- internals ---------------------------------------------------------------------

    def _owner(self, offset: int, order: int) -> int | None:
        """Offset of the allocated block that contains the aligned block (offset, order)."""
        return self._container(self._alloc, offset, order)

    def _free_owner(self, offset: int, order: int) -> int | None:
        """Offset of the free block that contains the aligned block (offset, order)."""
        return self._container(self._free_order, offset, order)

    def _container(self, blocks: dict[int, int], offset: int, order: int) -> int | None:
        """Offset of the block of ``blocks`` (offset -> order) that contains (offset, order)."""
        for k in range(order, self.max_order + 1):
            base = offset & ~((1 << k) - 1)
            if blocks.get(base) == k:
                return base
        return None

    def _split_out(self, base: int, offset: int, order: int) -> None:
        """Split allocated block ``base`` until (offset, order) is its own allocated block."""
        k = self._alloc[base]
        while k > order:
            del self._alloc[base]
            k -= 1
            half = 1 << k
            if offset >= base + half:
                self._alloc[base] = k
                base += half
            else:
                self._alloc[base + half] = k
            self._alloc[base] = k

    def _coalesce(self, offset: int, order: int) -> None:
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            merged = min(offset, buddy)
            if self._free_order.get(buddy) != order or merged + (2 << order) > self.capacity_units:
                break
            self._pop_free(buddy, order)
            offset, order = merged, order + 1
        self._push_free(offset, order)

    def _push_free(self, offset: int, order: int) -> None:
        self._free[order][offset] = None
        self._free_order[offset] = order

    def _pop_free(self, offset: int, order: int) -> None:
        del self._free[order][offset]
        del self._free_order[offset]


if _Buddy is not None or TYPE_CHECKING:

    class NativeBuddyAllocator(_Buddy):
        """:class:`BuddyAllocator` in C (``kvtier/_core.c``): the same extents for the
        same calls, and the same :class:`~kvtier.errors.InputError` for refused ones.

        Its ``allocate``, ``allocate_run``, ``free``, ``claim``, ``allocated_blocks`` and
        ``free_blocks`` are the C type's. Not thread-safe, as the reference.
        """

        def __init__(self, capacity_units: int, max_order: int) -> None:
            _check_arena(capacity_units, max_order)
            super().__init__(capacity_units, max_order, Extent, InputError)

        def stats(self) -> AllocatorStats:
            order = self.largest_free_order()
            largest = 0 if order < 0 else 1 << order
            return _stats(
                self.capacity_units,
                self.free_units,
                self.allocated_count,
                largest,
                self.max_order,
            )

else:
    NativeBuddyAllocator = None  # type: ignore[assignment,misc]


def make_allocator(
    capacity_units: int, max_order: int, *, native: bool = True
) -> BuddyAllocator | NativeBuddyAllocator:
    """The native allocator where it is built and the arena is not too large for it
    (:data:`NATIVE_MAX_UNITS`), else the reference; ``native=False`` always gives the
    reference."""
    if native and NativeBuddyAllocator is not None and capacity_units <= NATIVE_MAX_UNITS:
        return NativeBuddyAllocator(capacity_units, max_order)
    return BuddyAllocator(capacity_units, max_order)


def _aligned_pieces(offset: int, n: int) -> list[tuple[int, int]]:
    """Split ``[offset, offset+n)`` into maximal buddy-aligned power-of-two blocks."""
    out: list[tuple[int, int]] = []
    end = offset + n
    while offset < end:
        align = (offset & -offset).bit_length() - 1 if offset else 62
        size_order = (end - offset).bit_length() - 1
        k = min(align, size_order)
        out.append((offset, k))
        offset += 1 << k
    return out
