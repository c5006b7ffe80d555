"""Durability modes, group commit, compaction and spanning several slab files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import PluginError
from kvtier.tiers.nvme import Codec, Durability
from tests.tiers.nvme.conftest import SLOT, VALUE, get_all, key, values


def test_batch_and_none_survive_a_clean_close(make_store, tmp_path: Path) -> None:
    for mode in (Durability.BATCH, Durability.NONE):
        d = tmp_path / mode.value
        d.mkdir()
        store, _ = make_store(d, durability=mode)
        assert store.put([key(i) for i in range(8)], values(range(8))).result().stored == 8
        store.close()
        store, _ = make_store(d, durability=mode)
        seen = get_all(store, list(range(8)))
        assert seen == dict.fromkeys(range(8), True)


def test_flush_makes_batch_writes_durable(make_store) -> None:
    store, tier = make_store(durability=Durability.BATCH, batch_interval_ms=60_000.0)
    store.put([key(1)], values([1])).result()
    commits = tier.nvme_stats().commits
    store.flush()
    assert tier.nvme_stats().commits > commits


def test_concurrent_puts_share_commits(make_store) -> None:
    store, tier = make_store()
    futs = [store.put([key(i)], values([i])) for i in range(40)]
    assert all(f.result().stored == 1 for f in futs)
    assert tier.nvme_stats().commits <= 40


def test_compaction_keeps_exactly_the_live_chunks(make_store, tmp_path: Path) -> None:
    store, tier = make_store(checkpoint_min_records=16)
    for i in range(60):
        store.put([key(i)], values([i])).result()
        if i % 3 == 0:
            store.delete([key(i)])
    store.flush()
    assert tier.nvme_stats().checkpoints >= 2  # the one at start-up, then compactions
    store.close()
    store, _ = make_store()
    seen = get_all(store, list(range(60)))
    assert seen == {i: True for i in range(60) if i % 3}
    assert len(list((tmp_path / "nv.index").glob("journal.*"))) == 1


def test_runs_across_several_slab_files(make_store, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    store, _ = make_store(paths=(str(a), str(b)), cap=16 * SLOT)
    ids = list(range(16))  # fills both slabs; extents straddle the boundary
    assert store.put([key(i) for i in ids], values(ids)).result().stored == 16
    out = np.zeros(16 * VALUE, dtype=np.uint8)
    assert store.get([key(i) for i in ids], out).result().chunks == 16
    assert np.array_equal(out, values(ids))
    store.close()
    store, _ = make_store(paths=(str(a), str(b)), cap=16 * SLOT)
    assert get_all(store, ids) == dict.fromkeys(ids, True)


def test_endurance_counter_counts_media_bytes(make_store) -> None:
    store, tier = make_store()
    before = tier.nvme_stats().media_bytes_written
    store.put([key(i) for i in range(4)], values(range(4))).result()
    after = tier.nvme_stats().media_bytes_written
    assert after - before >= 4 * SLOT  # whole slots plus the journal records


def _kv_like(n_bytes: int, seed: int) -> np.ndarray:
    """bf16 values with a KV-like spread (normal, scale ~1): the high bytes repeat."""
    f32 = np.random.default_rng(seed).normal(0, 1.0, n_bytes // 2).astype(np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return bf16.view(np.uint8)


def test_codec_round_trips_and_writes_fewer_bytes(make_store, tmp_path: Path) -> None:
    pytest.importorskip("lz4", reason="lz4-shuffle needs lz4: pip install 'kvtier[nvme]'")
    big = 1 << 20  # compression pays only once a chunk spans many 4 KiB pages
    store, tier = make_store(codec=Codec.LZ4_SHUFFLE, slot=big, cap=16 * big)
    n = 4
    data = np.concatenate([_kv_like(big, i) for i in range(n)])
    before = tier.nvme_stats().media_bytes_written
    assert store.put([key(i) for i in range(n)], data).result().stored == n
    written = tier.nvme_stats().media_bytes_written - before
    assert written < 0.9 * n * big
    out = np.zeros_like(data)
    assert store.get([key(i) for i in range(n)], out).result().chunks == n
    assert np.array_equal(out, data)
    # Incompressible chunks stay raw and round-trip too; and both survive a restart.
    assert store.put([key(100)], values([100], big)).result().stored == 1
    store.close()
    store, _ = make_store(codec=Codec.LZ4_SHUFFLE, slot=big, cap=16 * big)
    out[:] = 0
    assert store.get([key(i) for i in range(n)], out).result().chunks == n
    assert np.array_equal(out, data)
    assert get_all(store, [100], big) == {100: True}


def test_batch_commits_on_its_own_without_a_flush(make_store) -> None:
    import time

    store, tier = make_store(durability=Durability.BATCH, batch_interval_ms=10.0)
    before = tier.nvme_stats().commits
    store.put([key(1)], values([1])).result()
    for _ in range(1000):  # wait for the event, not for a duration
        if tier.nvme_stats().commits > before:
            break
        time.sleep(0.01)
    assert tier.nvme_stats().commits > before


def test_encoded_chunks_read_back_after_the_codec_is_turned_off(make_store) -> None:
    pytest.importorskip("lz4", reason="lz4-shuffle needs lz4: pip install 'kvtier[nvme]'")
    big = 1 << 20
    store, _ = make_store(codec=Codec.LZ4_SHUFFLE, slot=big, cap=16 * big)
    data = np.concatenate([_kv_like(big, i) for i in range(4)])
    assert store.put([key(i) for i in range(4)], data).result().stored == 4
    store.close()
    store, _ = make_store(slot=big, cap=16 * big)  # codec = "none" now
    out = np.zeros_like(data)
    assert store.get([key(i) for i in range(4)], out).result().chunks == 4
    assert np.array_equal(out, data)


def test_a_codec_without_lz4_fails_at_start_and_its_stored_chunks_read_as_misses(
    make_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a tier with the codec started without lz4 and raised ModuleNotFoundError
    # from the I/O thread at the first put; an encoded chunk read without lz4 did too.
    pytest.importorskip("lz4", reason="lz4-shuffle needs lz4: pip install 'kvtier[nvme]'")
    import sys

    big = 1 << 20
    store, tier = make_store(codec=Codec.LZ4_SHUFFLE, slot=big, cap=16 * big)
    data = np.concatenate([_kv_like(big, i) for i in range(2)])
    assert store.put([key(0), key(1)], data).result().stored == 2
    monkeypatch.setitem(sys.modules, "lz4", None)  # an install without the nvme extra
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    out = np.zeros_like(data)
    assert store.get([key(0), key(1)], out).result().chunks == 0  # a miss, not a crash
    assert tier.faults().io_errors >= 1
    with pytest.raises(PluginError, match="lz4"):
        make_store(codec=Codec.LZ4_SHUFFLE, slot=big, cap=16 * big)


def test_deletions_are_durable_before_delete_returns_under_sync(make_store) -> None:
    # A user's delete is acknowledged as durable under sync (issue 11): each delete call
    # commits its DELs (group commit) before it returns, even with a minute-long interval.
    # Evictions do not: their DELs ride along with the next commit.
    store, tier = make_store(batch_interval_ms=60_000.0)
    ids = list(range(30))
    assert store.put([key(i) for i in ids], values(ids)).result().stored == 30
    before = tier.nvme_stats().commits
    store.delete([key(i) for i in ids[:10]])
    assert tier.nvme_stats().commits == before + 1
    for i in ids[10:20]:
        store.delete([key(i)])
    assert tier.nvme_stats().commits == before + 11
    store.delete([key(i) for i in ids[:10]])  # nothing left to delete: no commit
    assert tier.nvme_stats().commits == before + 11
    assert store.put([key(100)], values([100])).result().stored == 1
    store.delete([key(i) for i in ids[20:]])
    store.close()
    store, _ = make_store()
    assert get_all(store, [*ids, 100]) == {100: True}
