"""The native allocator (kvtier/_core.c) agrees with the Python reference, operation by
operation: the same extents in the same order, the same refusals, the same state."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.alloc import BuddyAllocator, NativeBuddyAllocator, make_allocator
from kvtier.errors import InputError

pytestmark = pytest.mark.skipif(NativeBuddyAllocator is None, reason="C core not built")


def both(ref: BuddyAllocator, nat: Any, method: str, *args: int) -> Any:
    """Call ``method`` on both; they must return equal values or raise the same error."""
    outcome = []
    for a in (ref, nat):
        try:
            outcome.append(("ok", getattr(a, method)(*args)))
        except InputError as exc:
            outcome.append(("error", str(exc)))
    assert outcome[0] == outcome[1], (method, args)
    return outcome[0][1]


class Lockstep(RuleBasedStateMachine):
    """Random operations, valid or not, on both allocators at once."""

    @initialize(cap=st.integers(1, 600), max_order=st.integers(0, 11))
    def setup(self, cap: int, max_order: int) -> None:
        self.ref = BuddyAllocator(cap, max_order)
        self.nat = NativeBuddyAllocator(cap, max_order)
        self.cap = cap
        self.extents: list[tuple[int, int]] = []

    @rule(n=st.integers(1, 200))
    def allocate_run(self, n: int) -> None:
        got = both(self.ref, self.nat, "allocate_run", n)
        if isinstance(got, list):
            self.extents += [(e.offset, e.units) for e in got]

    @rule(order=st.integers(-1, 12))
    def allocate(self, order: int) -> None:
        got = both(self.ref, self.nat, "allocate", order)
        if got is not None and not isinstance(got, str):
            self.extents.append((got.offset, got.units))

    @rule(data=st.data())
    def free_part_of_an_extent(self, data: st.DataObject) -> None:
        if not self.extents:
            return
        off, units = data.draw(st.sampled_from(self.extents))
        lo = data.draw(st.integers(off, off + units - 1))
        n = data.draw(st.integers(1, off + units - lo))
        both(self.ref, self.nat, "free", lo, n)

    @rule(data=st.data())
    def free_any_range(self, data: st.DataObject) -> None:
        # Often refused (free units, outside the arena): both must refuse alike.
        lo = data.draw(st.integers(-2, self.cap + 2))
        n = data.draw(st.integers(-1, 70))
        both(self.ref, self.nat, "free", lo, n)

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        lo = data.draw(st.integers(-1, self.cap))
        n = data.draw(st.integers(0, 40))
        if both(self.ref, self.nat, "claim", lo, n) is None:
            self.extents.append((lo, n))

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "ref"):
            return
        assert self.ref.stats() == self.nat.stats()
        assert self.ref.free_blocks() == self.nat.free_blocks()
        assert self.ref.allocated_blocks() == self.nat.allocated_blocks()
        assert (self.ref.free_units, self.ref.used_units, self.ref.max_order) == (
            self.nat.free_units,
            self.nat.used_units,
            self.nat.max_order,
        )


Lockstep.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestLockstep = Lockstep.TestCase


def test_bad_arena_arguments_are_refused_alike() -> None:
    for cap, max_order in ((0, 3), (-1, 0), (4, -1)):
        with pytest.raises(InputError):
            BuddyAllocator(cap, max_order)
        with pytest.raises(InputError):
            NativeBuddyAllocator(cap, max_order)


def test_make_allocator_picks_native_and_honours_the_switch() -> None:
    assert isinstance(make_allocator(64, 3), NativeBuddyAllocator)
    assert type(make_allocator(64, 3, native=False)) is BuddyAllocator
