"""The scheduler side's mirror of the workers' stores: filters, ranks, known misses.

These need no engine: they drive :class:`StoreMirror` with the updates workers send
(:class:`IndexUpdate`) and check it against the key scheme of several TP ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from kvtier.connectors.vllm.keys import KeyScheme, rank_keys, rank_salt
from kvtier.connectors.vllm.mirror import (
    COUNTERS_PER_KEY,
    HASHES,
    IndexUpdate,
    KeyFilter,
    StoreMirror,
)
from kvtier.spec import KVSpec


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_filter_has_no_false_negatives_and_bounded_false_positives() -> None:
    f = KeyFilter.for_capacity(50_000)
    present = _keys(50_000)
    f.add(present)
    assert all(k in f for k in present)  # the scalar test agrees with the numpy insert
    absent = _keys(50_000)
    fp = sum(k in f for k in absent) / len(absent)
    assert fp < 2 * f.false_positive_rate(50_000) + 0.002
    assert f.false_positive_rate(50_000) < 0.01  # 10 B per key, 7 positions
    f.remove(present[:25_000])
    assert all(k in f for k in present[25_000:])  # removing some never hides others
    assert sum(k in f for k in present[:25_000]) < 0.01 * 25_000


def test_filter_memory_is_ten_bytes_per_key_of_capacity() -> None:
    assert KeyFilter.for_capacity(10_000_000).nbytes == COUNTERS_PER_KEY * 10_000_000
    assert KeyFilter.for_capacity(10).nbytes == 1 << 16  # small stores: ~0 false positives


def test_filter_snapshot_round_trip_and_saturation() -> None:
    f = KeyFilter(1 << 16)
    k = os.urandom(16)
    f.add([k] * 300)  # counters saturate at 255 and then stick
    f.remove([k] * 300)
    assert k in f  # saturated counters never go down: a false positive, never a negative
    g = KeyFilter(1 << 16, HASHES, f.to_bytes())
    assert k in g and g.to_bytes() == f.to_bytes()


def _rank_salts(tp: int) -> list[bytes]:
    spec = KVSpec(2, 4, 64, tp_size=tp)
    return [rank_salt(replace(spec, tp_rank=r), 0, "layout") for r in range(tp)]


def _snapshot(stored: list[bytes]) -> IndexUpdate:
    f = KeyFilter.for_capacity(1000)
    f.add(stored)
    return IndexUpdate(f.to_bytes(), f.hashes, recovered=len(stored))


def test_a_key_is_loadable_only_when_every_rank_holds_it() -> None:
    spec = KVSpec(2, 4, 64, tp_size=2)
    logical = KeyScheme("m", spec, 64).logical_keys(list(range(64 * 4)))
    s0, s1 = _rank_salts(2)
    assert s0 != s1  # each rank keys its own heads
    assert rank_keys(s0, logical) != rank_keys(s1, logical)
    m = StoreMirror(world_size=2)
    # Rank 0 recovered all four chunks, rank 1 only the first two.
    m.apply({s0: _snapshot(rank_keys(s0, logical))})
    assert not m.ready() and logical[0] not in m  # until every rank reported
    m.apply({s1: _snapshot(rank_keys(s1, logical[:2]))})
    assert m.ready()
    assert [k in m for k in logical] == [True, True, False, False]
    # Rank 1 stores chunk 2; rank 0 evicts chunk 0 (it left every tier there).
    m.apply({s1: IndexUpdate(None, HASHES, added=tuple(rank_keys(s1, logical[2:3])))})
    m.apply({s0: IndexUpdate(None, HASHES, removed=tuple(rank_keys(s0, logical[:1])))})
    assert [k in m for k in logical] == [False, True, True, False]


def test_known_misses_beat_the_filter_until_stored_again() -> None:
    (s0,) = _rank_salts(1)
    k = os.urandom(16)
    m = StoreMirror(world_size=1)
    m.apply({s0: _snapshot(rank_keys(s0, [k]))})
    assert k in m
    m.forget(k)  # a load failed (a false positive, or evicted meanwhile)
    assert k not in m
    m.confirm(k)  # every rank stored it again
    assert k in m


def test_added_and_removed_in_one_update_nets_out() -> None:
    (s0,) = _rank_salts(1)
    m = StoreMirror(world_size=1)
    m.apply({s0: _snapshot([])})
    k = os.urandom(16)
    rk = tuple(rank_keys(s0, [k]))
    m.apply({s0: IndexUpdate(None, HASHES, added=rk, removed=rk)})
    assert k not in m and len(m) == 0
    m.apply({s0: IndexUpdate(None, HASHES, added=rk + rk, removed=rk)})  # stored twice
    assert k in m


def test_each_rank_opens_its_own_nvme_directory(tmp_path) -> None:
    """TP ranks build their stores from one configuration; an nvme directory is locked."""
    from kvtier.connectors.vllm.settings import config_from_extra
    from kvtier.connectors.vllm.worker import rank_dirs
    from kvtier.factory import build_store

    cfg = config_from_extra(
        {
            "store.chunk_tokens": 64,
            "tiers": [
                {"kind": "host", "capacity_bytes": "1MiB"},
                {"kind": "nvme", "capacity_bytes": "1MiB", "dir": str(tmp_path)},
            ],
        },
        env={},
    )
    spec = KVSpec(2, 4, 64, tp_size=2)
    assert rank_dirs(cfg, replace(spec, tp_size=1), 0) is cfg  # one rank: as configured
    stores = [
        build_store(rank_dirs(cfg, replace(spec, tp_rank=r), 0), spec=spec, chunk_bytes=65536)
        for r in range(2)
    ]  # both open at once: no lock conflict
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tp0-pp0", "tp1-pp0"]
    finally:
        for b in stores:
            b.store.close()


def test_room_counts_the_chunks_the_stores_can_take_before_a_put_evicts() -> None:
    """The save fence is skipped while every store has room for the saves in flight."""
    import numpy as np

    from kvtier.connectors.vllm.mirror import IndexFeed
    from kvtier.connectors.vllm.settings import config_from_extra
    from kvtier.factory import build_store

    chunk = 65536
    cfg = config_from_extra(
        {"store.chunk_tokens": 64, "tiers": [{"kind": "host", "capacity_bytes": "512KiB"}]},
        env={},
    )
    store = build_store(cfg, spec=KVSpec(2, 4, 64), chunk_bytes=chunk).store
    try:
        feed = IndexFeed(store)
        (s0,) = _rank_salts(1)
        m = StoreMirror(world_size=1)
        assert m.room() == 0  # nothing known before the snapshot
        up = feed.take()
        assert up is not None
        m.apply({s0: up})
        assert m.room() == 8  # 512 KiB of 64 KiB chunks
        keys = _keys(3)
        data = np.random.default_rng(0).integers(0, 255, 3 * chunk, dtype=np.uint8)
        store.put(keys, data).result()
        more = feed.take()
        assert more is not None
        m.apply({s0: more})
        assert m.room() == 5
        store.put(_keys(8), np.tile(data, 3)[: 8 * chunk]).result()  # fills it, evicts
        m.apply({s0: feed.take()})
        assert m.room() == 0
    finally:
        store.close()
