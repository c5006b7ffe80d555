"""The buddy allocator never overlaps, loses or double-frees units.

Every test runs on both implementations: the Python reference and the native one
(``kvtier/_core.c``, skipped where it was not built). ``test_buddy_native.py`` checks
that they agree operation by operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.alloc import BuddyAllocator, NativeBuddyAllocator, decompose
from kvtier.errors import InputError

IMPLS = [
    pytest.param(BuddyAllocator, id="reference"),
    pytest.param(
        NativeBuddyAllocator,
        id="native",
        marks=pytest.mark.skipif(NativeBuddyAllocator is None, reason="C core not built"),
    ),
]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> type[BuddyAllocator]:
    return request.param  # type: ignore[no-any-return]


def test_decompose_is_binary_with_cap() -> None:
    assert decompose(188, 10) == [7, 5, 4, 3, 2]
    assert decompose(5, 1) == [1, 1, 0]
    assert decompose(0, 3) == []
    for n in range(1, 300):
        orders = decompose(n, 30)
        assert sum(1 << o for o in orders) == n
        assert len(orders) == bin(n).count("1")


def test_run_follows_binary_decomposition_and_is_aligned(impl: type[BuddyAllocator]) -> None:
    a = impl(4096, 12)
    exts = a.allocate_run(188)
    assert exts is not None
    assert [e.order for e in exts] == [7, 5, 4, 3, 2]
    for e in exts:
        assert e.offset % e.units == 0


def test_fragmented_arena_still_serves_runs_when_units_are_free(impl: type[BuddyAllocator]) -> None:
    a = impl(64, 6)
    singles = [a.allocate(0) for _ in range(64)]
    for e in singles[::2]:  # free every other unit: 32 free, no two adjacent
        assert e is not None
        a.free(e.offset, 1)
    assert a.allocate(1) is None
    run = a.allocate_run(32)
    assert run is not None and sum(e.units for e in run) == 32
    assert a.free_units == 0


def test_double_free_and_foreign_free_are_refused_without_change(
    impl: type[BuddyAllocator],
) -> None:
    a = impl(32, 5)
    e = a.allocate(2)
    assert e is not None
    a.free(e.offset, 4)
    before = a.stats()
    with pytest.raises(InputError):
        a.free(e.offset, 4)
    with pytest.raises(InputError):
        a.free(40, 1)
    assert a.stats() == before


def test_a_range_over_adjacent_blocks_is_freed_in_one_call(impl: type[BuddyAllocator]) -> None:
    # The store releases a deleted sequence's slots a run at a time; a run can span
    # several adjacent extents (here [0, 2) and [2, 4), which form no block of 4).
    a = impl(16, 4)
    first, second = a.allocate(1), a.allocate(1)
    assert first is not None and second is not None
    assert (first.offset, second.offset) == (0, 2)
    a.free(0, 4)
    assert a.free_units == 16
    assert a.free_blocks()[0].units == 16  # coalesced back into one block


def test_a_range_with_a_free_hole_is_refused_without_change(impl: type[BuddyAllocator]) -> None:
    a = impl(16, 4)
    a.allocate(1)
    a.allocate(1)
    a.free(2, 1)  # [2, 3) free again: [0, 4) is no longer allocated throughout
    before = (a.free_units, a.allocated_blocks(), a.free_blocks())
    with pytest.raises(InputError):
        a.free(0, 4)
    assert (a.free_units, a.allocated_blocks(), a.free_blocks()) == before


def test_claim_rebuilds_state(impl: type[BuddyAllocator]) -> None:
    a = impl(100, 4)
    a.claim(5, 7)
    assert a.used_units == 7
    with pytest.raises(InputError):
        a.claim(6, 1)
    a.free(5, 7)
    assert a.free_units == 100
    assert a.stats().external_fragmentation == 0.0


class AllocatorMachine(RuleBasedStateMachine):
    """Model: a set of owned unit ranges. The allocator must agree with it at every step."""

    make: type[BuddyAllocator] = BuddyAllocator

    @initialize(cap=st.integers(1, 300), max_order=st.integers(0, 9))
    def setup(self, cap: int, max_order: int) -> None:
        self.a = self.make(cap, max_order)
        self.cap = cap
        self.owned: dict[int, int] = {}  # unit -> run id
        self.runs: dict[int, list[tuple[int, int]]] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 80))
    def allocate_run(self, n: int) -> None:
        free_before = self.a.free_units
        exts = self.a.allocate_run(n)
        if exts is None:
            assert n > free_before  # never fails while enough units are free
            assert self.a.free_units == free_before
            return
        assert sum(e.units for e in exts) == n
        rid = self.next_id
        self.next_id += 1
        self.runs[rid] = []
        for e in exts:
            assert e.offset % e.units == 0 and e.end <= self.cap
            for u in range(e.offset, e.end):
                assert u not in self.owned, "overlap"
                self.owned[u] = rid
            self.runs[rid].append((e.offset, e.units))

    @precondition(lambda self: bool(self.runs))
    @rule(data=st.data())
    def free_part(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.runs)))
        pieces = self.runs[rid]
        i = data.draw(st.integers(0, len(pieces) - 1))
        off, units = pieces[i]
        # Free the whole extent, its tail from an aligned split point, or one unit.
        mode = data.draw(st.sampled_from(["whole", "tail", "one"]))
        if mode == "whole" or units == 1:
            lo, n = off, units
        elif mode == "tail":
            lo, n = off + units // 2, units - units // 2
        else:
            lo, n = off + data.draw(st.integers(0, units - 1)), 1
        self.a.free(lo, n)
        for u in range(lo, lo + n):
            del self.owned[u]
        rest = [(o, k) for o, k in pieces if not (o == off and k == units)]
        if lo > off:
            rest.append((off, lo - off))
        if lo + n < off + units:
            rest.append((lo + n, off + units - lo - n))
        if rest:
            self.runs[rid] = rest
        else:
            del self.runs[rid]

    @precondition(lambda self: bool(self.owned))
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        free_units = [u for u in range(self.cap) if u not in self.owned]
        if not free_units:
            return
        u = data.draw(st.sampled_from(free_units))
        with pytest.raises(InputError):
            self.a.free(u, 1)

    @invariant()
    def accounting_matches(self) -> None:
        if not hasattr(self, "a"):
            return
        assert self.a.used_units == len(self.owned)
        assert self.a.free_units == self.cap - len(self.owned)
        blocks = self.a.allocated_blocks()
        covered = sum(b.units for b in blocks)
        assert covered == len(self.owned)
        for b in blocks:
            for u in range(b.offset, b.end):
                assert u in self.owned
        free_blocks = self.a.free_blocks()
        seen: set[int] = set()
        for b in free_blocks + blocks:
            for u in range(b.offset, b.end):
                assert u not in seen, "a unit is in two blocks"
                seen.add(u)
        assert len(seen) == self.cap

    @invariant()
    def fully_free_arena_coalesces(self) -> None:
        if hasattr(self, "a") and not self.owned:
            assert self.a.stats().external_fragmentation == 0.0


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase

if NativeBuddyAllocator is not None:

    class NativeAllocatorMachine(AllocatorMachine):
        make = NativeBuddyAllocator

    NativeAllocatorMachine.TestCase.settings = AllocatorMachine.TestCase.settings
    TestNativeAllocatorMachine = NativeAllocatorMachine.TestCase
