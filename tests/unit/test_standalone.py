"""The repository stands alone: a user's clone has nothing beside it.

The Mooncake traces ship inside the package (kvtier/data/mooncake, gzip), and no file of
the project may point at a folder beside the repository (issue 12: `make test` failed on
a clean clone because tests read the traces from there).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from kvtier.policies.trace import load_trace
from kvtier.traces import SHIPPED, TRACE_DIR, shipped_trace

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "node_modules",
}
# Assembled so that this file does not match itself.
SIBLING = "sha" + "red"
FORBIDDEN = re.compile(
    r"\.\./"
    + SIBLING
    + r"\b"  # a relative path to the sibling folder
    + r"|/work/"
    + SIBLING
    + r"\b"  # the team's absolute path
    + r"|['\"]\.\.['\"]\s*/\s*['\"]"
    + SIBLING  # Path(...) / ".." / "<sibling>"
    + r"|parents?\[\d\]\s*/\s*['\"]"
    + SIBLING  # Path(...).parents[2] / "<sibling>"
)


def project_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(dirpath) / f for f in filenames]
    return out


def test_nothing_reads_a_folder_beside_the_repository() -> None:
    hits = []
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (traces, images, the C extension)
        for n, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "files that reach outside the repository:\n" + "\n".join(hits)


def test_the_guard_catches_the_old_spellings() -> None:
    for line in (
        'TRACES = ROOT / ".." / "' + SIBLING + '" / "data"',
        "--trace ../" + SIBLING + "/data/mooncake/conversation_trace.jsonl",
        'Path("/work/' + SIBLING + '/data")',
    ):
        assert FORBIDDEN.search(line), line
    assert not FORBIDDEN.search("shared_memory, a shared Redis tier, ../" + SIBLING + "lib")


# Request counts and SHA-256 of the uncompressed files, as kvtier/data/mooncake/README.md
# states them (the files are the released ones, unchanged).
RELEASED = {
    "mooncake-conversation": (
        12031,
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    ),
    "mooncake-synthetic": (
        3993,
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    ),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_traces_are_the_released_files(name: str) -> None:
    requests, sha = RELEASED[name]
    path = shipped_trace(name)
    raw = gzip.decompress(path.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == sha
    readme = (TRACE_DIR / "README.md").read_text()
    assert sha in readme and path.name in readme and "Apache" in readme
    assert len(load_trace(name).requests) == requests


def test_shipped_traces_are_package_data() -> None:
    # An installed (non-editable) kvtier must carry them too.
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # package -> its globs, for the packages under kvtier/ that setuptools ships
    shipped = {
        pkg: globs
        for pkg, globs in setuptools["package-data"].items()
        if pkg in setuptools["packages"] and pkg.split(".")[0] == "kvtier"
    }
    for f in (*SHIPPED.values(), "README.md"):
        path = TRACE_DIR / f
        assert any(
            path.is_relative_to(ROOT / pkg.replace(".", "/"))
            and any(
                fnmatch(path.relative_to(ROOT / pkg.replace(".", "/")).as_posix(), g) for g in globs
            )
            for pkg, globs in shipped.items()
        ), f
