"""Slab files grow with use, reserving space ahead of the writes (no 8 GiB file at start)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from kvtier.tiers.nvme import tier as nvme_tier
from tests.tiers.nvme.conftest import CAP, SLOT, get_all, key, values
from tests.tiers.nvme.test_faults import small_fs  # noqa: F401  (fixture)


def _put(store, ids):
    return store.put([key(i) for i in ids], values(ids)).result()


def _slab(d: Path) -> Path:
    return d / "nv.slab0"


def _disk_bytes(p: Path) -> int:
    return p.stat().st_blocks * 512


def test_slab_grows_in_steps_and_keeps_its_size_across_restarts(
    make_store, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(nvme_tier, "GROW_STEP_BYTES", 8 * SLOT)
    store, _ = make_store()
    slab = _slab(tmp_path)
    assert slab.stat().st_size == 0 and _disk_bytes(slab) == 0  # nothing taken at start
    assert _put(store, range(3)).stored == 3
    first = slab.stat().st_size
    assert 3 * SLOT <= first <= 8 * SLOT  # one step reserved, not the capacity
    assert _disk_bytes(slab) >= 3 * SLOT  # reserved for real, not a sparse promise
    assert _put(store, range(3, 20)).stored == 17
    grown = slab.stat().st_size
    # Extents are buddy-aligned, so the highest slot used can sit past the 20th.
    assert 20 * SLOT <= grown <= CAP // 4
    store.close()
    store, _ = make_store()
    seen = get_all(store, list(range(20)))
    assert set(seen) == set(range(20)) and all(seen.values())
    assert slab.stat().st_size == grown  # a restart neither shrinks nor re-grows it


def test_preallocate_reserves_the_whole_capacity_at_start(make_store, tmp_path: Path) -> None:
    make_store(preallocate=True)
    slab = _slab(tmp_path)
    assert slab.stat().st_size == CAP
    assert _disk_bytes(slab) >= CAP


def test_a_full_disk_fails_new_writes_and_keeps_stored_chunks(
    make_store,
    small_fs: Path,  # noqa: F811
    caplog,
) -> None:
    # A 4 MiB tier on a 1 MiB filesystem starts (with a warning) and stores what fits.
    with caplog.at_level(logging.WARNING):
        store, tier = make_store(small_fs, cap=4 << 20)
    assert "may grow" in caplog.text
    stored: list[int] = []
    failed_at = None
    for i in range(256):
        r = _put(store, [i])
        if r.failed:
            failed_at = i
            break
        stored.append(i)
    assert failed_at is not None and len(stored) >= 8
    assert tier.nvme_stats().io_errors >= 1
    seen = get_all(store, stored)
    assert set(seen) == set(stored) and all(seen.values())
    store.close()
    store, _ = make_store(small_fs, cap=4 << 20)
    seen = get_all(store, stored)
    assert set(seen) == set(stored) and all(seen.values())


def test_filesystem_without_fallocate_grows_on_write(make_store, tmp_path: Path, monkeypatch):
    """Where posix_fallocate is refused, the slab is sized up front and filled by writes."""
    real = os.posix_fallocate

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    try:
        store, _ = make_store()
        assert _put(store, range(4)).stored == 4
        seen = get_all(store, list(range(4)))
        assert set(seen) == set(range(4)) and all(seen.values())
    finally:
        monkeypatch.setattr(os, "posix_fallocate", real)
    assert pytest is not None
