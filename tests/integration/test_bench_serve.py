"""``kvtier bench serve``: the trace's conversations become prompts, and real servers replay them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench._serve_model import write_model
from kvtier.bench.serve import (
    Request,
    _args,
    _server_args,
    distinct_blocks,
    load_requests,
    reusable_tokens,
    reuse_figures,
)


def test_whole_conversations_become_prompts_that_extend_their_earlier_turns() -> None:
    reqs = load_requests(_args(["--conversations", "5", "--block-tokens", "32"]), 1024)
    assert len(reqs) > 5  # every turn of five multi-turn conversations
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    assert reqs[0].at_s == 0 and reqs[-1].at_s == pytest.approx(120.0)
    # A later turn starts with an earlier turn's blocks (beyond the shared first block).
    extends = sum(
        any(len(e.tokens) > 64 and r.tokens[:64] == e.tokens[:64] for e in reqs[:i])
        for i, r in enumerate(reqs)
    )
    assert extends >= len(reqs) - 5
    assert all(32 <= len(r.tokens) <= 4096 for r in reqs)


def test_no_reuse_leaves_no_two_prompts_a_shared_block() -> None:
    a = _args(["--conversations", "0", "--requests", "40", "--no-reuse", "--block-tokens", "32"])
    firsts = [r.tokens[:32] for r in load_requests(a, 1024)]
    assert len(set(firsts)) == len(firsts)


def test_reusable_tokens_count_whole_blocks_an_earlier_prompt_started_with() -> None:
    a, b, c = (1,) * 32, (2,) * 32, (3,) * 32
    reqs = [Request(0.0, a + b), Request(1.0, a + b + c), Request(2.0, a + c), Request(3.0, b)]
    assert reusable_tokens(reqs) == [0, 64, 32, 0]
    # Prefixes a, ab, abc, ac, b: the same block after another prefix is another block.
    assert distinct_blocks(reqs, 32) == 5
    figs = reuse_figures([9.0, 1.0, 2.0, 8.0], reusable_tokens(reqs), least=64)
    assert figs["reuse_requests"] == 1 and figs["ttft_reuse_p99_s"] == 1.0
    assert reuse_figures([9.0], [0], least=64) == {"reuse_requests": 0}
    # The conversation slice: later turns reuse their first turns; salted prompts, nothing.
    conv = load_requests(_args(["--conversations", "5", "--block-tokens", "32"]), 1024)
    reuse = reusable_tokens(conv)
    assert reuse[0] == 0 and all(n >= 32 for n in reuse[1:])  # the shared system prompt
    assert sum(n >= 256 for n in reuse) >= 3
    salted = _args(["--conversations", "0", "--requests", "40", "--no-reuse"])
    assert not any(reusable_tokens(load_requests(salted, 1024)))


def test_on_cuda_the_working_set_of_llama3_8b_outgrows_vllms_pool(tmp_path: Path) -> None:
    a = _args(["--device", "cuda", "--rows", "noop,kvtier,native"])
    model = write_model(a, tmp_path / "model")
    assert model.load_format == "dummy" and model.sharpen
    assert model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16
    reqs = load_requests(a, model.vocab)
    b = a.vllm_block
    assert distinct_blocks(reqs, b) * b > 2 * a.vllm_kv_tokens
    assert max(len(r.tokens) for r in reqs) <= a.max_prompt_tokens
    for row in a.rows:
        args = " ".join(_server_args(a, row, model, ""))
        assert "--load-format dummy" in args and f"--block-size {b}" in args
        assert "--worker-extension-cls kvtier.bench._serve_model.SharpenExtension" in args
        assert f"--num-gpu-blocks-override {a.vllm_kv_tokens // b}" in args
    assert "--kv-offloading-size" in " ".join(_server_args(a, "native", model, ""))
    # An option given wins over the device's default; the CPU's stay as they were.
    assert _args(["--device", "cuda", "--duration-s", "50"]).duration_s == 50
    assert _args([]).duration_s == 120 and _args([]).model == "tiny"
    with pytest.raises(SystemExit):
        _args(["--model", "llama3-8b", "--weights", "random"])


@pytest.mark.timeout(900)
def test_dummy_weights_are_redrawn_in_each_server_and_outputs_agree(tmp_path: Path) -> None:
    # The GPU's path (vLLM's dummy weights, redrawn through /collective_rpc) on the CPU.
    pytest.importorskip("vllm")
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "-m", "kvtier.bench.serve", "--device", "cpu", "--weights", "dummy",
        "--conversations", "2", "--duration-s", "10", "--rows", "noop,kvtier",
        "--max-prompt-tokens", "512", "--dtype", "float32", "--host-bytes", "64MiB",
        "--budget-s", "800", "--log-dir", str(tmp_path / "logs"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"noop", "kvtier"}
    for r in rows.values():
        assert "errors" not in r, r.get("errors")
        run = r["runs"][0]
        assert run["sharpened_tensors"] > 0
        assert len(set(run["tokens"])) > 1  # sharp logits: prompts get different tokens
    n = len(rows["noop"]["runs"][0]["tokens"])
    assert rows["kvtier"]["outputs_reference"] == "noop"
    assert rows["kvtier"]["outputs_identical"] == f"{n}/{n}"
    assert (tmp_path / "logs" / "kvtier.log").stat().st_size > 0


@pytest.mark.timeout(900)
def test_a_replay_through_real_servers_reports_each_row(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "-m", "kvtier.bench.serve", "--conversations", "2", "--duration-s", "10",
        "--rows", "none,kvtier", "--max-prompt-tokens", "512", "--dtype", "float32",
        "--host-bytes", "64MiB", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "kvtier"}
    for r in rows.values():
        assert "errors" not in r, r.get("errors")
        assert r["ttft_p50_s"] > 0 and r["prompt_tokens_per_s"] > 0
        assert r["vllm_hit_rate"] > 0  # later turns reuse their conversation's prefix
        assert all(min(run["load_avg_1m"]) >= 0 for run in r["runs"])
        assert r["runs"][0]["reuse_requests"] > 0  # the second turns
    n = len(rows["none"]["runs"][0]["tokens"])
    assert rows["kvtier"]["outputs_identical"] == f"{n}/{n}"
    assert rows["kvtier"]["baseline"] == "none"
