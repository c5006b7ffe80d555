"""Preemption with saves in flight: a request whose blocks are taken away mid-decode.

Runs its own engine in a subprocess (a KV cache of 22 blocks) so that the shared
engine of the other tests keeps its size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.connectors.conftest import CHUNK

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_preempted_request_finishes_with_identical_output(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.connectors.preempt_driver", tiny_model, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())

    assert r["preemptions"] >= 1  # the scenario really happened
    assert r["batch"] == r["single"]  # preempted and resumed, same greedy tokens
    assert r["again"] == r["single"]
    assert r["again_cached"] == [3 * CHUNK] * 4  # what the batch saved (before and after
    # preemption) is all there, keyed by the request's tokens and salt
    # The preempted request, when resumed, loaded its saved chunks back from kvtier.
    assert r["loads_after_batch"] > 0
