"""The default placement behaves like a cache, on real tiers built from config.

A victim of a full tier is demoted into the tier below while that tier has room; a put
into a full store evicts colder data and is never refused; a store whose only tier is
nvme stores what it is given, with no reuse history and even with no write budget left.
Stores are built the way the CLI, the daemon and the connector build them
(:func:`kvtier.factory.build_store` over a TOML file), with real ``host`` and ``nvme``
tiers in temporary directories.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.config import KVTierConfig, load_config
from kvtier.factory import build_store
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore

VALUE = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, VALUE, dtype=np.uint8)


def config(tmp: Path, tiers: str, extra: str = "") -> KVTierConfig:
    path = tmp / "kvtier.toml"
    path.write_text(f"[store]\nio_threads = 2\n{extra}\n{tiers}")
    return load_config(path, env={})


def nvme(tmp: Path, slots: int) -> str:
    return (
        f'[[tiers]]\nkind = "nvme"\ncapacity_bytes = {slots * VALUE}\n'
        f'dir = "{tmp / "nvme"}"\ncreate_dirs = true\n'
    )


def host(slots: int) -> str:
    return f'[[tiers]]\nkind = "host"\ncapacity_bytes = {slots * VALUE}\n'


def put_one(store: TieredStore, i: int) -> int:
    """Put one chunk the way a client does (lookup first); returns how many were stored."""
    assert store.lookup([key(i)]).hits == 0
    return store.put([key(i)], value(i)).result().stored


def read_back(store: TieredStore, i: int) -> str | None:
    """The tier chunk ``i`` is served from (bytes checked), or None for a miss."""
    dst = np.empty(VALUE, dtype=np.uint8)
    got = store.get([key(i)], dst).result()
    if not got.chunks:
        return None
    assert np.array_equal(dst, value(i))
    return got.tiers[0]


def test_the_default_placement_is_cost_with_the_user_wait_priced(tmp_path: Path) -> None:
    cfg = config(tmp_path, host(4))
    assert cfg.store.placement == "cost"
    assert cfg.placement.value_of_latency_per_s > 0


def test_victims_of_a_full_host_are_demoted_into_nvme(tmp_path: Path) -> None:
    cfg = config(tmp_path, host(4) + nvme(tmp_path, 32), "promote_on_hit = false")
    with build_store(cfg, chunk_bytes=VALUE).store as store:
        for i in range(12):  # 12 acknowledged puts into a 4-chunk host
            assert put_one(store, i) == 1
        store.drain()
        st = store.stats()
        assert st.demoted_chunks == 8 and st.dropped_chunks == 0
        served = [read_back(store, i) for i in range(12)]
        assert served == ["nvme"] * 8 + ["host"] * 4


def test_an_nvme_only_store_stores_what_it_is_given(tmp_path: Path) -> None:
    # No reuse history, and a write budget of zero: a put is still stored.
    cfg = config(tmp_path, nvme(tmp_path, 16), "[placement]\nwrite_budget_dwpd = 0.0")
    with build_store(cfg, chunk_bytes=VALUE).store as store:
        for i in range(10):
            assert put_one(store, i) == 1
        keys = [key(i) for i in range(10)]
        assert store.lookup(keys).tiers == ("nvme",) * 10
        assert all(read_back(store, i) == "nvme" for i in range(10))


@pytest.mark.parametrize("tiers", ["host", "host+nvme", "nvme"])
def test_a_put_into_a_full_store_evicts_colder_data(tmp_path: Path, tiers: str) -> None:
    layout = {"host": host(4), "host+nvme": host(2) + nvme(tmp_path, 2), "nvme": nvme(tmp_path, 4)}[
        tiers
    ]
    # A budget that never binds here: pacing is tested in tests/policies/test_placement.py.
    cfg = config(tmp_path, layout, "promote_on_hit = false\n[placement]\nwrite_budget_dwpd = 1e6")
    with build_store(cfg, chunk_bytes=VALUE).store as store:
        for i in range(20):  # five times what the store holds
            assert put_one(store, i) == 1
        store.drain()
        st = store.stats()
        assert st.put_rejected == 0 and st.put_chunks == 20
        # The 4 most recent stay; older ones went (least recently used first).
        assert [read_back(store, i) is not None for i in range(20)] == [False] * 16 + [True] * 4
