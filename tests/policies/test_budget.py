"""The SSD write budget: never more than the allowance in any window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.policies.budget import WriteBudget


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_grants_until_the_allowance_then_refuses() -> None:
    clock = Clock()
    b = WriteBudget(24 * 1000.0, window_s=3600, clock=clock)  # 1000 B per hour
    assert b.allowance_bytes == pytest.approx(1000.0)
    assert b.try_spend(600)
    assert not b.try_spend(500)
    assert b.try_spend(400)
    assert b.available() == 0
    clock.t = 3600 + 121  # the first grants' bucket has left the window
    assert b.try_spend(1000)


@pytest.mark.parametrize(
    "kw",
    [
        {"bytes_per_day": -1.0},
        {"bytes_per_day": 1.0, "window_s": 10.0},
        {"bytes_per_day": 1.0, "window_s": 2 * 86400.0},
    ],
)
def test_bad_settings_fail_loudly(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        WriteBudget(**kw)


@settings(max_examples=60, deadline=None)
@given(
    window=st.sampled_from([60.0, 600.0, 3600.0, 86400.0]),
    ops=st.lists(st.tuples(st.floats(0, 900), st.integers(1, 400)), min_size=1, max_size=120),
)
def test_no_window_ever_exceeds_the_allowance(window: float, ops: list[tuple[float, int]]) -> None:
    clock = Clock()
    b = WriteBudget(86400.0 * 1000 / window, window_s=window, clock=clock)  # 1000 B per window
    grants: list[tuple[float, int]] = []
    for dt, n in ops:
        clock.t += dt
        if b.try_spend(n):
            grants.append((clock.t, n))
    for t_end, _ in grants:
        in_window = sum(n for t, n in grants if t_end - window <= t <= t_end)
        assert in_window <= b.allowance_bytes
