"""The model families people serve, each a tiny random model of its real architecture
(families.py) on a real vLLM CPU engine: hits with greedy outputs identical to a
recompute, and hits after a restart (a new engine process, chunks loaded from nvme).

* DeepSeek-V2 (MLA): one latent of 576 elements per token and layer, stored once. vLLM's
  CPU MLA backend computes no prefill over cached context (vLLM turns chunked prefill
  and its own prefix caching off for it), so on CPU the connector stores and never
  loads (a load would be followed by a prefill that ignores it: a hit's greedy output
  differed from a recompute's); the hits run where CUDA is.
* Gemma 3 (sliding window + full attention): vLLM's hybrid KV-cache manager stays on
  with the connector (it declares ``SupportsHMA``), so the model has several KV-cache
  groups; a hit loads every block of the full-attention group and only the window
  before the boundary of the sliding ones.
* gpt-oss (alternating sliding window and full attention, attention sinks, experts): as
  Gemma 3, with a window (32 tokens) shorter than a chunk, so its sliding group stores
  and loads only the last block of a chunk.

Two engine processes per family, one after the other (family_driver.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.connectors.conftest import CHUNK
from tests.connectors.family_driver import PROMPT_SEEDS
from tests.procs import engine_env

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FULL = 4 * CHUNK  # full chunks of each 300-token prompt
N = len(PROMPT_SEEDS)


def _run(model: Path, nvme: Path, out: Path, mode: str, tp: int = 1) -> dict:
    log = out.with_suffix(".log")
    args = [str(model), str(nvme), str(out), mode, str(tp)]
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.connectors.family_driver", *args],
            cwd=ROOT,
            env=engine_env(out.parent),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        rc = proc.wait(timeout=420 * tp)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{mode} engine did not finish:\n{log.read_text()[-4000:]}") from None
    assert rc == 0, f"{mode} engine exited {rc}:\n{log.read_text()[-4000:]}"
    return dict(json.loads(out.read_text()), log=log.read_text())


def _runs(family: str, tmp: Path) -> tuple[dict, dict]:
    from tests.connectors.families import write_model

    model = write_model(family, tmp / "model")
    first = _run(model, tmp / "nvme", tmp / "first.json", "first")
    second = _run(model, tmp / "nvme", tmp / "second.json", "second")
    return first, second


def _hits_and_restart(first: dict, second: dict) -> None:
    assert first["cached"] == [0] * N
    assert first["again_cached"] == [FULL] * N  # the same engine hits what it stored
    assert first["again"] == first["tokens"]
    assert second["cached"] == [FULL] * N  # a new process hits what the first persisted
    assert second["tokens"] == first["tokens"]
    assert second["ref_cached"] == [0] * N  # salted: a miss, the recompute reference
    assert second["ref"] == first["tokens"]
    assert second["totals"]["load_tokens"] == N * FULL
    assert second["totals"].get("load_failed_blocks", 0) == 0
    # The prompts' outputs differ: the weights make the output depend on the KV.
    assert len({tuple(t) for t in first["tokens"]}) == N
    # A load that failed (the store lost the chunks) is recomputed, same output.
    assert second["lost_totals"]["load_failed_blocks"] > 0
    assert second["lost"] == first["tokens"][0]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return _runs("deepseek_v2", tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return _runs("gpt_oss", tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return _runs("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="vLLM's CPU MLA backend computes no prefill over cached context: MLA hits need CUDA",
)
def test_mla_hits_and_restarts_with_identical_outputs(deepseek: tuple[dict, dict]) -> None:
    first, second = deepseek
    _hits_and_restart(first, second)
    assert second["mla"] and second["groups"] == [[False, CHUNK // second["block_size"], 0]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU MLA backend's refusal")
def test_mla_on_cpu_stores_and_never_loads(deepseek: tuple[dict, dict]) -> None:
    first, second = deepseek
    assert first["again_cached"] == [0] * N and first["again"] == first["tokens"]
    assert second["cached"] == [0] * N and second["tokens"] == first["tokens"]
    assert second["totals"].get("load_chunks", 0) == 0
    assert second["stored"] == N * 4  # the restart recovered every chunk, one copy each
    assert "computes no prefill over cached context" in second["log"]


def test_mla_stores_one_latent_per_token(deepseek: tuple[dict, dict]) -> None:
    first, _ = deepseek
    totals = first["totals"]
    # 2 layers x 576 elements x 2 bytes per token: one latent, no separate K and V.
    assert first["layers"] == [2]
    assert first["page_bytes"] == [first["block_size"] * 576 * 2]
    assert totals["save_chunks"] == N * 4
    assert totals["save_bytes"] == N * 4 * CHUNK * 2 * 576 * 2


def _loaded_blocks_per_hit(run: dict) -> int:
    """Blocks (of one layer) a hit of 4 chunks loads: every stored block of every chunk in
    full-attention groups, the stored blocks of the last chunk in sliding ones."""
    groups = zip(run["groups"], run["layers"], strict=True)
    return sum((1 if sliding else 4) * tail * n for (sliding, tail, _), n in groups)


PAGE = 32 * 2 * 2 * 64 * 2  # one block of one layer: tokens x K,V x heads x head x bf16


@pytest.mark.parametrize("family", ["gemma", "gpt_oss"])
def test_hybrid_groups_hit_and_restart_with_identical_outputs(
    family: str, request: pytest.FixtureRequest
) -> None:
    first, second = request.getfixturevalue(family)
    _hits_and_restart(first, second)
    sliding = [g for g in second["groups"] if g[0]]
    full = [g for g in second["groups"] if not g[0]]
    assert sliding and full  # vLLM's hybrid KV-cache manager stayed on


@pytest.mark.parametrize(
    ("family", "layers", "blocks"),
    [
        # Gemma 3: window 47 tokens, both blocks of the last chunk in each sliding layer.
        ("gemma", 3, 4 * 2 + 2 * 2),
        # gpt-oss: window 31 tokens, the last block of the last chunk in the sliding layer.
        ("gpt_oss", 2, 4 * 2 + 1),
    ],
)
def test_hybrid_hit_loads_the_sliding_window_only(
    family: str, layers: int, blocks: int, request: pytest.FixtureRequest
) -> None:
    _, second = request.getfixturevalue(family)
    assert set(second["page_bytes"]) == {PAGE}
    assert sum(second["layers"]) == layers
    assert _loaded_blocks_per_hit(second) == blocks < 4 * 2 * layers  # less than every block
    assert second["totals"]["load_bytes"] == N * blocks * PAGE
