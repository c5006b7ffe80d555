"""Faults of the medium: ENOSPC, EIO, a slab deleted or truncated, a journal cut mid-record.

Each must give a logged reason and a miss, never a crash, wrong bytes or a lost index.
ENOSPC runs twice: for real on a small tmpfs mounted for the test (where the machine
lets the test mount one, i.e. as root), and injected at the I/O engine boundary
(``PosixEngine._pwrite``), which runs everywhere. EIO is injected at that boundary too:
no filesystem here produces it on demand.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError, NotDurableError
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.nvme import Durability
from kvtier.tiers.nvme.engine import PosixEngine
from tests.tiers.nvme.conftest import SLOT, VALUE, get_all, key, values
from tests.tmpfs import fill, mounted_tmpfs


class FaultyEngine(PosixEngine):
    """Posix engine that fails the next ``fail_writes``/``fail_reads`` transfers."""

    def __init__(self, err: int = errno.EIO) -> None:
        super().__init__(threads=2)
        self.err = err
        self.fail_writes = 0
        self.fail_reads = 0

    def _pwrite(self, fd: int, buf: Any, offset: int) -> int:
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise OSError(self.err, os.strerror(self.err))
        return super()._pwrite(fd, buf, offset)

    def _pread(self, fd: int, buf: Any, offset: int) -> int:
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise OSError(self.err, os.strerror(self.err))
        return super()._pread(fd, buf, offset)


class NoDirectEngine(PosixEngine):
    """A filesystem that refuses O_DIRECT, as some FUSE and network filesystems do."""

    def _open_fd(self, path: Path, flags: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return super()._open_fd(path, flags)


def _put(store, ids: list[int]):
    return store.put([key(i) for i in ids], values(ids)).result()


def test_injected_enospc_on_data_is_a_failed_put_then_recovers(make_store, caplog) -> None:
    engine = FaultyEngine(errno.ENOSPC)
    store, tier = make_store(engine=engine)
    assert _put(store, [1, 2]).stored == 2
    engine.fail_writes = 1
    with caplog.at_level(logging.WARNING):
        r = _put(store, [3, 4])
    assert r.stored == 0 and r.failed == 2
    assert "No space left" in caplog.text
    assert store.stats().tier_errors == 1 and tier.nvme_stats().io_errors == 1
    assert store.lookup([key(3)]).hits == 0
    assert _put(store, [3, 4]).stored == 2  # the space came back
    assert get_all(store, [1, 2, 3, 4]) == {1: True, 2: True, 3: True, 4: True}


def test_injected_eio_on_read_is_a_miss_and_frees_the_chunk(make_store) -> None:
    engine = FaultyEngine(errno.EIO)
    store, tier = make_store(engine=engine)
    _put(store, [1, 2, 3])
    engine.fail_reads = 1
    out = np.zeros(VALUE, dtype=np.uint8)
    assert store.get([key(2)], out).result().chunks == 0
    assert store.stats().tier_errors == 1 and tier.nvme_stats().io_errors == 1
    assert store.lookup([key(2)]).hits == 0
    assert get_all(store, [1, 3]) == {1: True, 3: True}


def test_o_direct_refused_falls_back_to_buffered_io_and_says_so(make_store, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        store, tier = make_store(engine=NoDirectEngine())
    assert "refuses O_DIRECT" in caplog.text
    assert tier.nvme_stats().direct is False
    _put(store, [1, 2])
    assert get_all(store, [1, 2]) == {1: True, 2: True}


def test_o_direct_required_but_refused_is_a_config_error(tmp_path: Path) -> None:
    from kvtier.config import Switch
    from kvtier.tiers.nvme import EngineKind, Options
    from kvtier.tiers.nvme.tier import NVMeTier

    with pytest.raises(ConfigError, match="O_DIRECT"):
        NVMeTier(
            TierGeometry("nv", 16 * SLOT, SLOT, 1 << 30),
            Options(dir=str(tmp_path), engine=EngineKind.POSIX, o_direct=Switch.ON),
            engine=NoDirectEngine(),
        )


def test_slab_deleted_under_a_running_store(make_store, tmp_path: Path, caplog) -> None:
    store, _ = make_store()
    _put(store, [1, 2, 3])
    (tmp_path / "nv.slab0").unlink()
    with caplog.at_level(logging.ERROR):
        r = _put(store, [4])
    assert r.stored == 0 and r.failed == 1
    assert "deleted" in caplog.text
    # Chunks already there are still served from the open (unlinked) file, correctly.
    assert get_all(store, [1, 2, 3, 4]) == {1: True, 2: True, 3: True}
    store.close()
    store, tier = make_store()  # a new, empty slab: nothing old verifies, nothing wrong served
    assert get_all(store, [1, 2, 3]) == {}
    assert tier.nvme_stats().recover_dropped == 3
    _put(store, [5])
    assert get_all(store, [5]) == {5: True}


def test_slab_truncated_under_a_running_store(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    _put(store, [1, 2, 3])
    os.truncate(tmp_path / "nv.slab0", 0)
    seen = get_all(store, [1, 2, 3])
    assert seen == {}  # short reads: misses, never zeros as data
    assert store.stats().tier_errors + store.stats().corrupt_chunks >= 1
    assert _put(store, [4]).stored == 1
    assert get_all(store, [4]) == {4: True}


def test_journal_cut_mid_record(make_store, tmp_path: Path) -> None:
    store, _ = make_store()
    for i in range(6):
        _put(store, [i])
    store.close()
    (journal,) = (tmp_path / "nv.index").glob("journal.*")
    size = journal.stat().st_size
    os.truncate(journal, size - 30)  # the last record loses its tail

    store, tier = make_store()
    seen = get_all(store, list(range(6)))
    assert set(seen) == set(range(5)) and all(seen.values())
    assert tier.nvme_stats().journal_bad_records == 0  # a torn tail, not a corrupt record
    _put(store, [6])  # appending after a torn tail works, and survives the next restart
    store.close()
    store, _ = make_store()
    seen = get_all(store, list(range(7)))
    assert set(seen) == set(range(5)) | {6} and all(seen.values())


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test, or a skip where mounting is not allowed."""
    with mounted_tmpfs(
        tmp_path, "1m", "mounting a tmpfs needs root; the injected ENOSPC test covers this path"
    ) as mnt:
        yield mnt


def test_real_enospc_on_a_full_filesystem(make_store, small_fs: Path, caplog) -> None:
    store, tier = make_store(small_fs, cap=16 * SLOT, durability=Durability.SYNC)
    assert _put(store, [1, 2]).stored == 2
    filler = fill(small_fs)  # take every byte left
    # The journal's last page still has room: store and delete until a record needs a new page.
    failed_at = None
    with caplog.at_level(logging.WARNING):
        for i in range(3, 300):
            r = _put(store, [i])
            if r.failed:
                failed_at = i
                break
            with contextlib.suppress(NotDurableError):  # its DEL needed the new page
                store.delete([key(i)])
    assert failed_at is not None
    assert r.stored == 0 and r.failed == 1  # its record could not be made durable
    assert "No space left" in caplog.text
    assert tier.nvme_stats().failed_commits >= 1
    assert store.lookup([key(failed_at)]).hits == 0
    filler.unlink()
    assert _put(store, [1000]).stored == 1
    store.close()
    store, _ = make_store(small_fs, cap=16 * SLOT)
    seen = get_all(store, [1, 2, failed_at, 1000])
    assert {1, 2, 1000} <= set(seen) and all(seen.values())


def test_delete_on_a_full_disk_then_a_re_put_serves_the_new_value(
    make_store, small_fs: Path
) -> None:
    """Issue 11, item 1: V1; full disk; DELETE (its record cannot be written); space back;
    V2 in another slot; clean restart: V2. Before the fix the failed commit dropped the
    DEL and recovery let the lower slot win: V1."""
    store, _ = make_store(small_fs, cap=16 * SLOT, durability=Durability.SYNC)
    k = key(1)
    assert _put(store, [1]).stored == 1  # slot 0
    assert _put(store, [2]).stored == 1  # slot 1, so a run of two cannot take slot 0
    filler = fill(small_fs)
    # The journal's last page may still have room: use it up with puts and deletes.
    for i in range(3, 400):
        if _put(store, [i]).failed:
            break
        try:
            store.delete([key(i)])
        except NotDurableError:
            break
    else:
        raise AssertionError("the journal never ran out of room")
    # Not acknowledged as durable (sync): before the fix it answered 1, and the failed
    # commit dropped the DEL.
    with pytest.raises(NotDurableError):
        store.delete([k])
    filler.unlink()
    new = values([101, 102])
    assert store.put([k, key(102)], new).result().stored == 2
    store.close()
    store, _ = make_store(small_fs, cap=16 * SLOT)
    buf = bytearray(new.nbytes)
    res = store.get([k], buf).result()
    assert res.chunks == 1
    assert bytes(buf[: res.nbytes]) == values([101]).tobytes()


def test_slab_that_does_not_fit_is_a_config_error(small_fs: Path) -> None:
    """With ``preallocate = true``; growing slabs are tests/tiers/nvme/test_growth.py."""
    from kvtier.tiers.nvme import EngineKind, Options
    from kvtier.tiers.nvme.tier import NVMeTier

    with pytest.raises(ConfigError, match="fits"):
        NVMeTier(
            TierGeometry("nv", 4 << 20, SLOT, 1 << 30),
            Options(dir=str(small_fs), engine=EngineKind.POSIX, preallocate=True),
        )


def test_fault_counters_reach_tier_stats_and_metrics(make_store) -> None:
    for extra in ("starlette", "fastapi"):  # the metrics text lives in the service extra
        pytest.importorskip(extra, reason="needs the service extra: pip install 'kvtier[service]'")
    from kvtier.service.metrics import store_exposition

    engine = FaultyEngine(errno.EIO)
    store, _ = make_store(engine=engine)
    _put(store, [1, 2])
    engine.fail_reads = 1
    assert get_all(store, [1]) == {}  # the failed read is a miss
    (tier_stats,) = store.stats().tiers
    assert tier_stats.io_errors == 1  # before the fix: only in nvme_stats(), never in /metrics
    text = "\n".join(store_exposition(store.stats()))
    assert 'kvtier_tier_io_errors_total{tier="nv",kind="nvme"} 1' in text
    assert 'kvtier_tier_corrupt_chunks_total{tier="nv",kind="nvme"} 0' in text


def test_data_at_rest_is_private(make_store, tmp_path: Path) -> None:
    d = tmp_path / "new" / "data"
    store, _ = make_store(d, create_dirs=True)
    _put(store, [1])
    store.close()
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    assert d.stat().st_mode & 0o777 == 0o700
    assert (d / "nv.index").stat().st_mode & 0o777 == 0o700
    files = [d / "nv.slab0", *(d / "nv.index").iterdir()]
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o600 for f in files}


def test_a_restart_on_a_full_disk_resumes_the_journal(make_store, small_fs: Path) -> None:
    store, _ = make_store(small_fs, cap=16 * SLOT, durability=Durability.SYNC)
    assert _put(store, [1, 2, 3]).stored == 3
    filler = fill(small_fs)
    store.close()
    # No room for a new checkpoint: before the fix the tier refused to start (ConfigError).
    store, _ = make_store(small_fs, cap=16 * SLOT)
    assert get_all(store, [1, 2, 3]) == {1: True, 2: True, 3: True}
    filler.unlink()
    assert store.delete([key(2)]) == 1  # appended to the resumed journal
    assert _put(store, [4]).stored == 1
    store.close()
    store, _ = make_store(small_fs, cap=16 * SLOT)
    assert get_all(store, [1, 2, 3, 4]) == {1: True, 3: True, 4: True}
