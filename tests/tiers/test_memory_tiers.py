"""Host and CXL specifics: shared memory, NUMA binding, CXL detection and emulation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import Switch
from kvtier.errors import ConfigError, InputError, TierUnavailableError
from kvtier.keys import ChunkKey
from kvtier.tiers import numa
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.cxl import CXLTier
from kvtier.tiers.cxl import Options as CXLOptions
from kvtier.tiers.host import HostTier, Options
from tests.procs import exited_pid

SLOT = 4096


def test_host_arena_is_mappable_by_another_process() -> None:
    tier = HostTier(TierGeometry("h", 16 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF))
    try:
        data = np.random.default_rng(1).integers(0, 256, size=SLOT, dtype=np.uint8)
        (e,) = tier.allocate(1)
        tier.write(SlotRun(e.offset, (ChunkKey(bytes(16)),), SLOT), memoryview(data))
        code = (
            "import mmap,sys,os;f=os.open(sys.argv[1],os.O_RDONLY);m=mmap.mmap(f,0,prot=mmap.PROT_READ);"
            "o=int(sys.argv[2]);sys.stdout.write(m[o:o+4096].hex())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, tier.shm_path, str(e.offset * tier.slot_bytes)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert bytes.fromhex(out) == data.tobytes()
    finally:
        path = Path(tier.shm_path)
        tier.close()
    assert not path.exists()  # close removes the shared-memory file


def test_bind_to_an_existing_node_and_refuse_a_missing_one() -> None:
    nodes = numa.numa_nodes()
    if not nodes:
        pytest.skip("sysfs reports no NUMA nodes on this machine")
    tier = HostTier(
        TierGeometry("h", 8 * SLOT, SLOT, 1 << 20),
        Options(numa_node=nodes[0].node_id, pin=Switch.OFF),
    )
    tier.close()
    with pytest.raises(TierUnavailableError, match="does not exist"):
        HostTier(TierGeometry("h", 8 * SLOT, SLOT, 1 << 20), Options(numa_node=999, pin=Switch.OFF))


def _fake_node(root: Path, node: int, cpus: str, mem_kb: int) -> None:
    d = root / f"node{node}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(cpus + "\n")
    (d / "meminfo").write_text(
        f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree: 1 kB\n"
    )


def test_cxl_candidates_are_cpuless_nodes_with_memory(tmp_path: Path) -> None:
    _fake_node(tmp_path, 0, "0-31", 1 << 20)
    _fake_node(tmp_path, 1, "", 1 << 26)  # a CXL expander: memory, no CPUs
    _fake_node(tmp_path, 2, "", 0)  # an empty node is not a candidate
    assert [n.node_id for n in numa.cxl_candidates(tmp_path)] == [1]
    assert numa.numa_nodes(tmp_path)[1].mem_total_bytes == (1 << 26) * 1024


def test_cxl_without_hardware_is_emulated_or_refused() -> None:
    if numa.cxl_candidates():
        pytest.skip("this machine has a CPU-less NUMA node")
    tier = CXLTier(TierGeometry("c", 8 * SLOT, SLOT, 1 << 20), CXLOptions(pin=Switch.OFF))
    try:
        assert tier.emulated and tier.stats().emulated
    finally:
        tier.close()
    with pytest.raises(ConfigError, match="emulate"):
        CXLTier(
            TierGeometry("c", 8 * SLOT, SLOT, 1 << 20),
            CXLOptions(emulate=Switch.OFF, pin=Switch.OFF),
        )


def test_emulated_cxl_injects_its_latency() -> None:
    # Behaviour, not timing: the throttle must sleep for the configured latency.
    slept: list[float] = []
    tier = CXLTier(
        TierGeometry("c", 8 * SLOT, SLOT, 1 << 20),
        CXLOptions(emulate=Switch.ON, latency_us=5000, pin=Switch.OFF),
    )
    try:
        import kvtier.tiers.cxl as cxl_mod

        real = cxl_mod.time.sleep
        cxl_mod.time.sleep = lambda s: slept.append(s)  # type: ignore[assignment]
        try:
            (e,) = tier.allocate(1)
            tier.write(SlotRun(e.offset, (ChunkKey(bytes(16)),), SLOT), memoryview(bytes(SLOT)))
        finally:
            cxl_mod.time.sleep = real
        assert slept and 0 < slept[0] <= 5e-3
    finally:
        tier.close()


def test_arena_larger_than_shared_memory_is_refused_not_a_sigbus() -> None:
    import shutil

    from kvtier.errors import TierIOError
    from kvtier.tiers.memory import SHM_DIR

    too_big = shutil.disk_usage(SHM_DIR).free + (1 << 30)
    with pytest.raises(TierIOError, match="free"):
        HostTier(TierGeometry("huge", too_big, SLOT, 1 << 20), Options(pin=Switch.OFF))


def test_process_exit_without_close_removes_its_arena() -> None:
    code = (
        "from kvtier.tiers.host import HostTier, Options; from kvtier.config import Switch;"
        "from kvtier.tiers.base import TierGeometry;"
        "t = HostTier(TierGeometry('h', 1 << 20, 4096, 1 << 20), Options(pin=Switch.OFF));"
        "print(t.shm_path)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not Path(out.stdout.strip()).exists()


def test_arenas_of_killed_processes_are_swept(tmp_path: Path) -> None:
    from kvtier.tiers.memory import sweep_stale_arenas

    dead = exited_pid()
    stale = tmp_path / f"kvtier-{dead}-0-host-abc123"
    stale.write_bytes(b"x")
    mine = tmp_path / f"kvtier-{__import__('os').getpid()}-0-host-def456"
    mine.write_bytes(b"y")
    assert sweep_stale_arenas(tmp_path) == 1
    assert not stale.exists() and mine.exists()


def test_a_prefaulted_arena_is_resident_from_the_start() -> None:
    # prefault = true: every page of the arena's file is allocated before the first write
    # (the populate goes through kvtier.tiers.memory.populate, as the daemon's mappings do).
    import os

    from kvtier.enums import Switch
    from kvtier.tiers.memory import SharedArena

    n = 4 << 20
    lazy = SharedArena(n, "lazy", pin=Switch.OFF)
    eager = SharedArena(n, "eager", pin=Switch.OFF, prefault=True)
    try:
        assert os.stat(lazy.path).st_blocks * 512 == 0
        assert os.stat(eager.path).st_blocks * 512 >= n
    finally:
        lazy.close()
        eager.close()


# -- copies split over threads (copy_threads) ----------------------------------------------


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 12345])  # page-aligned and ragged lengths
def test_parallel_copy_covers_every_byte(threads: int, extra: int) -> None:
    from kvtier.tiers.host import PARALLEL_COPY_BYTES, parallel_copy

    n = PARALLEL_COPY_BYTES + 3 * 4096 + extra
    src = np.random.default_rng(threads).integers(0, 256, size=n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    parallel_copy(dst, src, threads)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("value_bytes", [2 << 20, (2 << 20) - 4096])  # fills slots, or not
def test_a_tier_with_copy_threads_round_trips_large_runs(value_bytes: int) -> None:
    # Four 2 MiB chunks: one 8 MiB copy, split over three threads when the values fill
    # their slots (one contiguous range); padded slots copy as one strided view. Then a
    # single chunk, under the split's threshold.
    import threading

    slot = 2 << 20
    tier = HostTier(
        TierGeometry("h", 16 * slot, slot, 16 * slot), Options(pin=Switch.OFF, copy_threads=3)
    )
    try:
        assert tier.copy_threads == 3
        (e,) = tier.allocate(4)  # an aligned extent of 4, then one more slot
        (f,) = tier.allocate(1)
        keys = tuple(ChunkKey(bytes([i]) * 16) for i in range(4))
        data = np.random.default_rng(7).integers(0, 256, size=4 * value_bytes, dtype=np.uint8)
        tier.write(SlotRun(e.offset, keys, value_bytes), memoryview(data))
        out = np.zeros_like(data)
        tier.read(SlotRun(e.offset, keys, value_bytes), memoryview(out))
        assert np.array_equal(out, data)
        one = data[:value_bytes].copy()
        tier.write(SlotRun(f.offset, (ChunkKey(bytes(16)),), value_bytes), memoryview(one))
        back = np.zeros_like(one)
        tier.read(SlotRun(f.offset, (ChunkKey(bytes(16)),), value_bytes), memoryview(back))
        assert np.array_equal(back, one)
        helpers = [t for t in threading.enumerate() if t.name.startswith("kvtier-copy")]
        if value_bytes == slot:
            assert helpers, "a contiguous 8 MiB copy with copy_threads=3 was not split"
    finally:
        tier.close()


def test_copy_threads_default_to_one_per_four_cores() -> None:
    from kvtier.tiers.host import auto_copy_threads

    got = {c: auto_copy_threads(c) for c in (1, 2, 7, 8, 12, 16, 128)}
    assert got == {1: 1, 2: 1, 7: 1, 8: 2, 12: 3, 16: 4, 128: 4}
    tier = HostTier(TierGeometry("h", 4 * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF))
    try:
        assert tier.copy_threads == auto_copy_threads()
    finally:
        tier.close()


def test_a_negative_copy_threads_is_a_config_error(tmp_path: Path) -> None:
    from kvtier.config import load_config

    with pytest.raises(ConfigError, match="copy_threads"):
        Options(copy_threads=-1)
    f = tmp_path / "kvtier.toml"
    f.write_text('[[tiers]]\nkind = "host"\ncapacity_bytes = "64MiB"\ncopy_threads = -2\n')
    with pytest.raises(ConfigError, match="copy_threads"):
        load_config(f, env={})


def test_tiers_asking_for_more_copy_threads_while_others_copy_lose_no_piece() -> None:
    # A tier that needs a larger pool replaces it while copies of others are in flight:
    # those copies keep submitting to the pool they took, and every byte still lands.
    import threading

    from kvtier.tiers.host import PARALLEL_COPY_BYTES, parallel_copy

    n = 2 * PARALLEL_COPY_BYTES
    src = np.random.default_rng(3).integers(0, 256, size=n, dtype=np.uint8)
    errors: list[BaseException] = []

    def copy(threads: int) -> None:
        try:
            for _ in range(40):
                dst = np.zeros(n, dtype=np.uint8)
                parallel_copy(dst, src, threads)
                assert np.array_equal(dst, src)
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=copy, args=(t,)) for t in (2, 3, 5, 8, 2, 6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []


# -- the host tier's copies: one native call (kvtier._core), one C memcpy
# (kvtier._speedups), or numpy without either ---------------------------------------------


@pytest.mark.parametrize("way", ["core", "c", "numpy"])
@pytest.mark.parametrize("value_bytes", [4096, 4096 - 64])  # fills slots, or not
@pytest.mark.parametrize("n", [1, 3])
def test_host_tier_copies_only_the_runs_bytes(
    monkeypatch: pytest.MonkeyPatch, way: str, value_bytes: int, n: int
) -> None:
    import kvtier.tiers.host as host_mod

    if way == "core" and host_mod._copy_slots is None:
        pytest.skip("kvtier._core is not built")
    if way == "c" and host_mod._copy_c is None:
        pytest.skip("kvtier._speedups is not built")
    if way != "core":
        monkeypatch.setattr(host_mod, "_copy_slots", None)
    if way == "numpy":
        monkeypatch.setattr(host_mod, "_copy_c", None)
    slot = 4096
    tier = HostTier(TierGeometry("h", 8 * slot, slot, 8 * slot), Options(pin=Switch.OFF))
    try:
        tier.arena.array[:] = 0xEE  # neighbours must keep this
        run = SlotRun(2, tuple(ChunkKey(bytes([i]) * 16) for i in range(n)), value_bytes)
        data = np.random.default_rng(n).integers(0, 256, size=n * value_bytes, dtype=np.uint8)
        tier.write(run, memoryview(data))
        out = np.zeros_like(data)
        tier.read(run, memoryview(out))
        assert np.array_equal(out, data)
        arena = tier.arena.array
        assert (arena[: 2 * slot] == 0xEE).all() and (arena[(2 + n) * slot :] == 0xEE).all()
        for j in range(n):  # a slot's padding past its value stays as it was
            assert (arena[(2 + j) * slot + value_bytes : (3 + j) * slot] == 0xEE).all()
        # A buffer of another size than the run is refused, not copied in part or past it.
        for wrong in (n * value_bytes + 1, n * value_bytes - 1):
            with pytest.raises(InputError):
                tier.write(run, memoryview(bytearray(wrong)))
            with pytest.raises(InputError):
                tier.read(run, memoryview(bytearray(wrong)))
            with pytest.raises(ValueError):
                host_mod.copy_in(arena, slot, run, memoryview(bytearray(wrong)))
            with pytest.raises(ValueError):
                host_mod.copy_out(arena, slot, run, memoryview(bytearray(wrong)))
        assert (arena[(2 + n) * slot :] == 0xEE).all()
    finally:
        tier.close()


def test_the_native_slot_copy_refuses_what_the_tier_would() -> None:
    core = pytest.importorskip("kvtier._core")
    arena = np.zeros(4 * 64, dtype=np.uint8)
    core.copy_slots(arena, 64, 1, 2, 60, b"a" * 120, True)  # two values of 60 in slots 1, 2
    assert bytes(arena[64:124]) == b"a" * 60 and bytes(arena[124:128]) == b"\0" * 4
    out = bytearray(120)
    core.copy_slots(arena, 64, 1, 2, 60, out, False)
    assert out == b"a" * 120
    with pytest.raises(InputError):  # a value longer than its slot
        core.copy_slots(arena, 64, 0, 1, 65, b"a" * 65, True)
    with pytest.raises(InputError):  # a buffer of another size than the run
        core.copy_slots(arena, 64, 0, 2, 60, b"a" * 119, True)
    with pytest.raises(ValueError):  # past the arena's end
        core.copy_slots(arena, 64, 3, 2, 64, b"a" * 128, True)
    with pytest.raises(BufferError):  # a read into a read-only buffer
        core.copy_slots(arena, 64, 0, 1, 64, b"a" * 64, False)
    big = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)  # over the GIL-free size
    arena = np.zeros(2 * big.nbytes, dtype=np.uint8)
    core.copy_slots(arena, big.nbytes, 1, 1, big.nbytes, big, True)
    assert np.array_equal(arena[big.nbytes :], big)


def test_the_c_copy_refuses_ranges_outside_its_buffers() -> None:
    speedups = pytest.importorskip("kvtier._speedups")
    dst = np.zeros(8, dtype=np.uint8)
    speedups.copy(dst, 6, b"abcd", 1, 2)
    assert bytes(dst) == b"\0" * 6 + b"bc"
    for args in [(dst, 7, b"abcd", 0, 2), (dst, 0, b"abcd", 3, 2), (dst, -1, b"ab", 0, 1)]:
        with pytest.raises(ValueError, match="out of range"):
            speedups.copy(*args)
    with pytest.raises(BufferError):
        speedups.copy(b"read-only", 0, b"x", 0, 1)
    speedups.copy(dst, np.int64(0), b"yz", np.uint32(0), np.int16(2))  # numpy offsets
    assert bytes(dst[:2]) == b"yz"
    with pytest.raises(TypeError):
        speedups.copy(dst, 0.5, b"yz", 0, 1)
    big = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)  # over the GIL-free size
    into = np.empty_like(big)
    speedups.copy(into, 0, big, 0, big.nbytes)
    assert np.array_equal(into, big)
