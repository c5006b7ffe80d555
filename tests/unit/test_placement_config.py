"""The [placement] section: typed, validated, and what the store built from config uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.policies.placement import CostAwarePlacement
from kvtier.policies.recompute import model_compute


def test_defaults_price_the_user_wait_and_budget_the_ssd() -> None:
    p = load_config(env={}).placement
    assert p.value_of_latency_per_s == pytest.approx(0.001)
    assert p.write_budget_dwpd == pytest.approx(0.8) and p.write_budget_window_s == 86400


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("value_of_latency_per_s", "-1"),
        ("gpu_mfu", "1.5"),
        ("write_budget_window_s", "10"),
        ("write_budget_dwpd", "-0.1"),
        ("gpus", "-1"),
        ("context_tokens", "x"),
    ],
)
def test_bad_values_fail_loudly_naming_the_key(key: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=f"placement\\.{key}"):
        load_config(env={}, overrides=[f"placement.{key}={bad}"])


def test_environment_and_flags_reach_the_store(tmp_path: Path) -> None:
    env = {"KVTIER_PLACEMENT__VALUE_OF_LATENCY_PER_S": "0.01"}
    cfg = load_config(
        env=env, overrides=["placement.recompute_s=0.5", "tiers.0.capacity_bytes=64KiB"]
    )
    with build_store(cfg, chunk_bytes=4096).store as store:
        placement = store.placement
        assert isinstance(placement, CostAwarePlacement)
        gpu_per_s = model_compute("llama-3-8b").gpus * 3.5 / 3600
        assert placement.econ.value_per_s == pytest.approx(gpu_per_s + 0.01)
        assert placement.econ.recompute_s == pytest.approx(0.5)


def test_an_unknown_model_for_recompute_is_a_config_error() -> None:
    cfg = load_config(
        env={}, overrides=["placement.model=no-such-model", "tiers.0.capacity_bytes=64KiB"]
    )
    with pytest.raises(ConfigError, match=r"placement\.model"):
        build_store(cfg, chunk_bytes=4096)


def test_a_caller_given_geometry_is_priced_without_the_ignored_model_section() -> None:
    # The connector brings vLLM's geometry and ignores [model]: a 70B [model] (4 GPUs) must
    # not price the recompute of the 8B-shaped chunks it stores.
    from kvtier.spec import preset

    cfg = load_config(env={}, overrides=["model.name=llama-3-70b", "tiers.0.capacity_bytes=64KiB"])
    with build_store(cfg, spec=preset("llama-3-8b"), chunk_bytes=4096).store as store:
        placement = store.placement
        assert isinstance(placement, CostAwarePlacement)
        one_gpu = 3.5 / 3600
        assert placement.econ.value_per_s == pytest.approx(one_gpu + 0.001)
    with build_store(cfg, chunk_bytes=4096).store as store:  # [model] read: 4 GPUs
        placement = store.placement
        assert isinstance(placement, CostAwarePlacement)
        assert placement.econ.value_per_s == pytest.approx(4 * one_gpu + 0.001)
