"""Online reuse evidence: how likely a chunk is to be asked for again.

Evidence comes from what the store reports to its placement policy:

* **hit counts and prefix sharing**: every lookup that reaches a chunk (a hit, or a
  miss of a chunk another request also carried) is one more reference;
* **a learned table**: for each class of chunk (references so far, capped), the
  probability that a chunk of that class is referenced again within ``horizon_s``.
  This is the reuse probability the cost model uses; it adapts to the workload;
* **victim outcomes**: chunks chosen as eviction victims are old, so their reuse odds
  are lower than their class's average; the tracker learns, per class, how often a
  victim is referenced again within the horizon (whether it was demoted or dropped),
  and placement decides demotions with that figure once it has enough samples;
* **ghost list**: chunks the policy dropped. A ghost that comes back is a regret; the
  count is reported, and the chunk keeps its reference count so it is judged on all its
  evidence when it returns.

The table is estimated without the lag bias of naive counting (which counts every new
chunk at once but its reuse only later, so early estimates come out far too low): a
chunk's outcome is counted once it is *resolved*, either referenced again within the
horizon (a success) or ``horizon_s`` old without a reference (a failure).

Not thread-safe on its own (readers too: a reader may recompute the table): the store
calls placement hooks, and reads its report, under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.keys import ChunkKey

MAX_CLASS = 3
"""References beyond this share one class: the evidence saturates."""

MAX_EXPECTED_REUSES = 64.0
"""Cap on a chunk's expected further references: a class whose learned probability
nears 1 would otherwise promise unbounded reuse."""


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """Counters of a :class:`ReuseTracker`."""

    tracked: int
    ghosts: int
    ghost_hits: int
    class_probability: tuple[float, ...]
    victim_probability: tuple[float | None, ...]


class ReuseTracker:
    """Per-chunk reference counts and a learned reuse probability per count class.

    Args:
        horizon_s: reuse within this many seconds counts as reuse.
        clock: seconds (trace time in a simulation).
        max_tracked: keys remembered (least recently referenced forgotten first).
        max_ghosts: dropped keys remembered.
        prior: pseudo-counts (reused, not reused) of the Beta prior of every class.
    """

    def __init__(
        self,
        horizon_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        max_tracked: int = 1 << 20,
        max_ghosts: int = 1 << 18,
        prior: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        self.horizon_s = horizon_s
        self._clock = clock
        # key -> (references so far, time of the last one)
        self._refs: OrderedDict[ChunkKey, tuple[int, float]] = OrderedDict()
        self._ghosts: OrderedDict[ChunkKey, None] = OrderedDict()
        self._pending: deque[tuple[float, ChunkKey, int]] = deque()
        self._max_tracked = max_tracked
        self._max_ghosts = max_ghosts
        self._prior = prior
        self._resolved = [0] * (MAX_CLASS + 1)
        self._reused = [0] * (MAX_CLASS + 1)
        self._table: list[float] = []
        self._expected: list[float] = []
        # New evidence marks the tables stale; the next reader recomputes them. A hit
        # brings evidence on every lookup, and most lookups read no probability.
        self._stale = True
        self._refresh()
        # Victim episodes: key -> (time it was a victim, class); resolved like classes.
        self._victims: dict[ChunkKey, tuple[float, int]] = {}
        self._victim_queue: deque[tuple[float, ChunkKey]] = deque()
        self._v_resolved = [0] * (MAX_CLASS + 1)
        self._v_reused = [0] * (MAX_CLASS + 1)
        self.min_victim_samples = 100
        self.ghost_hits = 0

    def _refresh(self) -> None:
        """Recompute the class table and the expected further references per class."""
        self._table = [self._p(c) for c in range(MAX_CLASS + 1)]
        # A chunk of class c is referenced again with p_c, then is of class c + 1 (the
        # last class keeps its p): E_c = p_c (1 + E_c+1), and E_max = p / (1 - p).
        p_max = self._table[MAX_CLASS]
        tail = (
            MAX_EXPECTED_REUSES if p_max >= 1.0 else min(p_max / (1 - p_max), MAX_EXPECTED_REUSES)
        )
        expected = [0.0] * (MAX_CLASS + 1)
        expected[MAX_CLASS] = tail
        for c in range(MAX_CLASS - 1, -1, -1):
            expected[c] = min(self._table[c] * (1 + expected[c + 1]), MAX_EXPECTED_REUSES)
        self._expected = expected
        self._stale = False

    def _tables(self) -> tuple[list[float], list[float]]:
        """The class table and the expected further references, current."""
        if self._stale:
            self._refresh()
        return self._table, self._expected

    def _p(self, c: int) -> float:
        a, b = self._prior
        return (self._reused[c] + a) / (self._resolved[c] + a + b)

    def _expire(self, now: float) -> None:
        """Chunks unreferenced for a whole horizon resolve as failures."""
        pending, refs, horizon = self._pending, self._refs, self.horizon_s
        while pending and now - pending[0][0] > horizon:
            t, key, n = pending.popleft()
            state = refs.get(key)
            if state is not None and state[1] == t and state[0] == n:
                self._resolved[min(n, MAX_CLASS)] += 1
                self._stale = True
        vq, victims = self._victim_queue, self._victims
        while vq and now - vq[0][0] > horizon:
            t, key = vq.popleft()
            episode = victims.get(key)
            if episode is not None and episode[0] == t:
                del victims[key]
                self._v_resolved[episode[1]] += 1

    def reference(self, keys: Iterable[ChunkKey]) -> None:
        """One more reference to each key (a lookup reached it, hit or miss)."""
        now = self._clock()
        self._expire(now)
        refs, ghosts = self._refs, self._ghosts
        for key in keys:
            n, last = refs.pop(key, (0, 0.0))
            if n and now - last <= self.horizon_s:
                c = min(n, MAX_CLASS)
                self._resolved[c] += 1
                self._reused[c] += 1
                self._stale = True
            if key in ghosts:
                del ghosts[key]
                self.ghost_hits += 1
            episode = self._victims.pop(key, None)
            if episode is not None:
                self._v_resolved[episode[1]] += 1
                self._v_reused[episode[1]] += 1
            n += 1
            refs[key] = (n, now)
            self._pending.append((now, key, n))
        while len(refs) > self._max_tracked:
            refs.popitem(last=False)

    def victims(self, keys: Iterable[ChunkKey]) -> None:
        """These keys were chosen as eviction victims (their outcome is learned)."""
        now = self._clock()
        for key in keys:
            if key not in self._victims:
                self._victims[key] = (now, min(max(self.refs(key), 1), MAX_CLASS))
                self._victim_queue.append((now, key))

    def victim_probability(self, refs: int) -> float | None:
        """Learned reuse probability of a victim of this class; None until enough samples."""
        c = min(max(refs, 1), MAX_CLASS)
        if self._v_resolved[c] < self.min_victim_samples:
            return None
        a, b = self._prior
        return (self._v_reused[c] + a) / (self._v_resolved[c] + a + b)

    def mean_victim_probability(self, keys: Iterable[ChunkKey]) -> tuple[float, int]:
        """Like :meth:`mean_probability`, with victim odds where learned."""
        table = [self.victim_probability(c) for c in range(MAX_CLASS + 1)]
        classes = self._tables()[0]
        refs = self._refs
        total = 0.0
        n = 0
        for key in keys:
            state = refs.get(key)
            c = 1 if state is None else min(max(state[0], 1), MAX_CLASS)
            p = table[c]
            total += classes[c] if p is None else p
            n += 1
        return total, n

    def dropped(self, keys: Iterable[ChunkKey]) -> None:
        """The policy dropped these keys from the store (they enter the ghost list)."""
        ghosts = self._ghosts
        for key in keys:
            ghosts[key] = None
            ghosts.move_to_end(key)
        while len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def refs(self, key: ChunkKey) -> int:
        """References seen so far (0 for a key never seen)."""
        return self._refs.get(key, (0, 0.0))[0]

    def class_probability(self, refs: int) -> float:
        """Learned probability that a chunk with ``refs`` references gets another one."""
        return self._tables()[0][min(max(refs, 1), MAX_CLASS)]

    def probability(self, key: ChunkKey) -> float:
        """Reuse probability of one key, from its class."""
        table = self._tables()[0]
        state = self._refs.get(key)
        if state is None:
            return table[1]
        n = state[0]
        return table[n if n < MAX_CLASS else MAX_CLASS]

    def expected_reuses(self, keys: Iterable[ChunkKey]) -> tuple[float, int]:
        """Sum of the expected further references of ``keys`` (by class, chained: each
        reference moves a chunk up a class), and how many keys there were."""
        return self._sum_by_class(keys, self._tables()[1])

    def mean_probability(self, keys: Iterable[ChunkKey]) -> tuple[float, int]:
        """Sum of reuse probabilities of ``keys``, and how many there were."""
        return self._sum_by_class(keys, self._tables()[0])

    def _sum_by_class(self, keys: Iterable[ChunkKey], table: list[float]) -> tuple[float, int]:
        refs = self._refs
        total = 0.0
        n = 0
        for key in keys:
            state = refs.get(key)
            total += table[1 if state is None else min(max(state[0], 1), MAX_CLASS)]
            n += 1
        return total, n

    def stats(self) -> ReuseStats:
        return ReuseStats(
            tracked=len(self._refs),
            ghosts=len(self._ghosts),
            ghost_hits=self.ghost_hits,
            class_probability=tuple(self.class_probability(c) for c in range(1, MAX_CLASS + 1)),
            victim_probability=tuple(self.victim_probability(c) for c in range(1, MAX_CLASS + 1)),
        )
