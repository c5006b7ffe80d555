"""Cache salts as tenants with quotas in the connector's embedded store (real vLLM CPU).

With ``[tenants]`` in the connector's configuration, a request's ``cache_salt`` names
its tenant: its chunk keys carry that tenant's tag (connectors/vllm/keys.py), so the
worker's store keeps quotas and figures per salt. Here alice may hold 8 chunks of a
host tier of 32 and writes 40; bob's 6 chunks, stored first and so the coldest, stay.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.store.quota import OTHER, tenant_tag
from tests.connectors.conftest import (
    CHUNK,
    CHUNK_BYTES,
    HOST_BYTES,
    Engine,
    in_process_engine,
    kv_transfer_config,
    prompt,
)

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ALICE_CHUNKS = 8


@pytest.fixture(scope="module")
def salted(tiny_model: str) -> Iterator[Engine]:
    extra = {
        "tenants.quotas.alice.host": str(ALICE_CHUNKS * CHUNK_BYTES),
        "tenants.default_quota.host": str(HOST_BYTES // 2),  # bob's: a salt not named
    }
    with in_process_engine(tiny_model, kv_transfer_config(**extra), max_model_len=4096) as e:
        yield e


def test_a_salt_over_its_quota_evicts_only_its_own_chunks(salted: Engine) -> None:
    engine = salted
    bob = prompt(700, 6 * CHUNK + 5)
    first = engine.generate(bob, cache_salt="bob")
    flood = [prompt(701 + i, ALICE_CHUNKS * CHUNK + 5) for i in range(5)]
    for p in flood:  # 40 chunks: with bob's 6, more than the 32 the tier holds
        engine.generate(p, cache_salt="alice")
    again = engine.generate(bob, cache_salt="bob")
    assert again.num_cached_tokens == 6 * CHUNK
    assert again.tokens == first.tokens
    assert engine.generate(flood[-1], cache_salt="alice").num_cached_tokens == ALICE_CHUNKS * CHUNK

    store = engine.connector.worker.store
    # Rank keys keep the tag of the salt's tenant, and nothing else is in the store.
    held = store.keys()
    assert {bytes(k[:4]) for k in held} == {tenant_tag("alice"), tenant_tag("bob")}
    figures = {f.tenant: f for f in store.tenant_figures()}
    assert list(figures) == ["anonymous", "alice", OTHER]  # bob, not named, folds
    (alice,) = figures["alice"].tiers
    assert (alice.stored_chunks, alice.evicted_chunks) == (40, 40 - ALICE_CHUNKS)
    assert alice.quota_used_bytes == alice.quota_limit_bytes == ALICE_CHUNKS * CHUNK_BYTES
    assert alice.read_chunks == ALICE_CHUNKS
    (other,) = figures[OTHER].tiers
    assert (other.stored_chunks, other.evicted_chunks, other.read_chunks) == (6, 0, 6)
    assert other.quota_used_bytes == 6 * CHUNK_BYTES
