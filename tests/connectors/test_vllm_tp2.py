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
