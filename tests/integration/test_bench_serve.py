"""``kvtier bench serve``: the trace's conversations become prompts, and real servers replay them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.serve import Request, _args, load_requests, reusable_tokens, reuse_figures


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
