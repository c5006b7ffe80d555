"""Process helpers shared by the tests."""

from __future__ import annotations

import subprocess
import sys


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
