"""The worker's answers to vLLM's ``get_finished`` for a request finished mid-load.

vLLM frees the blocks of a request finished while its asynchronous load runs when it
hears the load end (``finished_recving``), and forgets the request; a save reported for
it as well (``finished_sending``) would name a request it no longer knows, an assertion
that stops the engine core. The scenario: a request saves chunks, is preempted, reloads
them asynchronously, and is aborted before the load ends. The worker is the real one, on
CPU tensors, with a real host-tier store, driven through its public methods in the order
vLLM calls them (the connector's ``get_finished``: ``take_recving``, then
``get_finished`` with what it answered).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from kvtier.config import load_config  # noqa: E402
from kvtier.connectors.vllm.metadata import KVTierMetadata, LoadOp, SaveOp  # noqa: E402
from kvtier.connectors.vllm.settings import ChunkShape  # noqa: E402
from kvtier.connectors.vllm.worker import WorkerSide  # noqa: E402
from kvtier.spec import KVSpec  # noqa: E402
from kvtier.transfer import Layout, make_paged_cache  # noqa: E402

LAYERS, HEADS, HEAD, BLOCK, CHUNK = 2, 2, 32, 32, 64
BPC = CHUNK // BLOCK


def _worker() -> WorkerSide:
    cfg = load_config(None, env={}, overrides=["tiers.0.capacity_bytes=4MiB"])
    w = WorkerSide(cfg, KVSpec(LAYERS, HEADS, HEAD), 0, ChunkShape.of(CHUNK, BLOCK))
    layers = make_paged_cache(
        Layout.LBHNC, num_layers=LAYERS, num_blocks=16, block_size=BLOCK,
        num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    w.register_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)})
    return w


def _step(w: WorkerSide, finished: set[str]) -> tuple[set[str], set[str]]:
    """One engine step's answers: (finished_sending, finished_recving)."""
    recving, _ = w.take_recving()
    return set(w.get_finished(finished, recving) or ()), recving


def _save(w: WorkerSide, rid: str, keys: tuple[bytes, ...], blocks: tuple[int, ...]) -> None:
    w.wait_for_save(KVTierMetadata(saves=[SaveOp(rid, keys, blocks)]))


def test_a_request_aborted_while_it_reloads_is_answered_once_by_its_load() -> None:
    w = _worker()
    try:
        keys = (b"a" * 16, b"b" * 16)
        _save(w, "r", keys, (0, 1, 2, 3))
        w.handle_preemptions(KVTierMetadata(preempted=frozenset({"r"})))  # saves done
        load = LoadOp("r", keys, (4, 5, 6, 7), 0, asynchronous=True)
        w.start_load_kv(KVTierMetadata(loads=[load]))
        # Aborted before vLLM hears the load end: no save is answered, now or later.
        sending, recving = _step(w, {"r"})
        seen_recv = set(recving)
        deadline = time.monotonic() + 30
        while "r" not in seen_recv and time.monotonic() < deadline:
            time.sleep(0.01)
            more_sending, recving = _step(w, set())
            sending |= more_sending
            seen_recv |= recving
        assert "r" in seen_recv  # vLLM frees the blocks on this
        assert "r" not in sending

        # A request finished with no load running: its save is answered, as ever.
        _save(w, "q", (b"c" * 16,), (8, 9))
        sending, _ = _step(w, {"q"})
        deadline = time.monotonic() + 30
        while "q" not in sending and time.monotonic() < deadline:
            time.sleep(0.01)
            sending |= _step(w, set())[0]
        assert "q" in sending
    finally:
        w.shutdown()
