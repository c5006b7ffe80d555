"""Every benchmark is a program: ``kvtier bench NAME`` and ``python -m kvtier.bench.NAME``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import HELPERS, available

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("name", available())
def test_each_benchmark_runs_as_a_module_and_through_the_cli(name: str) -> None:
    # --help parses the benchmark's own arguments: a module that does nothing when run
    # with -m (no __main__ block) prints no usage and fails here.
    as_module = run(sys.executable, "-m", f"kvtier.bench.{name}", "--help")
    assert as_module.returncode == 0, as_module.stderr[-2000:]
    assert "usage:" in as_module.stdout
    through_cli = run(*KVTIER, "bench", name, "--help")
    assert through_cli.returncode == 0, through_cli.stderr[-2000:]
    assert "usage:" in through_cli.stdout


@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_helpers_are_not_offered_as_benchmarks(helper: str) -> None:
    out = run(*KVTIER, "bench", helper)
    assert out.returncode == 2 and "no benchmark" in out.stdout + out.stderr


def test_the_nvme_benchmark_skips_a_missing_engine_with_a_reason(tmp_path: Path) -> None:
    from kvtier.tiers.nvme.engine import kvikio_importable, libcuda_loads

    if kvikio_importable() and libcuda_loads():
        pytest.skip("kvikio runs here: nothing to skip")
    out = run(*KVTIER, "bench", "nvme", "--dir", str(tmp_path), "--sizes", "4", "--repeat", "1",
              "--skip-recovery", "--engines", "posix,kvikio", "--json", str(tmp_path / "n.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "skipping kvikio: " in out.stdout
    assert "posix    write" in out.stdout


def test_the_daemon_benchmark_keeps_off_the_users_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.bench._daemon_load import start_kvtier, stop_process

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the default data dir is ~/.local/share/kvtier
    work = tmp_path / "work"
    work.mkdir()
    url, proc = start_kvtier(work, "64MiB", max_value_bytes=1 << 20)
    try:
        assert url.startswith("http://127.0.0.1:")
    finally:
        stop_process(proc)
    assert not (home / ".local").exists()
    assert any(work.glob("data-*/nvme"))
