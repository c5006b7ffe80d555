"""Process helpers shared by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def exited_pid() -> int:
    """The pid of a process that has run and exited: a name no live process holds (until
    the kernel reuses it, far later than a test looks)."""
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def vllm_scratch(scratch: Path) -> dict[str, str]:
    """Settings that put a vLLM engine's sockets and torch.distributed's store file under
    ``scratch`` (a test's temporary directory): by default vLLM leaves both in the
    system's temp directory for good."""
    return {"VLLM_RPC_BASE_PATH": str(scratch), "TMPDIR": str(scratch)}


def engine_env(scratch: Path) -> dict[str, str]:
    """The environment of a child process that runs a vLLM engine: this one's, less any
    ``VLLM_`` and ``KVTIER_`` settings (the child sets its own), plus
    :func:`vllm_scratch`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVTIER_"))}
    return env | vllm_scratch(scratch)


def group_shm(pgid: int) -> set[Path]:
    """Python multiprocessing's shared memory (``/dev/shm/psm_*``, ``sem.mp-*``) mapped by
    the live processes of process group ``pgid``.

    A process killed with SIGKILL unlinks none of it, and nothing else does: vLLM's engine
    message queues stay behind in RAM (400 MiB per killed API server). A test that kills
    an engine takes this list first and unlinks it after the kill (:func:`kill_group`).
    """
    found: set[Path] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After the command's closing parenthesis: state, ppid, pgrp, ...
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            maps = (stat.parent / "maps").read_text()
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-")):
                found.add(Path(path.removesuffix(" (deleted)")))
    return found


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (started with ``start_new_session``), wait for
    ``proc``, and unlink the multiprocessing shared memory the group had mapped."""
    shm = group_shm(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for path in shm:
        path.unlink(missing_ok=True)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    """SIGTERM (a clean stop), then SIGKILL after ``timeout_s``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
