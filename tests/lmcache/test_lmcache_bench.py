"""``kvtier bench lmcache`` itself, on a small prompt, through real LMCache engines.

What the benchmark reports must hold on a run small enough for the suite: every retrieve
checked, kvtier's file rows hit after a restart, the steady-state store rounds all
complete with their ratios, rows compared by what they keep across a restart, and its
scratch folder gone afterwards (it held gigabytes per run
before it was removed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")


def test_the_benchmark_reports_steady_stores_and_leaves_no_scratch(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "lmcache.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["TMPDIR"] = str(scratch)
    cmd = [sys.executable, "-m", "kvtier.bench.lmcache", "--chunks", "1", "--repeat", "1"]
    cmd += ["--store-rounds", "2", "--only", "kvtier-embedded", "--only", "lmcache-localdisk"]
    cmd += ["--only", "kvtier-embedded-host"]
    run = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["verified"] is True
    assert doc["store_rounds"] == 2
    rows = {r["backend"]: r for r in doc["rows"]}
    assert set(rows) == {"kvtier-embedded", "kvtier-embedded-host", "lmcache-localdisk"}
    for r in rows.values():
        assert r["complete"] and r["bytes_equal"]
        assert len(r["store_rounds_s"]) == 2 and r["store_rounds_complete"]
        assert r["store_steady_GBps"] > 0
    assert rows["kvtier-embedded"]["hit_rate_after_restart"] == 1.0
    assert rows["kvtier-embedded-host"]["hit_rate_after_restart"] == 0.0  # memory
    assert rows["lmcache-localdisk"]["hit_rate_after_restart"] == 0.0  # forgets its files
    # By restart behaviour, LocalDiskBackend is the memory row's peer; the file row,
    # which keeps its chunks, has no LMCache peer in this run.
    by_restart = doc["ratios_by_restart"]
    assert set(by_restart) == {
        "kvtier-embedded-host_retrieve_vs_lmcache-localdisk (lost at restart)"
    }
    ratio = doc["store_ratios"]["kvtier-embedded_store_vs_lmcache-localdisk"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert "store, steady" in run.stdout
    assert list(scratch.glob("kvtier-bench-lmcache-*")) == []
