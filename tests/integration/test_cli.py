"""The CLI end to end, as a newcomer runs it: real processes, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVTIER, *args], capture_output=True, text=True, timeout=600, cwd=cwd, check=False
    )


def test_demo_replays_the_trace_and_verifies_every_byte(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.toml"
    cfg.write_text(f"""
[model]
name = "qwen2-7b"

[store]
placement = "keep"

[[tiers]]
kind = "host"
capacity_bytes = "128MiB"
pin = "off"

[[tiers]]
kind = "nvme"
capacity_bytes = "256MiB"
dir = "{tmp_path / "nvme"}"
create_dirs = true
""")
    out = run("demo", "--config", str(cfg), "--sequences", "4", cwd=Path.cwd())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified byte for byte" in out.stdout
    assert "nvme" in out.stdout and "hit rates" in out.stdout
    # A second run recovers the nvme tier's chunks and verifies them too.
    again = run("demo", "--config", str(cfg), "--sequences", "4", cwd=Path.cwd())
    assert again.returncode == 0, again.stdout + again.stderr
    assert "verified byte for byte" in again.stdout


def test_bad_config_is_one_clear_line_not_a_traceback() -> None:
    out = run("demo", "--set", "store.chunk_tokens=many")
    assert out.returncode == 2
    assert "store.chunk_tokens='many'" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr + out.stdout


def test_info_writes_a_machine_report(tmp_path: Path) -> None:
    out = run("info", "--json", str(tmp_path / "info.json"))
    assert out.returncode == 0, out.stderr
    rep = json.loads((tmp_path / "info.json").read_text())
    assert {"cuda", "numa_nodes", "cxl_candidates", "kvikio", "disk"} <= rep.keys()


def test_fragmentation_bench_writes_rows(tmp_path: Path) -> None:
    out = run("bench", "fragmentation", "--churn-ops", "300", "--json", str(tmp_path / "f.json"))
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "f.json").read_text())
    row = doc["rows"][0]
    assert {
        "scheme",
        "context_tokens",
        "internal_frag",
        "entries_per_seq",
        "transfers_per_seq",
    } <= row.keys()
    assert doc["targets"]["adaptive_internal_frag_le_1pct_at_ge_32k"] is True


def test_unknown_bench_lists_the_available_ones() -> None:
    out = run("bench", "nosuch")
    assert out.returncode == 2
    assert "fragmentation" in out.stdout + out.stderr
