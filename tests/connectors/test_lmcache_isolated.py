"""LMCache's plug points, tested in a pytest process of their own (tests/lmcache/).

Importing lmcache imports numba and llvmlite; vLLM 0.32 then fails to build an in-process
engine (its triton dispatcher scans every module and trips over an llvmlite object), and
pytest imports every test module before the first test runs. So the LMCache tests live
outside this session's collection and run here, in a child pytest, where nothing else
builds a vLLM engine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFORMANCE = "tests/lmcache/test_lmcache_conformance.py"

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("LMCache is not installed (pip install 'kvtier[lmcache]')", allow_module_level=True)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the whole tests/lmcache run, beyond the per-test default
def test_lmcache_plug_points(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_LMCACHE_TESTS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rA",
        f"--basetemp={tmp_path / 'bt'}",
        "tests/lmcache",
        f"--ignore={CONFORMANCE}",  # runs long: a child of its own, below
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    # LMCache logs every store and retrieve at INFO: drop those lines, or they push the
    # failing test's assertion and kvtier's own warnings out of the message.
    out = "\n".join(
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "INFO" not in line or "kvtier" in line
    )[-20000:]
    assert run.returncode == 0, out
    assert " passed" in run.stdout, out
    # Only the full-disk tests may skip (they mount a tmpfs, which needs root).
    skips = [ln for ln in run.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert all("tmpfs" in ln for ln in skips), out


@pytest.mark.slow
@pytest.mark.timeout(3700)
def test_lmcache_own_storage_suites(tmp_path: Path) -> None:
    """LMCache's own suites against kvtier's plug-ins (scripts/lmcache_conformance.py)."""
    env = {**os.environ, "KVTIER_LMCACHE_TESTS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
    cmd += [f"--basetemp={tmp_path / 'bt'}", CONFORMANCE]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3650)
    out = (run.stdout + run.stderr)[-20000:]
    skipped = [ln for ln in run.stdout.splitlines() if ln.startswith("SKIPPED")]
    if skipped and run.returncode == 0 and " passed" not in run.stdout:
        pytest.skip(skipped[0])  # no network and no cached source distribution
    assert run.returncode == 0, out
    assert " passed" in run.stdout, out
