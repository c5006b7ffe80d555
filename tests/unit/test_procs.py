"""The tests' own process helpers (tests/procs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import group_shm, kill_group

# A child that makes one multiprocessing shared-memory block, says its name, and waits.
HOLDER = (
    "from multiprocessing import shared_memory, resource_tracker\n"
    "m = shared_memory.SharedMemory(create=True, size=4096)\n"
    # As vLLM does: no resource tracker to clean up after a crash.
    "resource_tracker.unregister(m._name, 'shared_memory')\n"
    "print(m.name, flush=True)\n"
    "import time; time.sleep(120)\n"
)


def _holder() -> tuple[subprocess.Popen[bytes], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    return proc, Path("/dev/shm") / proc.stdout.readline().decode().strip()


def test_killing_a_group_unlinks_its_shared_memory_and_no_one_elses() -> None:
    victim, victim_shm = _holder()
    bystander, bystander_shm = _holder()
    try:
        assert victim_shm.exists() and bystander_shm.exists()
        assert group_shm(victim.pid) == {victim_shm}
        kill_group(victim)
        assert victim.returncode is not None
        assert not victim_shm.exists()
        assert bystander_shm.exists()  # another group's block stays
    finally:
        kill_group(bystander)
        victim_shm.unlink(missing_ok=True)
    assert not bystander_shm.exists()
