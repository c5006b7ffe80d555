"""``kvtier calc`` end to end: both traces, every model preset, a HF config.json, sweeps,
plots, and clear errors for bad inputs (through the real ``kvtier`` entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.policies.recompute import COMPUTE_PRESETS

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"kv_bytes_per_token", "tiers", "hit_rate", "ttft_p50_s", "ttft_p99_s", "cost_per_month",
          "ssd_wear_pct_per_year", "seed_thresholds"}
runner = CliRunner()
WIDE = {**os.environ, "COLUMNS": "500"}  # one error line, unwrapped


def calc(*args: str) -> None:
    res = runner.invoke(app, ["calc", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("trace", ["mooncake-conversation", "mooncake-synthetic"])
def test_calc_searches_capacities_on_both_traces(tmp_path: Path, trace: str) -> None:
    out = tmp_path / "calc.json"
    calc("--trace", trace, "--limit", "250", "--rounds", "1",
         "--slo", "5", "--json", str(out), "--plots", str(tmp_path / "plots"))
    doc = json.loads(out.read_text())
    assert set(doc) >= FIELDS
    assert doc["kv_bytes_per_token"] == 131072
    assert [t["name"] for t in doc["tiers"]] == ["host", "nvme"]
    assert 0 <= doc["hit_rate"] <= 1 and doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert len(doc["seed_thresholds"]["checks"]) == 2
    assert len(doc["search"]) >= 2
    assert all(Path(p).stat().st_size > 0 for p in doc["plots"])


@pytest.mark.parametrize("model", sorted(COMPUTE_PRESETS))
def test_calc_evaluates_every_model_preset(tmp_path: Path, model: str) -> None:
    out = tmp_path / "calc.json"
    calc("--model", model, "--synthetic-requests", "150", "--capacity", "host=200GB",
         "--capacity", "nvme=2TB", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["kv_bytes_per_token"] == COMPUTE_PRESETS[model].kv_bytes_per_token
    assert doc["tiers"][0]["capacity_bytes"] == 200 * 10**9


def test_calc_takes_a_hf_config_and_a_hardware_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }))
    hw = tmp_path / "hw.toml"
    hw.write_text('name = "box"\n[gpu]\nmfu = 0.4\n[[tiers]]\npreset = "ddr5"\n'
                  '[[tiers]]\npreset = "cxl2"\n[[tiers]]\npreset = "nvme-qlc"\n')
    out = tmp_path / "calc.json"
    calc("--model", str(cfg), "--hardware", str(hw), "--synthetic-requests", "150",
         "--capacity", "host=50GB", "--capacity", "cxl=100GB", "--capacity", "nvme=1TB",
         "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["kv_bytes_per_token"] == 16 * 2 * 8 * 64 * 2
    assert [t["name"] for t in doc["tiers"]] == ["host", "cxl", "nvme"]
    assert doc["seed_thresholds"]["checks"][0]["cxl_bandwidth_gbps"] == 64.0


def test_sweep_covers_the_grid(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    res = runner.invoke(app, ["calc", "--synthetic-requests", "150", "sweep", "--tier",
                              "host=20GB,100GB", "--tier", "nvme=0,1TB", "--json", str(out)],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    points = json.loads(out.read_text())["points"]
    assert len(points) == 4
    assert {p["tiers"][1]["capacity_bytes"] for p in points} == {0, 10**12}


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--hardware", "abacus"], "hardware='abacus'"),
    (["--capacity", "host=lots"], "'lots' is not a size"),
    (["--capacity", "host=10", "--capacity", "nvme=0"], "cannot hold one"),
    (["--capacity", "tape=1TB"], "unknown tier 'tape'"),
    (["--slo", "1", "--budget", "5"], "one objective"),
])
def test_bad_inputs_give_one_clear_error(args: list[str], needle: str) -> None:
    res = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "calc",
                          "--synthetic-requests", "20", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=WIDE)
    assert res.returncode == 2
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def test_malformed_trace_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 9, "input_length": 600}\n')
    res = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "calc", "--trace", str(bad)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=WIDE)
    assert res.returncode == 2
    assert f"{bad}:2: field 'hash_ids' is missing" in res.stderr
