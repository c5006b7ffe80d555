"""Module sizes (issue 13; STYLE.md rule 8): no module over 800 lines, the store's facade at most 600.

Lines are counted as ``wc -l`` counts them: newline characters.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("kvtier", "policies", "connectors", "service", "bench")
MAX_LINES = 800
LIMITS = {"kvtier/store/store.py": 600}


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def test_no_module_exceeds_its_size_limit() -> None:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100
    over = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        limit = LIMITS.get(rel, MAX_LINES)
        if (n := _lines(path)) > limit:
            over.append(f"{rel}: {n} lines (limit {limit})")
    assert not over, "split by responsibility:\n" + "\n".join(over)
    assert all((ROOT / rel).is_file() for rel in LIMITS)
