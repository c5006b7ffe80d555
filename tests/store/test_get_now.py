"""``TieredStore.get_now``: a get on the caller's thread when it is a memcpy, else nothing.

The daemon's protocol answers a one-chunk GET with it before the ASGI layers; a hit it
cannot copy now must leave the store as it found it (no read, no count), so that the
ASGI path's :meth:`~kvtier.store.TieredStore.get` is the only get that happens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.store import TieredStore

from .test_store_pieces import SLOT, host, key, nvme, value


def test_a_hit_in_memory_is_copied_now(tmp_path: Path) -> None:
    with TieredStore([host(tmp_path, "top", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        out = np.zeros(SLOT, np.uint8)
        got = store.get_now([key(1)], out, max_bytes=SLOT)
        assert got is not None and got.chunks == 1
        assert np.array_equal(out, value(1))
        assert store.stats().gets == 1


def test_a_miss_with_no_shared_tier_is_answered_now(tmp_path: Path) -> None:
    with TieredStore([host(tmp_path, "top", 4)], io_threads=1) as store:
        got = store.get_now([key(7)], np.zeros(SLOT, np.uint8), max_bytes=SLOT)
        assert got is not None and got.chunks == 0


def test_a_hit_behind_io_is_left_untouched(tmp_path: Path) -> None:
    with TieredStore([nvme(tmp_path, "low", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        out = np.zeros(SLOT, np.uint8)
        assert store.get_now([key(1)], out, max_bytes=SLOT) is None
        assert store.stats().gets == 0 and not out.any()
        # Nothing is held: the chunk is still readable, and deletable, as before.
        assert store.get([key(1)], out).result().chunks == 1
        assert np.array_equal(out, value(1))
        assert store.delete([key(1)]) == 1


def test_a_hit_over_max_bytes_is_left_untouched(tmp_path: Path) -> None:
    with TieredStore([host(tmp_path, "top", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        out = np.zeros(SLOT, np.uint8)
        assert store.get_now([key(1)], out, max_bytes=SLOT - 1) is None
        assert store.stats().gets == 0 and not out.any()
        assert store.delete([key(1)]) == 1


def test_a_held_value_is_the_chunk_in_place_and_counts_when_released(tmp_path: Path) -> None:
    with TieredStore([host(tmp_path, "top", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        held = store.hold_value(key(1), max_bytes=SLOT)
        assert held is not None
        assert bytes(held.view) == value(1).tobytes()
        assert store.stats().get_chunks == 0  # counted when released, as a get is
        held.release()
        held.release()  # a no-op
        stats = store.stats()
        assert (stats.gets, stats.get_chunks, stats.get_bytes) == (1, 1, SLOT)
        assert store.delete([key(1)]) == 1  # nothing is held any more


def test_no_value_is_held_when_absent_behind_io_or_too_large(tmp_path: Path) -> None:
    with TieredStore([host(tmp_path, "top", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        assert store.hold_value(key(2), max_bytes=SLOT) is None
        assert store.hold_value(key(1), max_bytes=SLOT - 1) is None
        assert store.stats().gets == 0
    with TieredStore([nvme(tmp_path, "low", 4)], io_threads=1) as store:
        store.put([key(1)], value(1)).result()
        assert store.hold_value(key(1), max_bytes=SLOT) is None
        assert store.stats().gets == 0
        assert store.delete([key(1)]) == 1
