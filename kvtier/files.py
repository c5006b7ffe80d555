"""Files that hold cached data or secrets are private to the user that runs kvtier.

KV-cache bytes are a tenant's data (prompts can be rebuilt from them), and the key salt
is a secret: slab, journal and salt files are created ``0600`` and the directories
kvtier creates for them ``0700``: with ``0644`` another local user could read a
tenant's bytes from a slab (tests/tiers/nvme/test_faults.py, test_data_at_rest_is_private).
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each ``0700``; existing ones are left as
    they are (an operator's mount point keeps its own permissions).

    Raises:
        OSError: a component cannot be created.
    """
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # created meanwhile by another process
        os.chmod(d, DIR_MODE)  # mkdir's mode is filtered by the umask


def make_private(path: Path) -> None:
    """Make an existing file or directory kvtier owns private (``0600``/``0700``)."""
    os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
