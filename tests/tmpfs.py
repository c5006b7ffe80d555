"""A real full disk for tests: a small tmpfs mounted for the test, and a filler for it.

Mounting needs root; elsewhere the test is skipped with the reason its caller gives.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(parent: Path, size: str, not_root: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: ``16m``) under ``parent``, unmounted after.

    Skips the test with ``not_root`` when this process may not mount, and with mount's
    own message when the mount fails.
    """
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(not_root)
    mnt = parent / f"fs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Take every byte left on the filesystem of ``directory``; returns the filler file."""
    filler = directory / f"filler-{uuid.uuid4().hex[:6]}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\xff" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler
