"""The trace simulator on trace prefixes: deterministic, consistent, and agreeing with a
store that moves real bytes."""

from __future__ import annotations

import pytest

from kvtier.errors import InputError
from kvtier.policies.profiles import hardware_preset
from kvtier.policies.recompute import COMPUTE_PRESETS, Recompute, model_compute
from kvtier.policies.simulate import SimConfig, simulate
from kvtier.policies.trace import load_trace
from kvtier.policies.validate import validate

HW = hardware_preset("h200-dram-nvme")
MODEL = model_compute("llama-3-8b")
CHUNK = MODEL.kv.chunk_bytes(512)


def ideal_hit_rate(trace) -> float:
    """Hits of an infinite cache under the prefix rule: an upper bound."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace.requests:
        blocks = trace.full_blocks(r)
        for b in blocks:
            if b not in seen:
                break
            hits += 1
        total += len(blocks)
        seen.update(blocks)
    return hits / total


@pytest.fixture(scope="module", params=["mooncake-conversation", "mooncake-synthetic"])
def trace(request: pytest.FixtureRequest):
    return load_trace(request.param, limit=400)


def test_results_are_consistent_and_deterministic(trace) -> None:
    caps = (300 * CHUNK, 2000 * CHUNK)
    for policy in ("lru-write-through", "kvtier"):
        a = simulate(SimConfig(MODEL, HW, caps, policy=policy), trace)
        b = simulate(SimConfig(MODEL, HW, caps, policy=policy), trace)
        assert (a.hit_rate, a.ssd_bytes_written) == (b.hit_rate, b.ssd_bytes_written)
        assert a.hit_chunks == sum(t.hit_chunks for t in a.tiers)
        assert 0 < a.hit_rate <= ideal_hit_rate(trace) + 1e-12
        assert a.ttft_p50_s <= a.recompute_ttft_p50_s
        assert a.ttft_p99_s <= a.recompute_ttft_p99_s


def test_kvtier_writes_less_than_write_through_within_budget(trace) -> None:
    caps = (300 * CHUNK, 2000 * CHUNK)
    lru = simulate(SimConfig(MODEL, HW, caps, policy="lru-write-through"), trace)
    kv = simulate(SimConfig(MODEL, HW, caps, policy="kvtier", budget_window_s=3600.0), trace)
    assert kv.ssd_bytes_written < lru.ssd_bytes_written
    nvme = HW.tier("nvme")
    # The hour's allowance bounds what a trace shorter than an hour may write.
    assert kv.ssd_bytes_written <= nvme.write_budget_Bps(2000 * CHUNK) * 3600.0
    assert kv.placement is not None and kv.reuse is not None


def test_more_capacity_never_hurts_lru(trace) -> None:
    small = simulate(SimConfig(MODEL, HW, (100 * CHUNK, 0), policy="lru-write-through"), trace)
    big = simulate(SimConfig(MODEL, HW, (2000 * CHUNK, 0), policy="lru-write-through"), trace)
    assert big.hit_rate >= small.hit_rate


def test_impossible_configurations_are_refused(trace) -> None:
    with pytest.raises(InputError, match="capacities"):
        SimConfig(MODEL, HW, (CHUNK,))
    with pytest.raises(InputError, match="no tier has room"):
        simulate(SimConfig(MODEL, HW, (10, 0)), trace)
    with pytest.raises(InputError, match="policy"):
        SimConfig(MODEL, HW, (CHUNK, 0), policy="fifo")


def test_simulator_matches_a_store_with_real_bytes() -> None:
    tr = load_trace("mooncake-conversation", limit=250)
    for policy in ("lru-write-through", "kvtier"):
        v = validate(
            SimConfig(MODEL, HW, (400 * CHUNK, 1500 * CHUNK), policy=policy), tr, value_bytes=4096
        )
        assert v.corrupt_chunks == 0 and v.verified_chunks > 0
        assert v.max_abs_diff_points <= 2.0


def test_recompute_has_an_attention_term() -> None:
    rc = Recompute(MODEL, HW.gpu)
    # The same 512 tokens cost more deep in a long context than at its start.
    assert rc.chunk_s(512, 30000) > 1.5 * rc.chunk_s(512, 0)
    assert rc.prefill_s(1000, 1000) == 0.0
    for m in COMPUTE_PRESETS.values():
        assert m.kv_bytes_per_token > 0 and Recompute(m, HW.gpu).prefill_s(512) > 0
