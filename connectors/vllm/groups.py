"""A hybrid model's KV-cache groups as kvtier entries. Imports nothing from vLLM.

With vLLM's hybrid KV-cache manager on, a model of sliding-window and full-attention
layers (Gemma 3, gpt-oss) has several KV-cache groups, each with its own block table.
kvtier stores each group's KV of a chunk as an entry of its own, under a key derived
from the chunk's logical key and the group (:meth:`GroupLayout.key`):

* a **full-attention** group stores every block of every chunk, and a prefix hit of
  ``n`` chunks needs all of them;
* a **sliding-window** group stores, of each chunk, only the blocks a hit at a chunk
  boundary can read (the last ``window_tokens`` tokens before it, at most the whole
  chunk), and a hit at boundary ``n`` needs only the chunks of the window before it.
  vLLM hands null blocks for what lies below the window; nothing is loaded there.

A model of one full-attention group (plain attention, or vLLM's hybrid manager off) is
the single group 0, whose key is the logical key itself: its keys and plans are those
the connector always had.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.keys import TAG_BYTES, tag_key
from kvtier.spec import KVSpec, LayerKind

from .settings import ChunkShape

NULL = -1
"""A block position with nothing to load or save: vLLM's null block, or vLLM's own hit."""


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """What one KV-cache group stores of a chunk, and what a hit needs of it.

    Attributes:
        index: vLLM's KV-cache group id.
        sliding: a sliding-window group (else full attention).
        tail_blocks: blocks of a chunk it stores: the chunk's last ``tail_blocks``.
        window_chunks: sliding only: chunks before a hit boundary that a hit reads.
    """

    index: int
    sliding: bool
    tail_blocks: int
    window_chunks: int = 0


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """The groups of one model and what each stores; build with :meth:`of`."""

    groups: tuple[GroupPlan, ...]
    blocks_per_chunk: int
    # Group keys keep the logical key's tenant tag (keys.py, with tenants).
    tenants: bool = False

    @classmethod
    def of(cls, spec: KVSpec, shape: ChunkShape, *, tenants: bool = False) -> GroupLayout:
        bpc = shape.blocks_per_chunk
        if not spec.groups:
            return cls((GroupPlan(0, False, bpc),), bpc, tenants)
        plans = []
        for i, g in enumerate(spec.groups):
            if g.kind is LayerKind.SLIDING:
                w = g.window_tokens
                tail = min(bpc, -(-w // shape.block_size))
                plans.append(GroupPlan(i, True, tail, -(-w // shape.chunk_tokens)))
            else:
                plans.append(GroupPlan(i, False, bpc))
        return cls(tuple(plans), bpc, tenants)

    @property
    def hybrid(self) -> bool:
        """More than one group, or a sliding one: keys and plans per group."""
        return len(self.groups) > 1 or self.groups[0].sliding

    @property
    def token_group(self) -> int:
        """The group whose entries count a hit's tokens: the first full-attention one."""
        return next((g.index for g in self.groups if not g.sliding), 0)

    def key(self, logical: bytes, group: int) -> bytes:
        """The key of group ``group``'s entry of a chunk (group 0: the logical key)."""
        if group == 0:
            return logical
        key = xxhash.xxh3_128_digest(logical + b"\0kvtier/group\0" + str(group).encode())
        return tag_key(key, logical[:TAG_BYTES]) if self.tenants else key

    def keys_of(self, logical: bytes) -> list[bytes]:
        return [self.key(logical, g.index) for g in self.groups]

    def matched(
        self,
        keys: Sequence[bytes],
        limit: int,
        mirror: Container[bytes],
        pending: Container[bytes],
    ) -> int | None:
        """Chunks a hit can cover: at most ``limit``; None to ask again later.

        The longest prefix whose full-attention entries are all stored, shortened until
        every sliding group holds its window before the boundary. None when the first
        entry missing is being saved right now (as :func:`~.scheduler.matched_chunks`).
        """
        full = [g.index for g in self.groups if not g.sliding]
        n = 0
        for key in keys[:limit]:
            for g in full:
                k = self.key(key, g)
                if k not in mirror:
                    return None if k in pending else self._window_fit(keys, n, mirror, pending)
            n += 1
        return self._window_fit(keys, n, mirror, pending)

    def _window_fit(
        self,
        keys: Sequence[bytes],
        n: int,
        mirror: Container[bytes],
        pending: Container[bytes],
    ) -> int | None:
        sliding = [g for g in self.groups if g.sliding]
        top = n
        while n > 0:
            missing = [
                k
                for g in sliding
                for j in range(max(0, n - g.window_chunks), n)
                if (k := self.key(keys[j], g.index)) not in mirror
            ]
            if not missing:
                return n
            if n == top and any(k in pending for k in missing):
                return None  # the window of the longest hit is being saved: wait for it
            n -= 1
        return 0

    def load_plan(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        first: int,
        last: int,
        local_blocks: int,
    ) -> list[tuple[int, list[bytes], list[int]]]:
        """Per group: (group, entry keys, block ids to fill) of a hit of chunks [first, last).

        ``block_ids`` are the request's blocks per group, :data:`NULL` where vLLM gave
        its null block; positions below ``local_blocks`` hold vLLM's own hit and become
        NULL too (read, not written). Entries whose blocks are all NULL are not loaded.
        """
        bpc = self.blocks_per_chunk
        out: list[tuple[int, list[bytes], list[int]]] = []
        for g in self.groups:
            ids = block_ids[g.index]
            lo = max(first, last - g.window_chunks) if g.sliding else first
            gkeys: list[bytes] = []
            gblocks: list[int] = []
            for i in range(lo, last):
                pos = range((i + 1) * bpc - g.tail_blocks, (i + 1) * bpc)
                tail = [ids[p] if p >= local_blocks and p < len(ids) else NULL for p in pos]
                if all(b == NULL for b in tail):
                    continue
                gkeys.append(self.key(keys[i], g.index))
                gblocks.extend(tail)
            if gkeys:
                out.append((g.index, gkeys, gblocks))
        return out

    def save_blocks(
        self, block_ids: Sequence[Sequence[int]], group: GroupPlan, i: int
    ) -> list[int]:
        """The blocks group ``group`` stores of chunk ``i``; empty when one is NULL.

        A sliding group's block below the window may already be freed (NULL): no hit at
        a later boundary reads it, and the entry is not stored.
        """
        ids = block_ids[group.index]
        end = (i + 1) * self.blocks_per_chunk
        if end > len(ids):
            return []
        tail = list(ids[end - group.tail_blocks : end])
        return [] if any(b == NULL for b in tail) else tail


def null_to_sentinel(ids: Sequence[int], null_id: int) -> list[int]:
    """``ids`` with vLLM's null block id replaced by :data:`NULL`."""
    return [NULL if b == null_id else b for b in ids]


def as_groups(block_ids: Any, n: int) -> list[list[int]]:
    """vLLM's per-group block ids (a tuple of lists) as ``n`` lists (missing: empty)."""
    groups = [list(g) for g in block_ids] if block_ids else []
    return groups + [[] for _ in range(n - len(groups))]
