"""The ``meta`` tier: real allocation and counters, no bytes (simulation only)."""

from __future__ import annotations

import numpy as np

from kvtier.config import load_config
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.meta import MetaTier
from kvtier.tiers.registry import create_tier


def test_counts_writes_and_reads_without_storing_bytes() -> None:
    tier = MetaTier(TierGeometry("m", 8 * 4096, 4096, 1 << 20))
    exts = tier.allocate(3)
    assert exts is not None and tier.free_slots == 5
    keys = tuple(ChunkKey(bytes([i]) * 16) for i in range(3))
    tier.write(SlotRun(exts[0].offset, keys[:1], 4096), memoryview(bytes(4096)))
    dst = np.full(4096, 7, dtype=np.uint8)
    tier.read(SlotRun(exts[0].offset, keys[:1], 4096), memoryview(dst.data))
    assert (dst == 7).all()  # nothing was copied in
    st = tier.stats()
    assert (st.bytes_written, st.bytes_read, st.kind, st.emulated) == (4096, 4096, "meta", True)


def test_builds_from_config_and_drives_a_store() -> None:
    cfg = load_config(
        base={
            "tiers": [
                {"kind": "meta", "capacity_bytes": "64KiB", "endurance_dwpd": 1.0, "latency_us": 80}
            ]
        }
    )
    tier = create_tier(cfg.tiers[0], 4096, 1 << 20)
    assert tier.profile.endurance_dwpd == 1.0
    assert abs(tier.profile.latency_s - 80e-6) < 1e-12
    with TieredStore([tier], io_threads=0) as store:
        keys = [ChunkKey(bytes([i]) * 16) for i in range(20)]
        res = store.put(keys, np.zeros(20 * 4096, np.uint8)).result()
        assert res.stored == 16  # the tier holds 16 slots; the rest did not fit
        assert store.lookup(keys[:4]).hits == 4
