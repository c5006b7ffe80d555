"""A restarted vLLM engine finds the KV the previous one stored (embedded store, nvme tier).

Two engine processes run one after the other on the same configuration (restart_driver.py):
the first (vLLM's default multi-process engine) serves three prompts and exits cleanly;
the second, a new process, serves the same prompts. Its scheduler side learns at start
which keys the worker's nvme tier recovered, so every full chunk is a hit, loaded from
nvme off the engine step, with outputs identical to a recompute. The host tier is large enough that nothing
is demoted while the first engine runs: what the second finds was persisted by the first
one's clean shutdown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.connectors.conftest import CHUNK
from tests.connectors.restart_driver import PROMPT_SEEDS
from tests.procs import engine_env

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FULL = 4 * CHUNK  # full chunks of each 300-token prompt


def _run(
    model: str, nvme: Path, out: Path, mode: str, timeout_s: float = 600, tp: str = "1"
) -> dict:
    env = engine_env(out.parent)
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.connectors.restart_driver",
                model,
                str(nvme),
                str(out),
                mode,
                tp,
            ],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{mode} engine did not finish:\n{log.read_text()[-4000:]}") from None
    assert rc == 0, f"{mode} engine exited {rc}:\n{log.read_text()[-4000:]}"
    assert out.exists(), log.read_text()[-4000:]
    return dict(json.loads(out.read_text()), log=log.read_text())


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("restart")
    nvme = tmp / "nvme"
    t0 = time.monotonic()
    first = _run(tiny_model, nvme, tmp / "first.json", "first")
    second = _run(tiny_model, nvme, tmp / "second.json", "second")
    print(f"two engine processes in {time.monotonic() - t0:.0f} s")
    return first, second


def test_first_engine_computes_and_its_shutdown_persists(runs: tuple[dict, dict]) -> None:
    first, _ = runs
    assert first["cached"] == [0] * len(PROMPT_SEEDS)
    # Its host tier held everything; the clean shutdown moved it into the nvme tier.
    assert f"{len(PROMPT_SEEDS) * 4} chunk(s) moved into nvme before closing" in first["log"]


def test_restarted_engine_hits_with_identical_outputs(runs: tuple[dict, dict]) -> None:
    first, second = runs
    assert second["cached"] == [FULL] * len(PROMPT_SEEDS)
    assert second["tokens"] == first["tokens"]
    assert second["ref_cached"] == [0] * len(PROMPT_SEEDS)  # the salted references missed
    assert second["ref"] == first["tokens"]
    totals = second["totals"]
    assert totals["load_tokens"] == len(PROMPT_SEEDS) * FULL
    assert totals.get("load_failed_blocks", 0) == 0
    # Recovered from nvme, never seen in memory by this engine: each load ran off the
    # engine step (async_loads = "auto"), and none read nvme synchronously.
    assert totals["load_async"] == len(PROMPT_SEEDS)
    assert totals.get("load_sync_slow_chunks", 0) == 0
