"""Eviction orders beyond the core's LRU: ARC and cost-aware (benefit per byte).

Both implement :class:`kvtier.store.policy.EvictionPolicy` and are registered in the
``kvtier.eviction`` entry-point group (``store.eviction = "arc"`` or ``"cost"``); the
store builds one instance per tier with no arguments. The store guarantees atomicity:
a make-room pass takes exactly the victims it needs or none, and only calls
:meth:`remove` for chunks that really left, so these classes only keep an order.

Called under the store's lock; every method is O(1) or O(log n) amortised.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

from typing_extensions import override

from kvtier.keys import ChunkKey
from kvtier.store.policy import EvictionPolicy, LRUEviction

__all__ = ["ARCEviction", "CostAwareEviction", "LRUEviction"]


class ARCEviction(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) as an eviction order.

    ``T1`` holds chunks hit once since they arrived, ``T2`` chunks hit again; ghosts
    ``B1``/``B2`` remember recent victims of each. A chunk that comes back from ``B1``
    grows the target size ``p`` of ``T1`` (recency was under-provisioned), one from
    ``B2`` shrinks it. Victims come from ``T1`` while it is above ``p``, else ``T2``.
    The cache size ``c`` is the tier's current chunk count (the store evicts only when
    the tier is full).
    """

    def __init__(self) -> None:
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._p = 0.0

    @property
    def _c(self) -> int:
        return max(len(self._t1) + len(self._t2), 1)

    @override
    def insert(self, key: ChunkKey, nbytes: int) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        c = self._c
        if key in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / max(len(self._b1), 1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / max(len(self._b2), 1), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    @override
    def touch(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    @override
    def remove(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        c = self._c
        while len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._b2) > c:
            self._b2.popitem(last=False)

    @override
    def candidates(self) -> Iterator[ChunkKey]:
        # REPLACE: take from T1 while it exceeds its target, else from T2; then the other.
        if self._t1 and len(self._t1) > self._p:
            first, second = self._t1, self._t2
        else:
            first, second = self._t2, self._t1
        # The store stops iterating before it mutates, so live views are safe here.
        yield from first
        yield from second


Score = Callable[[ChunkKey, int, int], float]
"""(key, nbytes, hits in this tier) -> benefit per byte of keeping the chunk."""


def _frequency_score(key: ChunkKey, nbytes: int, hits: int) -> float:
    return (1.0 + hits) / max(nbytes, 1)


class CostAwareEviction(EvictionPolicy):
    """Evict the chunk with the least benefit per byte first (GreedyDual-Size-Frequency).

    Each chunk's priority is ``L + score(key, nbytes, hits)``, where ``L`` (the
    inflation value) rises to the priority of each victim taken, so chunks that stop
    being hit age out even if they once scored high. The default score is
    ``(1 + hits) / nbytes``; :meth:`with_score` binds a placement model's benefit (for
    example reuse probability x time saved / bytes).

    Args:
        score: benefit per byte of a chunk; higher stays longer.
    """

    def __init__(self, score: Score | None = None) -> None:
        self._score = score or _frequency_score
        self._heap: list[tuple[float, int, ChunkKey]] = []
        self._live: dict[ChunkKey, tuple[float, int]] = {}
        self._meta: dict[ChunkKey, tuple[int, int]] = {}  # key -> (nbytes, hits)
        self._seq = itertools.count()
        self._inflation = 0.0

    @classmethod
    def with_score(cls, score: Score) -> Callable[[], CostAwareEviction]:
        """A zero-argument factory (what the store takes) bound to ``score``."""
        return lambda: cls(score)

    def _push(self, key: ChunkKey, nbytes: int, hits: int) -> None:
        prio = self._inflation + self._score(key, nbytes, hits)
        seq = next(self._seq)
        self._live[key] = (prio, seq)
        heap = self._heap
        heapq.heappush(heap, (prio, seq, key))
        if len(heap) > 4 * len(self._live) + 64:  # drop stale entries now and then
            live = self._live
            self._heap = [(p, s, k) for p, s, k in heap if live.get(k) == (p, s)]
            heapq.heapify(self._heap)

    @override
    def insert(self, key: ChunkKey, nbytes: int) -> None:
        meta = self._meta.get(key)
        hits = meta[1] if meta is not None else 0
        self._meta[key] = (nbytes, hits)
        self._push(key, nbytes, hits)

    @override
    def touch(self, key: ChunkKey) -> None:
        meta = self._meta.get(key)
        if meta is not None:
            self._meta[key] = (meta[0], meta[1] + 1)
            self._push(key, meta[0], meta[1] + 1)

    @override
    def remove(self, key: ChunkKey) -> None:
        entry = self._live.pop(key, None)
        self._meta.pop(key, None)
        if entry is not None:
            self._inflation = max(self._inflation, entry[0])

    @override
    def candidates(self) -> Iterator[ChunkKey]:
        popped: list[tuple[float, int, ChunkKey]] = []
        heap, live = self._heap, self._live
        try:
            while heap:
                item = heapq.heappop(heap)
                prio, seq, key = item
                if live.get(key) != (prio, seq):
                    continue  # stale: removed or re-scored since
                popped.append(item)
                yield key
        finally:
            # Whatever was offered stays queued until the store removes it for real.
            for item in popped:
                heapq.heappush(heap, item)
