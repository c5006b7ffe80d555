"""Flipped bytes in the slab, journal or checkpoint: a miss and a metric, never wrong data."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.tiers.nvme.conftest import VALUE, get_all, key, value, values

RECORD = 64  # journal and checkpoint record size (docs/architecture.md, "NVMe tier")


def _flip(path: Path, offset: int, n: int = 8) -> None:
    raw = bytearray(path.read_bytes())
    for j in range(n):
        raw[offset + j] ^= 0xA5
    path.write_bytes(bytes(raw))


def _slab(d: Path) -> Path:
    return d / "nv.slab0"


def _put(store, ids: list[int]) -> None:
    r = store.put([key(i) for i in ids], values(ids)).result()
    assert r.stored == len(ids)


def test_flipped_slab_bytes_are_dropped_at_recovery(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    _put(store, list(range(20)))
    store.close()
    raw = _slab(tmp_path).read_bytes()
    pos = raw.find(value(7).tobytes()[:256])
    assert pos >= 0
    _flip(_slab(tmp_path), pos + 5000)

    store, tier = make_store()
    seen = get_all(store, list(range(20)))
    assert 7 not in seen
    assert set(seen) == set(range(20)) - {7}
    assert all(seen.values())
    assert tier.nvme_stats().recover_dropped == 1


def test_flipped_slab_bytes_are_a_miss_on_read_and_freed(make_store, tmp_path: Path) -> None:
    store, tier = make_store()
    _put(store, list(range(10)))
    raw = _slab(tmp_path).read_bytes()
    pos = raw.find(value(3).tobytes()[:256])
    _flip(_slab(tmp_path), pos + 100)  # under the running store

    out = np.zeros(VALUE, dtype=np.uint8)
    r = store.get([key(3)], out).result()
    assert r.chunks == 0
    assert store.stats().corrupt_chunks == 1
    assert tier.nvme_stats().corrupt_chunks == 1
    assert store.lookup([key(3)]).hits == 0  # freed, never served again
    seen = get_all(store, list(range(10)))
    assert set(seen) == set(range(10)) - {3} and all(seen.values())


def test_flipped_slab_bytes_without_start_up_verification_are_a_miss(
    make_store, tmp_path: Path
) -> None:
    store, _ = make_store()
    _put(store, list(range(10)))
    store.close()
    raw = _slab(tmp_path).read_bytes()
    _flip(_slab(tmp_path), raw.find(value(4).tobytes()[:256]) + 64)

    store, _ = make_store(verify_on_recover=False)
    assert store.lookup([key(4)]).hits == 1  # trusted at start-up...
    seen = get_all(store, list(range(10)))
    assert seen.get(4) is None  # ...but never served
    assert store.stats().corrupt_chunks == 1
    assert set(seen) == set(range(10)) - {4} and all(seen.values())


def test_flipped_journal_record_loses_that_chunk_only(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    for i in range(12):
        _put(store, [i])  # one record per chunk, in order
    store.close()
    # Records of this session sit in the newest journal; record k is the k-th put.
    (journal,) = sorted((tmp_path / "nv.index").glob("journal.*"))
    _flip(journal, RECORD * (1 + 5) + 20)

    store, tier = make_store()
    seen = get_all(store, list(range(12)))
    assert set(seen) == set(range(12)) - {5}
    assert all(seen.values())
    assert tier.nvme_stats().journal_bad_records == 1


def test_flipped_checkpoint_record_loses_that_chunk_only(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    _put(store, list(range(12)))
    store.close()
    store, _ = make_store()  # start-up writes everything into a fresh checkpoint
    store.close()
    (ckpt,) = sorted((tmp_path / "nv.index").glob("checkpoint.*"))
    _flip(ckpt, RECORD * (1 + 2) + 30)

    store, tier = make_store()
    seen = get_all(store, list(range(12)))
    assert len(seen) == 11 and all(seen.values())
    assert tier.nvme_stats().journal_bad_records == 1


def test_damaged_header_loses_the_index_but_not_the_process(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    _put(store, list(range(5)))
    store.close()
    for f in (tmp_path / "nv.index").glob("*.*"):  # checkpoint.N and journal.N
        _flip(f, 3)

    store, _ = make_store()
    assert get_all(store, list(range(5))) == {}
    _put(store, [100])  # and the tier works on
    assert get_all(store, [100]) == {100: True}
