"""A hybrid model's KV-cache groups as kvtier entries (connectors/vllm/groups.py), no engine:
what each group stores of a chunk, which entries a hit needs, and the keys and plans of a
model of one group staying what they were."""

from __future__ import annotations

import pytest

from kvtier.connectors.vllm.groups import NULL, GroupLayout
from kvtier.connectors.vllm.settings import ChunkShape
from kvtier.errors import SpecError
from kvtier.spec import KVGroup, KVSpec, LayerKind

SHAPE = ChunkShape.of(64, 32)  # two blocks per chunk


def hybrid(window_tokens: int) -> KVSpec:
    groups = (
        KVGroup(LayerKind.SLIDING, 2, window_tokens),
        KVGroup(LayerKind.FULL, 1),
    )
    return KVSpec(3, 2, 64, groups=groups)


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def test_one_group_keeps_its_keys_and_geometry() -> None:
    plain = KVSpec(3, 2, 64)
    layout = GroupLayout.of(plain, SHAPE)
    assert not layout.hybrid
    assert layout.keys_of(b"k" * 16) == [b"k" * 16]
    assert plain.entry_bytes(64) == plain.chunk_bytes(64)
    # The groups are part of the geometry: a hybrid layout never reads plain entries.
    assert hybrid(47).fingerprint != plain.fingerprint
    assert hybrid(47).fingerprint != hybrid(31).fingerprint


def test_sliding_group_stores_the_window_a_boundary_needs() -> None:
    wide = GroupLayout.of(hybrid(47), SHAPE)  # 47 tokens: both blocks of a chunk
    narrow = GroupLayout.of(hybrid(31), SHAPE)  # 31 tokens: the chunk's last block
    long = GroupLayout.of(hybrid(100), SHAPE)  # 100 tokens: two chunks before a boundary
    assert [(g.sliding, g.tail_blocks, g.window_chunks) for g in wide.groups] == [
        (True, 2, 1),
        (False, 2, 0),
    ]
    assert narrow.groups[0].tail_blocks == 1
    assert long.groups[0].window_chunks == 2
    ids = [[10, 11, 12, 13], [20, 21, 22, 23]]
    assert narrow.save_blocks(ids, narrow.groups[0], 1) == [13]
    assert narrow.save_blocks(ids, narrow.groups[1], 1) == [22, 23]
    assert narrow.save_blocks([[10, NULL, 12, 13], ids[1]], narrow.groups[0], 0) == []
    # The smallest entry (the full group's one layer) sizes the mirror's capacity.
    assert hybrid(47).entry_bytes(64) == KVSpec(1, 2, 64).chunk_bytes(64)


def test_a_hit_needs_every_full_entry_and_the_window_before_its_boundary() -> None:
    layout = GroupLayout.of(hybrid(47), SHAPE)
    k = keys(5)
    full = {layout.key(x, 1) for x in k[:4]}
    # Sliding entries of chunk 2 only: a hit may end at boundary 3, not 4.
    mirror = full | {layout.key(k[2], 0)}
    assert layout.matched(k, 5, mirror, set()) == 3
    assert layout.matched(k, 5, mirror | {layout.key(k[3], 0)}, set()) == 4
    assert layout.matched(k, 5, full, set()) == 0  # no window anywhere
    # The window of the longest hit is being saved: ask again rather than hit less.
    assert layout.matched(k, 5, mirror, {layout.key(k[3], 0)}) is None
    # The first full entry missing is being saved: ask again.
    assert layout.matched(k, 5, full - {layout.key(k[1], 1)}, {layout.key(k[1], 1)}) is None
    assert len({layout.key(x, 0) for x in k} | full) == 9  # group keys never collide


def test_load_plan_skips_null_blocks_and_vllms_own_hit() -> None:
    layout = GroupLayout.of(hybrid(47), SHAPE)
    k = keys(3)
    # Blocks of chunks 0..2 per group; the sliding group's first blocks are vLLM's null.
    ids = [[NULL, NULL, NULL, 7, 8, 9], [1, 2, 3, 4, 5, 6]]
    plan = layout.load_plan(k, ids, first=0, last=3, local_blocks=1)
    by_group = {g: (gk, gb) for g, gk, gb in plan}
    assert by_group[0] == ([k[2]], [8, 9])  # the window before boundary 3: chunk 2
    assert by_group[1] == (
        [layout.key(x, 1) for x in k],
        [NULL, 2, 3, 4, 5, 6],  # block 0 holds vLLM's own hit: read, not written
    )


def test_kv_group_checks_its_window() -> None:
    with pytest.raises(SpecError):
        KVGroup(LayerKind.SLIDING, 1, 0)
    with pytest.raises(SpecError):
        KVGroup(LayerKind.FULL, 1, 10)
    with pytest.raises(SpecError, match="layers"):
        KVSpec(4, 2, 64, groups=(KVGroup(LayerKind.FULL, 1),))
