"""The seed's CXL-SSD formula and threshold matrix, pinned to the seed's values."""

from __future__ import annotations

import math

import pytest

from kvtier.errors import InputError
from kvtier.policies.seed import SEED_MATRIX, check_seed, seed_cost_per_gb_month


def test_formula_constants_reproduce_the_seed() -> None:
    # cost = 12.8 * L_us^0.7 / (C_gbps * 0.85) + 0.33 * P_w
    assert seed_cost_per_gb_month(1.0, 1.0, 0.0) == pytest.approx(12.8 / 0.85, rel=1e-12)
    assert seed_cost_per_gb_month(0.0, 10.0, 1.0) == pytest.approx(0.33, rel=1e-12)
    assert seed_cost_per_gb_month(10.0, 64.0, 5.0) == pytest.approx(2.8292640791229937, rel=1e-12)
    assert seed_cost_per_gb_month(0.25, 64.0, 12.0) == pytest.approx(4.049159798030024, rel=1e-12)


def test_formula_latency_exponent_is_point_seven() -> None:
    a = seed_cost_per_gb_month(2.0, 1.0, 0.0)
    b = seed_cost_per_gb_month(1.0, 1.0, 0.0)
    assert math.log(a / b, 2) == pytest.approx(0.7, rel=1e-12)


@pytest.mark.parametrize("args", [(-1.0, 1.0, 0.0), (1.0, 0.0, 0.0), (1.0, 1.0, -2.0)])
def test_formula_rejects_impossible_inputs(args: tuple[float, float, float]) -> None:
    with pytest.raises(InputError):
        seed_cost_per_gb_month(*args)


def test_threshold_matrix_values() -> None:
    rows = {
        s.name: (s.p99_latency_us_max, s.cxl_bandwidth_gbps_min, s.ssd_wear_pct_per_year_max)
        for s in SEED_MATRIX
    }
    assert rows == {
        "LLM inference cache": (23.6, 64.0, 1.8),
        "real-time recommendation cache": (41.2, 32.0, 3.5),
    }


def test_check_boundaries_are_inclusive() -> None:
    llm, rec = check_seed(23.6, 64.0, 1.8)
    assert llm.passed and rec.passed
    llm, rec = check_seed(23.61, 64.0, 1.8)
    assert not llm.p99_ok and llm.bandwidth_ok and llm.wear_ok and not llm.passed
    assert rec.passed
    llm, rec = check_seed(10.0, 63.9, 1.81)
    assert not llm.bandwidth_ok and not llm.wear_ok
    assert rec.bandwidth_ok and rec.wear_ok
    llm, rec = check_seed(41.3, 31.9, 3.6)
    assert not rec.p99_ok and not rec.bandwidth_ok and not rec.wear_ok


def test_absent_tiers_are_not_judged() -> None:
    for c in check_seed(5.0, None, None):
        assert c.bandwidth_ok is None and c.wear_ok is None and c.passed
