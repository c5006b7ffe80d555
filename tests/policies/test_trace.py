"""Trace loading: Mooncake lines, errors that name the line and field, synthetic traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import InputError
from kvtier.policies.trace import SyntheticWorkload, load_trace


def test_reads_the_conversation_trace_head() -> None:
    tr = load_trace("mooncake-conversation", limit=50)
    assert len(tr.requests) == 50
    r = tr.requests[0]
    assert r.t_s == 0.0 and len(r.blocks) == -(-r.input_tokens // 512)
    assert len(tr.full_blocks(r)) == r.input_tokens // 512


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": 1, "input_length": 10}', ":2: field 'hash_ids'"),
        ('{"timestamp": -5, "input_length": 10, "hash_ids": []}', ":2: field 'timestamp'"),
        ('{"timestamp": 1, "input_length": "x", "hash_ids": [1]}', ":2: field 'input_length'"),
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [1, "a"]}', ":2: field 'hash_ids'"),
        ("not json", ":2: not valid JSON"),
        ("[1, 2]", ":2: expected a JSON object"),
    ],
)
def test_malformed_lines_name_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(InputError) as err:
        load_trace(f)
    assert needle in str(err.value)


def test_missing_file_and_empty_trace(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(InputError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")


def test_synthetic_workload_is_deterministic_and_shares_prefixes() -> None:
    a = SyntheticWorkload(requests=200, seed=3).build()
    b = SyntheticWorkload(requests=200, seed=3).build()
    assert a == b
    assert len({r.blocks[0] for r in a.requests}) == 1  # the shared system prompt
    with pytest.raises(InputError):
        SyntheticWorkload(requests=0).build()
