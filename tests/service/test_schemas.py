"""The stats models are derived from the core's dataclasses, so they cannot drift."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="needs the service extra: pip install 'kvtier[service]'")

import dataclasses
from dataclasses import dataclass

from kvtier.service.schemas import StoreStatsModel, TierStatsModel, as_json, model_of
from kvtier.store.types import PolicyCount, StoreStats
from kvtier.tiers.base import TierStats


@dataclass(frozen=True)
class _Inner:
    a: int
    b: float = 0.5


@dataclass(frozen=True)
class _Outer:
    n: int
    pairs: tuple[tuple[str, int], ...]
    inner: tuple[_Inner, ...]
    added_later: int = 7


def test_a_field_added_to_a_dataclass_appears_in_its_model() -> None:
    inner = model_of(_Inner, "InnerModel", "doc")
    outer = model_of(_Outer, "OuterModel", "doc", {_Inner: inner})
    assert set(outer.model_fields) == {f.name for f in dataclasses.fields(_Outer)}
    value = _Outer(3, (("x", 1), ("y", 2)), (_Inner(1),))
    got = outer.model_validate(as_json(value)).model_dump()
    assert got == {
        "n": 3,
        "pairs": {"x": 1, "y": 2},
        "inner": [{"a": 1, "b": 0.5}],
        "added_later": 7,
    }


def test_store_stats_round_trip_through_the_models() -> None:
    tier = TierStats("host", "host", 10, 4, 2, 1, 0.0, 5, 6, 7, 8, False)
    fields = {f.name: 0 for f in dataclasses.fields(StoreStats)}
    count = PolicyCount("budget_available_bytes", 12.5, "nvme", gauge=True, help="left")
    fields.update(tier_hits=(("host", 3),), tiers=(tier,), placement=(count,))
    st = StoreStats(**fields)
    assert set(TierStatsModel.model_fields) == {f.name for f in dataclasses.fields(TierStats)}
    dumped = StoreStatsModel.model_validate(as_json(st)).model_dump()
    assert dumped["tier_hits"] == {"host": 3}
    assert dumped["tiers"][0] == dataclasses.asdict(tier)
    assert dumped["placement"] == [dataclasses.asdict(count)]


def test_head_end_finds_the_marker_within_and_across_reads() -> None:
    from kvtier.service.dataplane import head_end

    assert head_end(b"", b"GET / HTTP/1.1\r\n\r\nbody") == 18
    assert head_end(b"", b"GET / HTTP/1.1\r\nX: y") == -1
    assert head_end(b"y\r\n", b"\r\nbody") == 2  # the marker straddles two reads
    assert head_end(b"\r\n\r", b"\nbody") == 1
    assert head_end(b"abc", b"\r\n\r\n") == 4
