"""The handoff's parts that need no engine: roles, kv_transfer_params, bounded waits."""

from __future__ import annotations

import logging

import pytest

from kvtier.connectors.vllm.handoff import (
    Handoff,
    PrefillWaits,
    Role,
    handoff_of,
    producer_params,
)
from kvtier.connectors.vllm.settings import config_from_extra, prefill_wait_from_extra
from kvtier.errors import ConfigError

KEYS = [bytes([i]) * 16 for i in range(4)]


def test_roles_as_vllm_means_them() -> None:
    assert Role.parse("kv_producer").saves and not Role.parse("kv_producer").loads
    assert Role.parse("kv_consumer").loads and not Role.parse("kv_consumer").saves
    assert Role.parse("kv_both").loads and Role.parse("kv_both").saves
    with pytest.raises(ValueError):
        Role.parse("kv_prefill")


def test_producer_params_round_trip_through_json_shapes() -> None:
    params = producer_params(3, KEYS[2])
    assert params == {"kvtier": {"chunks": 3, "last_key": KEYS[2].hex()}}
    assert handoff_of(params, "r") == Handoff(3, KEYS[2], None)
    assert handoff_of({"kvtier": {"wait_s": 2}}, "r") == Handoff(None, None, 2.0)
    assert handoff_of(None, "r") is None
    assert handoff_of({"do_remote_prefill": True}, "r") is None  # another connector's


@pytest.mark.parametrize(
    "bad",
    [
        "x",
        {"chunks": "two"},
        {"chunks": 1.5},
        {"chunks": -1},
        {"last_key": "zz"},
        {"wait_s": -1},
        {"wait_s": float("inf")},
    ],
)
def test_malformed_params_are_logged_and_ignored(bad: object, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.connectors.vllm.handoff"):
        assert handoff_of({"kvtier": bad}, "req-1") is None
    assert "req-1" in caplog.text and "ignoring" in caplog.text


def test_consumer_waits_bounded_then_recomputes_with_a_reason(caplog) -> None:
    waits = PrefillWaits(max_wait_s=5.0, shared=True, role=Role.CONSUMER)
    h = Handoff(3, KEYS[2], wait_s=1.0)
    assert waits.should_wait("r", h, KEYS, 1, 4, now=100.0)  # 1 of 3 there: wait
    assert waits.waiting and waits.is_waiting("r")
    assert waits.should_wait("r", h, KEYS, 2, 4, now=100.9)
    with caplog.at_level(logging.INFO, logger="kvtier.connectors.vllm.handoff"):
        assert not waits.should_wait("r", h, KEYS, 2, 4, now=101.0)  # wait_s ran out
        waits.settled("r", 2, 4)
    assert not waits.waiting
    assert "did not arrive within 1.0 s (2 of 3 there)" in caplog.text
    assert "loads 2 of 4 prompt chunks" in caplog.text


def test_wait_ends_when_the_chunks_arrive_and_is_capped_by_the_connector() -> None:
    waits = PrefillWaits(max_wait_s=0.5, shared=True, role=Role.CONSUMER)
    h = Handoff(wait_s=60.0)  # every full chunk of the prompt; capped at 0.5 s
    assert waits.should_wait("r", h, KEYS, 0, 4, now=0.0)
    assert not waits.should_wait("r", h, KEYS, 4, 4, now=0.1)  # arrived
    assert waits.should_wait("q", h, KEYS, 0, 4, now=0.0)
    assert not waits.should_wait("q", h, KEYS, 0, 4, now=0.5)  # the connector's cap


def test_no_wait_for_other_keys_or_without_a_shared_store(caplog) -> None:
    waits = PrefillWaits(max_wait_s=5.0, shared=True, role=Role.CONSUMER)
    with caplog.at_level(logging.INFO, logger="kvtier.connectors.vllm.handoff"):
        assert not waits.should_wait("r", Handoff(3, KEYS[0]), KEYS, 0, 4, now=0.0)
        waits.settled("r", 0, 4)
        assert not waits.should_wait("s", Handoff(9, KEYS[0]), KEYS, 0, 4, now=0.0)
    assert "has other keys" in caplog.text
    embedded = PrefillWaits(max_wait_s=5.0, shared=False, role=Role.CONSUMER)
    assert not embedded.should_wait("r", Handoff(3, KEYS[2]), KEYS, 0, 4, now=0.0)


def test_prefill_wait_is_a_connector_key() -> None:
    assert prefill_wait_from_extra({}) == 5.0
    assert prefill_wait_from_extra({"prefill_wait_s": "2.5"}) == 2.5
    for bad in (-1, "soon", float("inf")):
        with pytest.raises(ConfigError):
            prefill_wait_from_extra({"prefill_wait_s": bad})
    config_from_extra({"prefill_wait_s": 3}, env={})  # not taken for a kvtier setting
