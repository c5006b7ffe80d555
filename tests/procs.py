"""Process helpers shared by the tests."""

from __future__ import annotations

import os
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
