"""Engine choice and the engines' own contract (aligned transfers, short reads, errors)."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.nvme import EngineKind, Options
from kvtier.tiers.nvme.engine import IORequest, PosixEngine, libcuda_loads, make_engine
from kvtier.tiers.nvme.tier import NVMeTier


def test_auto_is_posix_without_libcuda() -> None:
    if libcuda_loads():
        pytest.skip("libcuda loads here: auto may pick kvikio")
    engine = make_engine("auto", 2)
    try:
        assert engine.name == "posix"
    finally:
        engine.close()


def test_kvikio_where_it_cannot_run_is_a_config_error(tmp_path: Path) -> None:
    try:
        import kvikio  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("kvikio is installed here")
    with pytest.raises(ConfigError, match="engine"):
        opts = Options(dir=str(tmp_path), engine=EngineKind.KVIKIO)
        NVMeTier(TierGeometry("nv", 1 << 20, 1 << 16, 1 << 30), opts)


def test_engine_round_trip_and_short_read(tmp_path: Path) -> None:
    engine = PosixEngine(2)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (1 << 20))
    try:
        idx = engine.open(path, direct=True)
        src = [mmap.mmap(-1, 1 << 18) for _ in range(4)]
        for b in src:
            b.write(os.urandom(1 << 18))
            b.seek(0)
        engine.write([IORequest(idx, k << 18, 1 << 18, buffer=b) for k, b in enumerate(src)])
        dst = [mmap.mmap(-1, 1 << 18) for _ in range(4)]
        engine.read([IORequest(idx, k << 18, 1 << 18, buffer=b) for k, b in enumerate(dst)])
        assert [bytes(b) for b in dst] == [bytes(b) for b in src]
        with pytest.raises(OSError) as info:  # past the end of the file: a short read
            engine.read([IORequest(idx, 1 << 20, 1 << 18, buffer=dst[0])])
        assert info.value.errno == errno.EIO
    finally:
        engine.close()


def test_auto_falls_back_to_posix_when_kvikio_does_not_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An installed kvikio without the modules the engine needs (an API that moved, a partial
    install) costs GPU-direct I/O only: ``auto`` logs why and serves through posix. libcuda is
    faked as present, the one thing a CPU machine cannot produce."""
    import sys

    from kvtier.tiers.nvme import engine as engine_mod

    fake = tmp_path / "site" / "kvikio"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("# a kvikio without cufile_driver or defaults\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(engine_mod, "libcuda_loads", lambda: True)
    with caplog.at_level("WARNING", logger="kvtier.tiers.nvme.engine"):
        engine = make_engine("auto", 2)
    try:
        assert engine.name == "posix"
        assert "kvikio unusable" in caplog.text
    finally:
        engine.close()
    with pytest.raises(OSError, match="kvikio is not usable"):
        make_engine("kvikio", 2)
