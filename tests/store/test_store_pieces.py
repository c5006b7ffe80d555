"""A put whose values lie in one buffer per key (LMCache's memory objects).

One such put places a sequence head first, like a packed put: the head wins the room
that the tail would otherwise take, whatever order the I/O threads run in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import Switch
from kvtier.errors import InputError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier, TierGeometry
from kvtier.tiers.host import HostTier
from kvtier.tiers.host import Options as HostOptions
from kvtier.tiers.nvme import EngineKind
from kvtier.tiers.nvme import Options as NVMeOptions
from kvtier.tiers.nvme.tier import NVMeTier

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def value(i: int, n: int = SLOT) -> np.ndarray:
    return np.random.default_rng(i + 11).integers(0, 256, n, dtype=np.uint8)


def host(_: Path, name: str, slots: int) -> Tier:
    geometry = TierGeometry(name, slots * SLOT, SLOT, 1 << 20)
    return HostTier(geometry, HostOptions(pin=Switch.OFF, prefault=False))


def nvme(d: Path, name: str, slots: int) -> Tier:
    (d / name).mkdir()
    return NVMeTier(
        TierGeometry(name, slots * SLOT, SLOT, 1 << 20),
        NVMeOptions(dir=str(d / name), engine=EngineKind.POSIX),
    )


MakeTier = Callable[[Path, str, int], Tier]
LOWER = {"host": host, "nvme": nvme}


@pytest.mark.parametrize("lower", list(LOWER))
def test_pieces_round_trip_through_two_tiers(tmp_path: Path, lower: str) -> None:
    make: MakeTier = LOWER[lower]
    ks = [key(i) for i in range(12)]
    # Separate arrays, and views at odd offsets: nothing is contiguous or aligned.
    backing = [value(i, SLOT + 3) for i in range(12)]
    pieces = [b[3:] for b in backing]
    tiers = [host(tmp_path, "top", 4), make(tmp_path, "low", 16)]
    with TieredStore(tiers, io_threads=2) as store:
        r = store.put(ks, pieces).result()
        assert (r.stored, r.rejected, r.failed) == (12, 0, 0)
        out = np.zeros(12 * SLOT, np.uint8)
        got = store.get(ks, out).result()
        assert got.chunks == 12
        assert np.array_equal(out, np.concatenate(pieces))
        assert store.stats().chunks == 12


def test_pieces_longer_than_the_store_keep_the_head(tmp_path: Path) -> None:
    ks = [key(i) for i in range(4)]
    with TieredStore([host(tmp_path, "only", 2)], io_threads=4) as store:
        r = store.put(ks, [value(i) for i in range(4)], prefix=ks).result()
        assert (r.stored, r.rejected) == (2, 2)
        assert store.lookup(ks).hits == 2  # the head, which a lookup can reach
        out = np.zeros(2 * SLOT, np.uint8)
        assert store.get(ks[:2], out).result().chunks == 2
        assert np.array_equal(out, np.concatenate([value(0), value(1)]))


def test_pieces_of_a_batch_present_in_part_keep_the_present_ones(tmp_path: Path) -> None:
    ks = [key(i) for i in range(4)]
    with TieredStore([host(tmp_path, "only", 3)], io_threads=2) as store:
        store.put(ks[:2], [value(0), value(1)]).result()
        # The batch's present head is its own prefix: room is made around it, not from it.
        r = store.put(ks, [value(i) for i in range(4)], prefix=ks).result()
        assert (r.stored, r.present, r.rejected) == (1, 2, 1)
        assert store.lookup(ks).hits == 3


@pytest.mark.parametrize(
    ("pieces", "match"),
    [
        ([value(0)], "1 buffers for 2 keys"),
        ([value(0), value(1, SLOT // 2)], "of one length"),
        ([value(0, SLOT * 2), value(1, SLOT * 2)], "the store takes"),
    ],
    ids=["count", "lengths", "too long"],
)
def test_bad_pieces_are_refused(tmp_path: Path, pieces: list[np.ndarray], match: str) -> None:
    with TieredStore([host(tmp_path, "only", 4)], io_threads=1) as store:
        with pytest.raises(InputError, match=match):
            store.put([key(0), key(1)], pieces)
        assert store.stats().chunks == 0
