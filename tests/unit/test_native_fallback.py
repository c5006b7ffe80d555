"""The C modules are optional: without them kvtier installs and runs on its Python code.

``setup.py`` builds ``kvtier._core`` and ``kvtier._speedups`` with ``optional=True``. A
machine with no C compiler, or whose build fails, gets a package without them, and every
place that would use them takes the Python reference instead (the allocator, the store
index, the host tier's copies, key checks). Two checks, each in a fresh interpreter:

* the installed package with both modules made unimportable (a failed build), through a
  store's put, get, eviction and delete;
* a wheel built from this source tree with a C compiler that always fails, unpacked and
  imported on its own: it holds no extension module and does the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run in the child: which implementations serve, and a store round trip on them.
ROUND_TRIP = textwrap.dedent(
    """
    import json
    import numpy as np
    import kvtier
    from kvtier.alloc import BuddyAllocator, NativeBuddyAllocator, make_allocator
    from kvtier.enums import Switch
    from kvtier.keys import ChunkKey
    from kvtier.store import TieredStore
    from kvtier.store.index import StoreIndex
    from kvtier.store.native import NativeStoreIndex, make_index
    from kvtier.store.policy import LRUEviction, WriteThrough
    from kvtier.tiers.base import TierGeometry
    from kvtier.tiers.host import HostTier, Options

    SLOT = 64 << 10
    tier = HostTier(TierGeometry("host", 8 * SLOT, SLOT, 8 * SLOT), Options(pin=Switch.OFF))
    index = make_index([tier], LRUEviction, WriteThrough(), lambda e: None)
    store = TieredStore([tier], io_threads=1)
    rng = np.random.default_rng(0)
    out = {
        "package": kvtier.__file__,
        "native_allocator": NativeBuddyAllocator is not None,
        "native_index": NativeStoreIndex is not None,
        "allocator_is_reference": type(make_allocator(64, 4)) is BuddyAllocator,
        "index_is_reference": type(index) is StoreIndex,
    }
    try:
        keys = [ChunkKey(bytes([i]) * 16) for i in range(12)]
        src = rng.integers(0, 256, size=4 * SLOT, dtype=np.uint8)
        dst = np.zeros_like(src)
        out["stored"] = store.put(keys[:4], src).result().stored
        out["got"] = store.get(keys[:4], dst).result().chunks
        out["same_bytes"] = bool(np.array_equal(dst, src))
        # Eight more chunks in an arena of eight: the LRU evicts the first ones.
        more = rng.integers(0, 256, size=8 * SLOT, dtype=np.uint8)
        out["stored_more"] = store.put(keys[4:], more).result().stored
        back = np.zeros_like(more)
        out["got_more"] = store.get(keys[4:], back).result().chunks
        out["same_more"] = bool(np.array_equal(back, more))
        out["first_present"] = store.lookup(keys[:4]).hits
        out["deleted"] = store.delete(keys)
        out["left"] = store.lookup(keys[4:]).hits
    finally:
        store.close()
    print(json.dumps(out))
    """
)

# Makes kvtier's C modules unimportable, as after a build that failed or was skipped.
BLOCK = "import sys\nsys.modules['kvtier._core'] = None\nsys.modules['kvtier._speedups'] = None\n"


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _check_python_path(out: dict[str, object]) -> None:
    assert out["native_allocator"] is False and out["native_index"] is False
    assert out["allocator_is_reference"] is True and out["index_is_reference"] is True
    assert out["stored"] == 4 and out["got"] == 4 and out["same_bytes"] is True
    assert out["stored_more"] == 8 and out["got_more"] == 8 and out["same_more"] is True
    assert out["first_present"] == 0  # evicted to make room
    assert out["deleted"] == 8 and out["left"] == 0


def test_a_failed_build_serves_on_the_python_code(tmp_path: Path) -> None:
    out = _run([sys.executable, "-c", BLOCK + ROUND_TRIP], cwd=tmp_path)
    _check_python_path(out)


@pytest.mark.parametrize("value", ["0", "off"])
def test_kvtier_native_off_serves_on_the_python_code_where_the_core_is_built(
    tmp_path: Path, value: str
) -> None:
    pytest.importorskip("kvtier._core", reason="the C core is not built here")
    env = {**os.environ, "KVTIER_NATIVE": value}
    _check_python_path(_run([sys.executable, "-c", ROUND_TRIP], cwd=tmp_path, env=env))
    # Unset, the same interpreter picks the core: the switch, not the build, decided.
    env.pop("KVTIER_NATIVE")
    out = _run([sys.executable, "-c", ROUND_TRIP], cwd=tmp_path, env=env)
    assert out["native_allocator"] is True and out["native_index"] is True
    assert out["index_is_reference"] is False and out["same_bytes"] is True


@pytest.mark.slow
def test_a_wheel_built_without_a_c_compiler_installs_and_runs(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    # A copy of the source without build outputs, so that nothing built here leaks in.
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.so", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    env = {**os.environ, "CC": "false", "LDSHARED": "false", "PIP_NO_INPUT": "1"}
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip, "-w", str(wheels), str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(tmp_path / "site")
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    # -S: no site-packages hooks, so the editable install of this checkout stays out;
    # the wheel comes first and kvtier's dependencies come from this interpreter's path.
    deps = [p for p in sys.path if p and "site-packages" in p]
    prelude = f"import sys\nsys.path[:0] = {[str(tmp_path / 'site'), *deps]!r}\n"
    out = _run([sys.executable, "-S", "-c", prelude + ROUND_TRIP], cwd=tmp_path)
    assert str(out["package"]).startswith(str(tmp_path / "site"))
    _check_python_path(out)
