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
FIELDS = {
    "kv_bytes_per_token",
    "tiers",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "cost_per_month",
    "ssd_wear_pct_per_year",
    "seed_thresholds",
}
runner = CliRunner()
WIDE = {**os.environ, "COLUMNS": "500"}  # one error line, unwrapped


def calc(*args: str) -> None:
    res = runner.invoke(app, ["calc", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("trace", ["mooncake-conversation", "mooncake-synthetic"])
def test_calc_searches_capacities_on_both_traces(tmp_path: Path, trace: str) -> None:
    pytest.importorskip("matplotlib", reason="--plots needs the plot extra")
    out = tmp_path / "calc.json"
    calc(
        "--trace",
        trace,
        "--limit",
        "250",
        "--rounds",
        "1",
        "--slo",
        "60",
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "plots"),
    )
    doc = json.loads(out.read_text())
    assert set(doc) >= FIELDS
    assert doc["kv_bytes_per_token"] == 131072
    assert [t["name"] for t in doc["tiers"]] == ["host", "nvme"]
    assert 0 <= doc["hit_rate"] <= 1 and doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert len(doc["seed_thresholds"]["checks"]) == 2
    assert len(doc["search"]) >= 2
    assert all(Path(p).stat().st_size > 0 for p in doc["plots"])
    assert doc["objective"]["met"] is True


@pytest.mark.parametrize("model", sorted(COMPUTE_PRESETS))
def test_calc_evaluates_every_model_preset(tmp_path: Path, model: str) -> None:
    out = tmp_path / "calc.json"
    calc(
        "--model",
        model,
        "--synthetic-requests",
        "150",
        "--capacity",
        "host=200GB",
        "--capacity",
        "nvme=2TB",
        "--json",
        str(out),
    )
    doc = json.loads(out.read_text())
    assert doc["kv_bytes_per_token"] == COMPUTE_PRESETS[model].kv_bytes_per_token
    assert doc["tiers"][0]["capacity_bytes"] == 200 * 10**9


def test_calc_takes_a_hf_config_and_a_hardware_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "hidden_size": 2048,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 8192,
                "vocab_size": 128256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    hw = tmp_path / "hw.toml"
    hw.write_text(
        'name = "box"\n[gpu]\nmfu = 0.4\n[[tiers]]\npreset = "ddr5"\n'
        '[[tiers]]\npreset = "cxl2"\n[[tiers]]\npreset = "nvme-qlc"\n'
    )
    out = tmp_path / "calc.json"
    calc(
        "--model",
        str(cfg),
        "--hardware",
        str(hw),
        "--synthetic-requests",
        "150",
        "--capacity",
        "host=50GB",
        "--capacity",
        "cxl=100GB",
        "--capacity",
        "nvme=1TB",
        "--json",
        str(out),
    )
    doc = json.loads(out.read_text())
    assert doc["kv_bytes_per_token"] == 16 * 2 * 8 * 64 * 2
    assert [t["name"] for t in doc["tiers"]] == ["host", "cxl", "nvme"]
    assert doc["seed_thresholds"]["checks"][0]["cxl_bandwidth_gbps"] == 64.0


def test_sweep_covers_the_grid(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    res = runner.invoke(
        app,
        [
            "calc",
            "--synthetic-requests",
            "150",
            "sweep",
            "--tier",
            "host=20GB,100GB",
            "--tier",
            "nvme=0,1TB",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    points = json.loads(out.read_text())["points"]
    assert len(points) == 4
    assert {p["tiers"][1]["capacity_bytes"] for p in points} == {0, 10**12}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--hardware", "abacus"], "hardware='abacus'"),
        (["--capacity", "host=lots"], "'lots' is not a size"),
        (["--capacity", "host=10", "--capacity", "nvme=0"], "cannot hold one"),
        (["--capacity", "tape=1TB"], "unknown tier 'tape'"),
        (["--slo", "1", "--budget", "5"], "one objective"),
    ],
)
def test_bad_inputs_give_one_clear_error(args: list[str], needle: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "calc", "--synthetic-requests", "20", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=WIDE,
    )
    assert res.returncode == 2
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def test_malformed_trace_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
        '{"timestamp": 9, "input_length": 600}\n'
    )
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "calc", "--trace", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=WIDE,
    )
    assert res.returncode == 2
    assert f"{bad}:2: field 'hash_ids' is missing" in res.stderr


@pytest.mark.parametrize(
    ("slo", "status", "said"), [("1000", 0, "objective met"), ("0.001", 1, "objective NOT met")]
)
def test_an_slo_is_met_or_the_exit_status_says_not(
    tmp_path: Path, slo: str, status: int, said: str
) -> None:
    pytest.importorskip("matplotlib", reason="--plots needs the plot extra")
    work = tmp_path / "cwd"
    work.mkdir()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli.main",
            "calc",
            "--trace",
            "mooncake-synthetic",
            "--limit",
            "150",
            "--rounds",
            "1",
            "--slo",
            slo,
            "--json",
            str(tmp_path / "out" / "plan.json"),
            "--plots",
            str(tmp_path / "out" / "plots"),
        ],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=600,
        env=WIDE,
    )
    assert res.returncode == status, res.stdout + res.stderr
    assert said in res.stdout
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["objective"]["met"] is (status == 0)
    assert sorted(p.name for p in (tmp_path / "out" / "plots").iterdir()) == [
        "cost_latency_frontier.png",
        "hit_rate_vs_capacity.png",
    ]
    assert list(work.iterdir()) == []  # outputs only where --json and --plots say


def test_frontier_plot_marks_the_slo_and_the_frontier_on_both_panels() -> None:
    pytest.importorskip("matplotlib")
    from kvtier.policies.calc import evaluate
    from kvtier.policies.plots import frontier_figure
    from kvtier.policies.profiles import load_hardware
    from kvtier.policies.recompute import model_compute
    from kvtier.policies.trace import load_trace

    m, hw = model_compute("llama-3-8b"), load_hardware("h200-dram-nvme")
    tr = load_trace("mooncake-synthetic", limit=100)
    caps = [(20 * 10**9, 0), (100 * 10**9, 0), (100 * 10**9, 10**12)]
    points = [(c, evaluate(m, hw, tr, c, "kvtier")) for c in caps]
    fig = frontier_figure(points, caps[1], slo_s=7.0)
    try:
        assert len(fig.axes) == 2
        for ax in fig.axes:
            labels = {ln.get_label(): ln for ln in ax.get_lines()}
            assert "TTFT p99 SLO 7 s" in labels and list(
                labels["TTFT p99 SLO 7 s"].get_ydata()
            ) == [7.0, 7.0]
            assert "frontier" in labels and len(labels["frontier"].get_xdata()) >= 1
            assert labels["frontier"].get_marker() == "o"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
