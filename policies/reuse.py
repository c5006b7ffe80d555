"""Online reuse evidence: how likely a chunk is to be asked for again.

Evidence comes from what the store reports to its placement policy:

* **hit counts and prefix sharing**: every lookup that reaches a chunk (a hit, or a
  miss of a chunk another request also carried) is one more reference;
* **a learned table**: for each class of chunk (references so far, capped), the fraction
  of chunks in that class that were referenced again. This is the reuse probability
  the cost model uses; it adapts to the workload instead of being a constant;
* **ghost list**: chunks the policy dropped. A ghost that comes back is a regret; the
  regret rate is reported, and the ghost's history (its reference count) is kept so a
  returning chunk is judged on all its evidence.

Not thread-safe on its own: the store calls placement hooks under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.keys import ChunkKey

MAX_CLASS = 3
"""References beyond this share one class: the evidence saturates."""


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """Counters of a :class:`ReuseTracker`."""

    tracked: int
    ghosts: int
    ghost_hits: int
    class_probability: tuple[float, ...]


class ReuseTracker:
    """Per-chunk reference counts and a learned reuse probability per count class.

    Args:
        max_tracked: keys remembered (oldest forgotten first); bounds memory.
        max_ghosts: dropped keys remembered.
        prior: pseudo-counts (reused, not reused) of the Beta prior of every class.
    """

    def __init__(
        self,
        max_tracked: int = 1 << 20,
        max_ghosts: int = 1 << 18,
        prior: tuple[float, float] = (1.0, 3.0),
    ) -> None:
        self._refs: OrderedDict[ChunkKey, int] = OrderedDict()
        self._ghosts: OrderedDict[ChunkKey, None] = OrderedDict()
        self._max_tracked = max_tracked
        self._max_ghosts = max_ghosts
        self._prior = prior
        # entered[c]: chunks that reached c references; again[c]: of those, reached c + 1.
        self._entered = [0] * (MAX_CLASS + 1)
        self._again = [0] * (MAX_CLASS + 1)
        self.ghost_hits = 0

    def reference(self, keys: Iterable[ChunkKey]) -> None:
        """One more reference to each key (a lookup reached it, hit or miss)."""
        refs, entered, again = self._refs, self._entered, self._again
        for key in keys:
            n = refs.pop(key, 0)
            if n:
                again[min(n, MAX_CLASS)] += 1
            elif key in self._ghosts:
                self.ghost_hits += 1
            n += 1
            entered[min(n, MAX_CLASS)] += 1
            refs[key] = n
        while len(refs) > self._max_tracked:
            refs.popitem(last=False)

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
        return self._refs.get(key, 0)

    def class_probability(self, refs: int) -> float:
        """Learned probability that a chunk with ``refs`` references gets another one."""
        c = min(max(refs, 1), MAX_CLASS)
        a, b = self._prior
        return (self._again[c] + a) / (self._entered[c] + a + b)

    def probability(self, key: ChunkKey) -> float:
        """Reuse probability of one key, from its class."""
        return self.class_probability(self._refs.get(key, 1))

    def mean_probability(self, keys: Iterable[ChunkKey]) -> tuple[float, int]:
        """Sum of reuse probabilities of ``keys``, and how many there were."""
        refs = self._refs
        table = [self.class_probability(c) for c in range(MAX_CLASS + 1)]
        total = 0.0
        n = 0
        for key in keys:
            total += table[min(max(refs.get(key, 1), 1), MAX_CLASS)]
            n += 1
        return total, n

    def stats(self) -> ReuseStats:
        return ReuseStats(
            tracked=len(self._refs),
            ghosts=len(self._ghosts),
            ghost_hits=self.ghost_hits,
            class_probability=tuple(self.class_probability(c) for c in range(1, MAX_CLASS + 1)),
        )
