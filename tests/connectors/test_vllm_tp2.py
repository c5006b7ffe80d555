"""Tensor parallelism 2 on vLLM's CPU build: each rank keeps its own store, and a restart
finds both ranks' chunks (restart_driver.py with TP=2).

Two engine processes of two workers each, one after the other, on the same configuration:
the first computes three prompts and exits; the second, a new process, hits every full
chunk from the two ranks' nvme tiers (``<dir>/tp0-pp0`` and ``<dir>/tp1-pp0``), with
outputs identical to the first. A logical key is loadable only when both ranks hold their
rank key of it (tests/connectors/test_vllm_mirror.py covers that rule without engines).

Each TP=2 engine starts in 1-2 minutes on two shared cores, which the suite's 15-minute
budget does not hold: this runs only with ``KVTIER_TEST_TP=1`` (skipped otherwise, with
that reason).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.connectors.conftest import CHUNK
from tests.connectors.restart_driver import PROMPT_SEEDS
from tests.connectors.test_vllm_restart import _run

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KVTIER_TEST_TP") != "1",
        reason="two TP=2 engine starts (2-4 minutes): set KVTIER_TEST_TP=1 to run",
    ),
]


def test_tp2_ranks_store_apart_and_a_restart_hits(tiny_model: str, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    first = _run(tiny_model, nvme, tmp_path / "first.json", "first", tp="2")
    second = _run(tiny_model, nvme, tmp_path / "second.json", "second", tp="2")
    assert sorted(p.name for p in nvme.iterdir()) == ["tp0-pp0", "tp1-pp0"]
    assert first["cached"] == [0] * len(PROMPT_SEEDS)
    assert second["cached"] == [4 * CHUNK] * len(PROMPT_SEEDS)
    assert second["tokens"] == first["tokens"]
    assert second["ref_cached"] == [0] * len(PROMPT_SEEDS)
    assert second["ref"] == first["tokens"]


def test_tp2_mla_latent_is_stored_once(tmp_path: Path) -> None:
    """An MLA model at TP 2: TP rank 0 stores the latent, rank 1 builds no store, and
    requests still finish on both (rank 1 reports its saves done without storing).

    On the CPU build the connector never loads MLA KV (its MLA backend computes no
    prefill over cached context), so this holds the store-once side; the loads, a
    broadcast from rank 0 with embedded stores, need CUDA.
    """
    from tests.connectors.families import write_model
    from tests.connectors.test_vllm_families import _run as run_family

    model = write_model("deepseek_v2", tmp_path / "model")
    nvme = tmp_path / "nvme"
    first = run_family(model, nvme, tmp_path / "first.json", "first", tp=2)
    second = run_family(model, nvme, tmp_path / "second.json", "second", tp=2)
    assert [p.name for p in nvme.iterdir()] == ["tp0-pp0"]  # one copy, rank 0's
    assert any((nvme / "tp0-pp0").iterdir())
    assert first["cached"] == second["cached"] == [0] * 4
    assert second["tokens"] == first["tokens"]
    assert first["tokens"][:2] == first["tokens"][2:]
