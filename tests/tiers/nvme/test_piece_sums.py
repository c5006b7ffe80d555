"""Checksums hashed piece by piece (buffered files): the same sums, the same misses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier.enums import Switch
from kvtier.tiers.nvme import engine as nvme_engine
from kvtier.tiers.nvme import sums as nvme_sums
from kvtier.tiers.nvme.sums import PieceSums
from tests.tiers.nvme.conftest import SLOT, VALUE, get_all, key, value, values


@pytest.mark.parametrize("piece", [1, 999, 4096, SLOT, 3 * SLOT + 7, 1 << 20])
def test_pieces_in_order_give_each_chunks_whole_hash(piece: int) -> None:
    m, vb, sb = 5, VALUE, SLOT  # values shorter than their slots: padding is skipped
    buf = np.random.default_rng(piece).integers(0, 256, m * sb, dtype=np.uint8)
    sums = PieceSums(m, vb, sb)
    for pos in range(0, buf.nbytes, piece):
        sums.feed(pos, buf[pos : pos + piece])
    # No fallback bytes given: only the streamed sums can match.
    assert [sums.sum(k, b"") for k in range(m)] == [
        xxhash.xxh3_64_intdigest(buf[k * sb : k * sb + vb]) for k in range(m)
    ]


def test_missing_or_reordered_pieces_give_no_streamed_sum() -> None:
    buf = np.random.default_rng(0).integers(0, 256, 2 * SLOT, dtype=np.uint8)
    sums = PieceSums(2, SLOT, SLOT)
    sums.feed(SLOT + 100, buf[SLOT + 100 : 2 * SLOT])  # chunk 1 starts mid-way
    sums.feed(0, buf[:1000])  # chunk 0 only partly
    # Neither chunk was streamed whole: each sum is the hash of the bytes given instead.
    assert sums.sum(0, b"zero") == xxhash.xxh3_64_intdigest(b"zero")
    assert sums.sum(1, b"one") == xxhash.xxh3_64_intdigest(b"one")


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pieces of 5000 B (chunks of 12,000 B split at odd places); counts the pieces fed."""
    monkeypatch.setattr(nvme_engine, "PIECE_BYTES", 5000)
    fed: list[int] = []
    feed = nvme_sums.PieceSums.feed

    def counting(self: PieceSums, pos: int, piece: object) -> None:
        fed.append(pos)
        feed(self, pos, piece)

    monkeypatch.setattr(nvme_sums.PieceSums, "feed", counting)
    return fed


def test_buffered_chunks_are_hashed_in_pieces_and_survive_a_restart(
    make_store, small_pieces: list[int]
) -> None:
    store, tier = make_store(o_direct=Switch.OFF)
    assert tier.engine.streams(0)
    ids = list(range(20))
    assert store.put([key(i) for i in ids], values(ids)).result().stored == 20
    assert small_pieces, "the writes were not hashed piece by piece"
    written = len(small_pieces)
    assert get_all(store, ids) == dict.fromkeys(ids, True)
    assert len(small_pieces) > written, "the reads were not hashed piece by piece"
    store.close()

    store, tier = make_store(o_direct=Switch.OFF)  # recovery checks every chunk's sum
    assert tier.nvme_stats().recover_dropped == 0
    assert get_all(store, ids) == dict.fromkeys(ids, True)


def test_a_flipped_byte_past_the_first_piece_is_a_miss(
    make_store, tmp_path: Path, small_pieces: list[int]
) -> None:
    store, _ = make_store(o_direct=Switch.OFF)
    ids = list(range(10))
    assert store.put([key(i) for i in ids], values(ids)).result().stored == 10
    slab = tmp_path / "nv.slab0"
    raw = bytearray(slab.read_bytes())
    pos = raw.find(value(3).tobytes()[:256])
    raw[pos + 11_000] ^= 0x01  # in the chunk's third piece, near its end
    slab.write_bytes(bytes(raw))

    out = np.zeros(VALUE, dtype=np.uint8)
    assert store.get([key(3)], out).result().chunks == 0
    assert store.stats().corrupt_chunks == 1
    assert get_all(store, ids) == {i: True for i in ids if i != 3}
