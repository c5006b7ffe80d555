"""The kvtier connector on a real vLLM CPU engine: hits, prefixes, salts, failed loads.

Every scenario compares greedy output token ids of a kvtier hit with a recompute of the
same prompt on the same engine (bit-identical within one engine), and checks from the
connector's counters that the bytes really came from kvtier.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.connectors.conftest import BLOCK, CHUNK, HOST_BYTES, Engine, prompt

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_second_identical_prompt_hits_and_matches(engine: Engine) -> None:
    p = prompt(1, 300)  # 4 full chunks of 64 tokens + a tail
    before = engine.totals()
    first = engine.generate(p)
    second = engine.generate(p)
    after = engine.totals()

    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 4 * CHUNK
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) == 4 * CHUNK
    assert after.get("save_chunks", 0) - before.get("save_chunks", 0) >= 4
    assert second.tokens == first.tokens
    # A host-tier hit loads before the step's forward, never off it (async_loads = "auto").
    assert after.get("load_async", 0) == before.get("load_async", 0)


def test_prompt_ending_at_a_chunk_boundary_loads_all_but_its_last_block(engine: Engine) -> None:
    """vLLM computes the last token; the stored last chunk gives every block before it.

    A prefix of a chunk's KV is the KV of those tokens: its leading blocks load, and only
    the block holding the last token is computed (as vLLM's own offloading does).
    """
    p = prompt(8, 5 * CHUNK)
    first = engine.generate(p)
    before = engine.totals()
    second = engine.generate(p)
    after = engine.totals()
    reference = engine.generate(p, cache_salt="boundary-reference")

    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 5 * CHUNK - BLOCK
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) == 5 * CHUNK - BLOCK
    assert after.get("load_chunks", 0) - before.get("load_chunks", 0) == 5
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)
    assert reference.num_cached_tokens == 0
    assert second.tokens == first.tokens == reference.tokens


def test_shared_prefix_loads_only_the_prefix(engine: Engine) -> None:
    system = prompt(2, 4 * CHUNK + 10)  # 4 shared full chunks, then the suffixes differ
    a = system + prompt(3, 150)
    b = system + prompt(4, 150)
    engine.generate(a)
    before = engine.totals()
    hit = engine.generate(b)
    loaded = engine.totals().get("load_tokens", 0) - before.get("load_tokens", 0)
    # Same tokens, salted: a miss on the same engine, i.e. the recompute reference.
    recompute = engine.generate(b, cache_salt="reference")

    assert hit.num_cached_tokens == 4 * CHUNK
    assert loaded == 4 * CHUNK
    assert recompute.num_cached_tokens == 0
    assert hit.tokens == recompute.tokens


def test_cache_salt_separates_tenants(engine: Engine) -> None:
    p = prompt(5, 260)
    plain = engine.generate(p)
    salted = engine.generate(p, cache_salt="tenant-a")
    salted_again = engine.generate(p, cache_salt="tenant-a")
    other = engine.generate(p, cache_salt="tenant-b")

    assert plain.num_cached_tokens == 0
    assert salted.num_cached_tokens == 0  # no cross-salt hit on plain's chunks
    assert salted_again.num_cached_tokens == 4 * CHUNK  # the salt's own chunks do hit
    assert other.num_cached_tokens == 0
    assert plain.tokens == salted.tokens == salted_again.tokens == other.tokens


def test_failed_load_is_recomputed(engine: Engine) -> None:
    """A chunk that left the store after the scheduler last heard of it: vLLM recomputes.

    The scheduler's mirror follows the store's index events one step behind. Deleting
    chunks from the worker's store between two requests (as an eviction racing a lookup
    would) makes the next lookup promise chunks the worker no longer has: a real failed
    load, no mock; a false positive of the mirror's filter takes the same path.
    """
    victim = prompt(6, 10 * CHUNK)
    first = engine.generate(victim)
    store = engine.connector.worker.store
    assert store.delete(store.keys()) >= 10  # every chunk, this scenario's among them
    before = engine.totals()
    again = engine.generate(victim)
    after = engine.totals()
    failed = after.get("load_failed_blocks", 0) - before.get("load_failed_blocks", 0)

    assert failed > 0  # promised, not served: recomputed
    assert again.tokens == first.tokens
    # The failure taught the scheduler: the chunks are stored again, and the next run hits.
    third = engine.generate(victim)
    assert third.tokens == first.tokens
    assert third.num_cached_tokens == 10 * CHUNK - BLOCK  # the last chunk but its last block
    assert engine.totals().get("load_failed_blocks", 0) == after.get("load_failed_blocks", 0)


def test_a_failed_partial_last_chunk_is_recomputed(engine: Engine) -> None:
    """The last chunk of a prompt ending at a chunk boundary fails to load: recomputed.

    A prompt that stops inside the tenth chunk stores the first nine; the full prompt
    then stores the tenth alone, which is deleted before the scheduler hears of it. The
    next run loads the nine and fails the one block it wanted of the tenth: vLLM
    recomputes from there, with the output of the first run.
    """
    victim = prompt(9, 10 * CHUNK)
    store = engine.connector.worker.store
    start = set(store.keys())
    engine.generate(victim[: 9 * CHUNK + 10])
    nine = _stored(store, start, 9)
    first = engine.generate(victim)
    tenth = _stored(store, start | nine, 1)
    assert len(nine) == 9 and len(tenth) == 1
    assert store.delete(list(tenth)) == 1
    before = engine.totals()
    again = engine.generate(victim)
    after = engine.totals()
    third = engine.generate(victim)
    final = engine.totals()
    ref = engine.generate(victim, cache_salt="partial-failure-reference")

    # The tenth chunk was to give one block (vLLM computes the other): that one failed.
    assert _delta("load_failed_blocks", before, after) == CHUNK // BLOCK - 1
    assert _delta("load_chunks", before, after) == 9
    assert _delta("load_tokens", before, after) == 9 * CHUNK
    # It was stored again: the next run loads all but the last block, and nothing fails.
    assert third.num_cached_tokens == 10 * CHUNK - BLOCK
    assert _delta("load_tokens", after, final) == 10 * CHUNK - BLOCK
    assert _delta("load_failed_blocks", after, final) == 0
    assert ref.num_cached_tokens == 0
    assert again.tokens == third.tokens == first.tokens == ref.tokens


def _delta(name: str, before: dict[str, float], after: dict[str, float]) -> float:
    return after.get(name, 0) - before.get(name, 0)


def _stored(store: Any, held: set[Any], n: int) -> set[Any]:
    """Keys the store holds beyond ``held``, once ``n`` of them landed (bounded wait)."""
    deadline = time.monotonic() + 10.0
    while len(new := set(store.keys()) - held) < n and time.monotonic() < deadline:
        time.sleep(0.05)  # the save thread puts after the step that computed the chunks
    return new


def test_churn_never_promises_a_chunk_the_store_dropped(engine: Engine) -> None:
    """A store smaller than the working set: every drop leaves the mirror with its keys.

    Three prompts of 12 chunks share the 32-chunk host tier with their own recomputed
    references (salted): LRU drops chunks on almost every request. The scheduler's mirror
    learns each drop from the store's events, so it never promises a dropped chunk: no
    failed load, and every output equals its recompute.
    """
    prompts = [prompt(200 + i, 12 * CHUNK + 5) for i in range(3)]
    store = engine.connector.worker.store
    dropped = store.stats().dropped_chunks
    ref = [engine.generate(p, cache_salt=f"churn-ref-{i}").tokens for i, p in enumerate(prompts)]
    before = engine.totals()
    order = [0, 1, 0, 2, 0, 1, 2, 1, 0, 2, 2, 0]
    runs = [engine.generate(prompts[i]) for i in order]
    after = engine.totals()

    assert store.stats().dropped_chunks - dropped >= 3 * 12  # real churn
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)
    assert [r.tokens for r in runs] == [ref[i] for i in order]
    hits = [r.num_cached_tokens for r in runs]
    assert sum(hits) >= 3 * 12 * CHUNK  # the reuse that fits did hit
    assert after.get("load_tokens", 0) - before.get("load_tokens", 0) == sum(hits)


def test_store_stats_show_the_host_tier(engine: Engine) -> None:
    p = prompt(7, 200)
    engine.generate(p)
    engine.generate(p)
    stats = engine.connector.worker.store.stats()
    assert stats.get_chunks > 0
    assert stats.tiers[0].kind == "host"
    assert 0 < stats.tiers[0].used_bytes <= HOST_BYTES
