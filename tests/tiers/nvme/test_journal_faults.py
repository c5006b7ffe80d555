"""Issue 11: a failed journal commit never loses records silently; recovery orders by
sequence, never by slot; a damaged checkpoint header does not drop the index.

ENOSPC is injected at the journal's one write seam (``Journal._pwrite``) so these run
everywhere; ``test_faults.py`` runs the store's story on a real full tmpfs, and
``tests/service/test_full_disk.py`` runs it through a real daemon.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.nvme import Durability
from kvtier.tiers.nvme.journal import Entry, Geometry, Journal, Op, load
from tests.tiers.nvme.conftest import SLOT, get_all, key, values

GEO = Geometry(SLOT, 64)


class FullDiskJournal(Journal):
    """A journal whose writes fail with ENOSPC while ``full`` is set."""

    full = False

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super()._pwrite(fd, data, offset)


def _entry(slot: int, k: int) -> Entry:
    return Entry(slot, key(k), 100, 1234, 100)


def _journal(d: Path, **kw: Any) -> FullDiskJournal:
    j = FullDiskJournal(d, GEO, kw.pop("durability", Durability.SYNC), interval_s=0.01, **kw)
    j.load()
    j.start({})
    return j


def test_a_failed_commit_keeps_its_deletions_for_the_next_one(tmp_path: Path) -> None:
    j = _journal(tmp_path)
    j.append([(Op.PUT, _entry(0, 1))]).wait()
    j.full = True
    j.append([(Op.DEL, _entry(0, 1))])
    with pytest.raises(OSError, match="No space"):
        j.flush()
    assert j.failed_commits >= 1
    j.full = False
    j.flush()  # the retried DEL goes out with the next commit
    j.close()
    assert load(tmp_path, GEO).index == {}  # before the fix: the DEL was gone, slot 0 = key 1


def test_a_failed_sync_put_is_not_retried_behind_its_writer(tmp_path: Path) -> None:
    j = _journal(tmp_path)
    j.full = True
    t = j.append([(Op.PUT, _entry(3, 7))], fail_fast=True)
    try:
        t.wait(10)
        raise AssertionError("the commit should have failed")
    except OSError:
        pass
    j.full = False
    j.flush()
    j.close()
    assert load(tmp_path, GEO).index == {}  # the writer was told "failed": never durable later


def test_the_newer_put_of_a_key_wins_over_a_lower_slot(tmp_path: Path) -> None:
    # A DEL lost for good (a crash before any commit succeeded), then the key stored
    # again in a higher slot: recovery must serve the new value, not the lower slot's.
    j = _journal(tmp_path)
    j.append([(Op.PUT, Entry(5, key(1), 100, 111, 100))]).wait()
    j.append([(Op.PUT, Entry(9, key(1), 100, 222, 100))]).wait()
    j.close()
    res = load(tmp_path, GEO)
    assert {e.slot: e.checksum for e in res.index.values()} == {9: 222}
    assert res.stats.superseded == 1


def test_sequence_order_survives_a_checkpoint(tmp_path: Path) -> None:
    j = Journal(tmp_path, GEO, Durability.SYNC)
    j.load()
    # Two live entries of one key written into a checkpoint (what an older version kept):
    # the sequences go into the checkpoint and decide at the next load.
    j.start({5: Entry(5, key(1), 100, 111, 100, seq=1), 9: Entry(9, key(1), 100, 222, 100, seq=2)})
    j.close()
    assert {e.slot for e in load(tmp_path, GEO).index.values()} == {9}


def test_one_flipped_byte_in_the_checkpoint_header_keeps_the_index(
    make_store, tmp_path: Path
) -> None:
    store, _ = make_store(checkpoint_min_records=16)
    for i in range(40):
        store.put([key(i)], values([i])).result()
    store.close()
    store, _ = make_store()  # start-up writes everything into a fresh checkpoint
    store.close()
    (ckpt,) = (tmp_path / "nv.index").glob("checkpoint.*")
    raw = bytearray(ckpt.read_bytes())
    raw[20] ^= 0x01  # inside the header's generation field
    ckpt.write_bytes(bytes(raw))
    store, _ = make_store()
    seen = get_all(store, list(range(40)))
    assert seen == dict.fromkeys(range(40), True)  # before the fix: {} (40 misses)
