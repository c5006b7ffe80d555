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


# Runs a benchmark as ``python -m`` would, with packages hidden: an import of one fails
# as if it were not installed (None in sys.modules), and find_spec finds nothing.
HIDDEN = """
import runpy, sys
sys.modules.update(dict.fromkeys(sys.argv[1].split(",")))
name, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
runpy.run_module(f"kvtier.bench.{name}", run_name="__main__")
"""

# (benchmark, packages hidden, tiny arguments, the reason it must print)
WITHOUT = [
    (
        "gpu_transfer",
        "torch",
        ["--quick"],
        "skipping every gpu_transfer row: torch is not installed",
    ),
    ("nvme_gpu", "torch", ["--sizes", "4", "--repeat", "1"], "skipping every nvme_gpu row: torch"),
    ("redis", "redis", ["--tokens", "256"], "skipping every redis row: redis is not installed"),
    (
        "daemon",
        "redis",
        ["--same-host-sizes", "", "--soak-s", "0"],
        "skipping the Redis rows: redis",
    ),
    ("daemon", "httpx", [], "skipping every daemon row: httpx is not installed"),
    ("lmcache", "lmcache", [], "skipping every lmcache row: lmcache is not installed"),
    ("vllm_e2e", "vllm", [], "skipping every vllm_e2e row: vllm is not installed"),
    ("vllm_e2e", "vllm", ["--restart"], "skipping every vllm_restart row: vllm"),
    ("vllm_noreuse", "vllm", [], "skipping every vllm_noreuse row: vllm is not installed"),
    ("vllm_restart", "vllm", [], "skipping every vllm_restart row: vllm is not installed"),
    (
        "keys",
        "vllm",
        ["--tokens", "4096", "--repeat", "1"],
        "skipping the vLLM baseline rows: vllm",
    ),
    (
        "nvme",
        "aiofiles,lz4",
        ["--sizes", "4", "--repeat", "1", "--skip-recovery", "--engines", "posix,aiofiles"],
        "skipping the aiofiles rows: aiofiles is not",
    ),
    (
        "nvme",
        "lz4",
        ["--sizes", "4", "--repeat", "1", "--skip-recovery", "--engines", "posix"],
        "skipping the codec rows: lz4 is not installed",
    ),
    (
        "nvme",
        "cryptography",
        ["--sizes", "4", "--repeat", "1", "--skip-recovery", "--engines", "posix,posix+aes"],
        "skipping the posix+aes rows: cryptography is not installed",
    ),
    (
        "redis",
        "cryptography",
        ["--tokens", "256", "--repeat", "1", "--targets", "single"],
        "skipping the kvtier+aes columns: cryptography is not installed",
    ),
]


@pytest.mark.parametrize(("name", "hidden", "args", "reason"), WITHOUT)
def test_a_missing_optional_package_skips_its_rows_with_a_reason(
    name: str, hidden: str, args: list[str], reason: str, tmp_path: Path
) -> None:
    if name == "daemon":  # the daemon's other packages must be there for its own message
        for m in {"fastapi", "uvicorn", "httpx"} - set(hidden.split(",")):
            pytest.importorskip(m, reason="the daemon benchmark needs the service extra")
    if name in ("nvme", "nvme_gpu"):
        args = [*args, "--dir", str(tmp_path)]
    helped = run(sys.executable, "-c", HIDDEN, hidden, name, "--help")
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr[-2000:]
    out = run(sys.executable, "-c", HIDDEN, hidden, name, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert reason in out.stdout
    assert "Traceback" not in out.stderr


def test_the_nvme_benchmark_skips_a_missing_engine_with_a_reason(tmp_path: Path) -> None:
    from kvtier.tiers.nvme.engine import kvikio_importable, libcuda_loads

    if kvikio_importable() and libcuda_loads():
        pytest.skip("kvikio runs here: nothing to skip")
    out = run(
        *KVTIER,
        "bench",
        "nvme",
        "--dir",
        str(tmp_path),
        "--sizes",
        "4",
        "--repeat",
        "1",
        "--skip-recovery",
        "--engines",
        "posix,kvikio",
        "--json",
        str(tmp_path / "n.json"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "skipping kvikio: " in out.stdout
    assert "posix    write" in out.stdout


def test_the_daemon_benchmark_keeps_off_the_users_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for m in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(m, reason="the daemon benchmark needs the service extra")
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


def test_the_same_host_floor_is_measured_on_one_cpu_and_on_two_and_leaves_affinity_alone() -> None:
    # One unpinned figure said only where the scheduler put the two processes (on the
    # 2-vCPU VM: 4 us on one CPU, ~100 us across two).
    import os

    from kvtier.bench._same_host import socket_floors_us

    before = os.sched_getaffinity(0)
    floors = socket_floors_us()
    assert os.sched_getaffinity(0) == before
    assert floors["socket_round_trip_floor_us"] and floors["socket_round_trip_floor_us"] > 0
    assert floors["socket_round_trip_one_cpu_us"] and floors["socket_round_trip_one_cpu_us"] > 0
    if len(before) > 1:
        assert (
            floors["socket_round_trip_two_cpus_us"] and floors["socket_round_trip_two_cpus_us"] > 0
        )
    else:
        assert floors["socket_round_trip_two_cpus_us"] is None


def test_the_same_host_rows_run_on_a_prefaulted_arena(tmp_path: Path) -> None:
    # The baseline copies into a ring it touched first; the daemon's arena must be
    # touched too, or the first timed puts pay the page faults of a fresh daemon.
    for m in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(m, reason="the daemon benchmark needs the service extra")
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.bench._daemon_load import start_kvtier, stop_process
    from kvtier.bench._same_host import _resident_shared_bytes, rows_for_size

    arena = 64 << 20
    shmem = {}
    for prefault in (False, True):
        settings = ("tiers.0.prefault=true",) if prefault else ()
        _url, proc = start_kvtier(tmp_path, "64MiB", max_value_bytes=1 << 20, settings=settings)
        try:
            shmem[prefault] = _resident_shared_bytes(proc.pid)
        finally:
            stop_process(proc)
    assert shmem[True] >= arena > shmem[False]

    with ThreadPoolExecutor(2) as pool:
        rows = rows_for_size(
            tmp_path, 1 << 20, [1], target_bytes=4 << 20, repeats=1, pool=pool, batch=2
        )
    assert {r["op"] for r in rows} == {"same_host_get", "same_host_put"}
    assert all(r["batch"] == 2 and r["ratio_memcpy"] > 0 for r in rows)
    assert all(r["daemon_shared_resident_bytes_at_start"] >= r["arena_bytes"] for r in rows)
    # Every request costs the daemon and the client some CPU: the columns measure it.
    assert all(r["daemon_cpu_us_per_op"] > 0 and r["client_cpu_us_per_op"] > 0 for r in rows)


def test_the_moves_benchmark_moves_verifies_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the default data dir is ~/.local/share/kvtier
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--dir", str(scratch), "--chunks", "1", "--host-mib", "64", "--repeat", "2"]
    out = run(*KVTIER, "bench", "moves", *args, "--json", str(tmp_path / "m.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["op"]: r for r in json.loads((tmp_path / "m.json").read_text())["rows"]}
    assert set(rows) == {"demote", "promote"}
    assert all(
        r["verified"] is True and r["ratio"] > 0 and r["cpu_ratio"] > 0 for r in rows.values()
    )
    # Each of the two warm-up and two timed rounds moved a chunk down (demote), or up (promote).
    assert rows["demote"]["moved_chunks"]["demoted"] >= 4
    assert rows["promote"]["moved_chunks"]["promoted"] >= 4
    assert not any(scratch.iterdir())  # its temporary folder is gone
    assert not (home / ".local").exists()  # never the user's data directory


def test_the_host_profile_times_each_operations_functions_and_unwraps_them() -> None:
    from kvtier.bench import _host_profile as prof
    from kvtier.store import TieredStore
    from kvtier.tiers.base import Tier

    def attributes() -> dict[tuple[object, str], object]:
        return {
            (owner, name): owner.__dict__.get(name)
            if isinstance(owner, type)
            else getattr(owner, name)
            for targets in prof.PROFILED.values()
            for owner, name in targets
        }

    before = attributes()
    flushes = []
    rows = prof.cold_profile(lambda: flushes.append(1), rounds=3, value_bytes=64 << 10)
    by = {(r["op"], r["function"]): r for r in rows}
    # Each operation's entry point once per operation, the copy inside it (the native
    # core's run copy where it is built, else numpy's), and the whole no shorter than a part.
    for op, top, inners in [
        ("put", "TieredStore.put", ("host.copy_in", "host._copy_slots")),
        ("get", "TieredStore.get", ("host.copy_out", "host._copy_slots")),
        ("delete", "TieredStore.delete", ("Tier.release",)),
    ]:
        (inner,) = [label for label in inners if (op, label) in by]
        assert by[(op, top)]["calls_per_op"] == 1
        assert by[(op, inner)]["calls_per_op"] == 1
        assert by[(op, top)]["median_us"] >= by[(op, inner)]["median_us"] > 0
    assert by[("put", "store.check_keys")]["calls_per_op"] == 2  # keys and prefix
    assert len(flushes) == 3 * (3 + 5)  # before every operation, warm-up rounds included
    assert attributes() == before  # every wrapper taken off again
    assert TieredStore.put.__name__ == "put" and "write" in Tier.__dict__


def test_the_native_benchmark_compares_a_store_with_the_core_and_one_without(
    tmp_path: Path,
) -> None:
    import json

    from kvtier.alloc import NativeBuddyAllocator

    args = ["--sizes", "2", "--arena-mib", "16", "--repeat", "1", "--rounds", "1"]
    out = run(
        *KVTIER, "bench", "native", *args, "--fixed-rounds", "3", "--json", str(tmp_path / "n.json")
    )
    assert out.returncode == 0, out.stderr[-2000:]
    if NativeBuddyAllocator is None:  # nothing to compare against where the core is not built
        assert "not built" in out.stdout
        return
    got = json.loads((tmp_path / "n.json").read_text())
    assert got["verified"] is True and got["allocator_same_extents"] is True
    # One side runs the native core, the other the Python reference.
    assert got["children"]["native"]["native"] is True
    assert got["children"]["python"]["native"] is False
    assert {(r["op"], r["queue_depth"]) for r in got["rows"]} == {
        ("put", 1),
        ("get", 1),
        ("put", 4),
        ("get", 4),
    }
    assert all(r["native_vs_python"] > 0 for r in got["rows"])
    assert {f["op"] for f in got["fixed_costs"]} == {"put", "get", "delete"}
    too_small = run(*KVTIER, "bench", "native", "--sizes", "4", "--arena-mib", "16")
    assert too_small.returncode == 2 and "holds no 5 runs" in too_small.stderr
