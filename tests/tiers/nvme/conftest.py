"""Fixtures for the NVMe tier tests: tiers over a temp directory, closed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.nvme import EngineKind, Options
from kvtier.tiers.nvme.tier import NVMeTier

SLOT = 16 * 1024
VALUE = 12_000  # not a 4 KiB multiple: exercises slot padding
CAP = 256 * SLOT


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def value(i: int, n: int = VALUE) -> np.ndarray:
    """Deterministic random bytes of chunk ``i`` (never zeros)."""
    return np.random.default_rng(i + 1).integers(0, 256, n, dtype=np.uint8)


def values(ids: range | list[int], n: int = VALUE) -> np.ndarray:
    return np.concatenate([value(i, n) for i in ids])


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., tuple[TieredStore, NVMeTier]]]:
    """Open a one-tier store over ``tmp_path`` (reopening the same directory recovers it)."""
    opened: list[TieredStore] = []

    def make(
        directory: Path | None = None,
        engine: Any = None,
        cap: int = CAP,
        slot: int = SLOT,
        **opts: Any,
    ) -> tuple[TieredStore, NVMeTier]:
        o = Options(dir=str(directory or tmp_path), engine=EngineKind.POSIX, **opts)
        tier = NVMeTier(TierGeometry("nv", cap, slot, 1 << 30), o, engine=engine)
        store = TieredStore([tier], io_threads=2, promote_on_hit=False)
        opened.append(store)
        return store, tier

    yield make
    for s in opened:
        s.close()


def get_all(store: TieredStore, ids: list[int], n: int = VALUE) -> dict[int, bool]:
    """For each present chunk: whether its bytes are right. Absent chunks are left out."""
    out: dict[int, bool] = {}
    for i in ids:
        k = key(i)
        if store.lookup([k]).hits != 1:
            continue
        buf = np.zeros(n, dtype=np.uint8)
        r = store.get([k], buf).result()
        if r.chunks == 1:
            out[i] = bool(np.array_equal(buf, value(i, n)))
    return out
