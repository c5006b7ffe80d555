"""The supported vLLM range: one test per version that runs on this CPU machine.

* **0.32** (installed, the CPU build): the compatibility module reads the real API.
* **0.26** (the CUDA release the GPU hosts run): its wheel cannot run here (CUDA kernels,
  torch 2.11), but its Python sources import beside the CPU torch. With
  ``KVTIER_TEST_VLLM_WHEELS`` naming a folder that holds ``vllm-0.26.*.whl`` (what
  ``scripts/wheelhouse.sh build`` leaves), a child process imports the connector against
  those sources: the connector module loads, the compatibility module sees 0.26, and
  every method the connector overrides exists in 0.26's ``KVConnectorBase_V1`` (or
  ``SupportsHMA``) with the same parameters, or is one of the names 0.26 never calls. Skipped without it.

The engine runs on 0.26 themselves are the CUDA tests (test_vllm_cuda.py) on a GPU host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.connectors.vllm import compat

ROOT = Path(__file__).resolve().parents[2]


def test_parse_version() -> None:
    assert compat.parse_version("0.26.0") == (0, 26)
    assert compat.parse_version("0.32.0+cpu") == (0, 32)
    with pytest.raises(ValueError):
        compat.parse_version("dev")


def test_resumed_req_ids_before_and_after_0_34() -> None:
    assert compat.resumed_req_ids(SimpleNamespace(resumed_req_ids={"a"})) == {"a"}
    assert compat.resumed_req_ids(SimpleNamespace()) == frozenset()  # 0.34: none listed


@pytest.mark.vllm
def test_installed_vllm_0_32_is_in_range() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert compat.vllm_version() == (0, 32)
    assert compat.check_version()
    assert compat.HOST_HIT_SOURCE is CacheHitSource.HOST


# Run in a child with 0.26's sources first on sys.path: prints what the test checks.
_PROBE = r"""
import inspect, json
import vllm
from kvtier.connectors.vllm import compat
from kvtier.connectors.vllm.connector import KVTierConnector as C
own = {n for n, v in vars(C).items() if callable(v) or isinstance(v, (property, classmethod))}
own -= {"__init__", "sched", "worker", "_meta"}
report = {"version": vllm.__version__, "compat": list(compat.vllm_version()),
          "host_hit_source": repr(compat.HOST_HIT_SOURCE),
          "abstract_left": sorted(getattr(C, "__abstractmethods__", ())),
          "missing_in_base": [], "signature_differs": []}
bases = [b for b in C.__mro__[1:] if b.__module__.startswith("vllm.")]  # Base, SupportsHMA
for name in sorted(own):
    owner = next((b for b in bases if hasattr(b, name)), None)
    if owner is None:
        report["missing_in_base"].append(name)
        continue
    mine, theirs = inspect.getattr_static(C, name), inspect.getattr_static(owner, name)
    f = lambda x: getattr(x, "__func__", getattr(x, "fget", x))
    if callable(f(mine)) and callable(f(theirs)):
        a = list(inspect.signature(f(mine)).parameters)
        b = list(inspect.signature(f(theirs)).parameters)
        if a != b:
            report["signature_differs"].append([name, a, b])
print("PROBE " + json.dumps(report))
"""

# Names the connector defines for 0.32 that 0.26's base class lacks: 0.26 never calls them.
NEWER_THAN_0_26 = {"requires_kv_delivery", "get_transfer_results"}


def _wheel(version: str) -> Path:
    folder = os.environ.get("KVTIER_TEST_VLLM_WHEELS")
    if not folder:
        pytest.skip("set KVTIER_TEST_VLLM_WHEELS to a folder holding vLLM wheels")
    found = sorted(Path(folder).glob(f"vllm-{version}*.whl"))
    if not found:
        pytest.skip(f"no vllm-{version}*.whl in {folder}")
    return found[0]


def _sources(wheel: Path, into: Path) -> Path:
    """The wheel's Python package without its compiled kernels (not importable here)."""
    with zipfile.ZipFile(wheel) as z:
        names = [
            n
            for n in z.namelist()
            if n.startswith("vllm/") and not n.endswith(".so") and "/third_party/" not in n
        ]
        z.extractall(into, names)
    return into


@pytest.mark.vllm
@pytest.mark.slow
def test_connector_matches_vllm_0_26_base_class(tmp_path: Path) -> None:
    src = _sources(_wheel("0.26"), tmp_path / "vllm026")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(line[len("PROBE ") :])
    assert r["version"].startswith("0.26"), r
    assert r["compat"] == [0, 26]
    assert r["host_hit_source"] == "None"  # no cache_hit_source module in 0.26
    assert r["abstract_left"] == []
    assert set(r["missing_in_base"]) <= NEWER_THAN_0_26, r["missing_in_base"]
    assert r["signature_differs"] == [], r["signature_differs"]
