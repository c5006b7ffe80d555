"""Workloads: Mooncake-format trace files, and synthetic traces with the same shape.

A trace line is one JSON object::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, ...]}

``timestamp`` is milliseconds from the trace start; ``hash_ids`` holds one id per
512-token block of the input, prefix-chained (equal ids at one position mean equal KV
of that block and of every block before it). The last block is usually partial.

Bad lines raise :class:`~kvtier.errors.InputError` naming the file, the line and the
field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import InputError
from kvtier.traces import open_trace, resolve_trace, trace_name

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    Attributes:
        t_s: arrival, seconds from the trace start.
        input_tokens: prompt length.
        output_tokens: generated length.
        blocks: prefix-chained block ids, one per ``block_tokens`` of the prompt.
    """

    t_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A workload: requests in arrival order."""

    name: str
    requests: tuple[Request, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def duration_s(self) -> float:
        """Span of arrivals (at least one second, so rates stay finite)."""
        if not self.requests:
            return 1.0
        return max(self.requests[-1].t_s - self.requests[0].t_s, 1.0)

    def full_blocks(self, r: Request) -> tuple[int, ...]:
        """The blocks of ``r`` a cache can hold: only full blocks (an engine never stores
        a partial one)."""
        return r.blocks[: r.input_tokens // self.block_tokens]

    def unique_full_blocks(self) -> int:
        seen: set[int] = set()
        for r in self.requests:
            seen.update(self.full_blocks(r))
        return len(seen)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return Trace(f"{self.name}[:{n}]", self.requests[:n], self.block_tokens)


def _field(obj: dict[str, object], name: str, where: str) -> object:
    if name not in obj:
        raise InputError(f"{where}: field {name!r} is missing")
    return obj[name]


def _int(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InputError(f"{where}: field {name!r} must be a non-negative number, got {value!r}")
    return int(value)


def load_trace(path: str | Path, *, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace (``.jsonl`` or ``.jsonl.gz``).

    Args:
        path: the file, or a shipped trace's name (``mooncake-conversation``,
            ``mooncake-synthetic``; see :mod:`kvtier.traces`).
        limit: read only the first ``limit`` requests.

    Raises:
        InputError: unreadable file, or a malformed line (named with its number and field).
    """
    p = resolve_trace(path)
    requests: list[Request] = []
    fh = open_trace(p)
    try:
        with fh:
            for lineno, line in enumerate(fh, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                requests.append(_request(line, f"{p}:{lineno}"))
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # a bad .gz fails on read
        raise InputError(f"cannot read trace {p}: {exc}") from exc
    if not requests:
        raise InputError(f"{p}: no requests in the trace")
    requests.sort(key=lambda r: r.t_s)
    return Trace(trace_name(p), tuple(requests))


def _request(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise InputError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = _field(obj, "timestamp", where)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise InputError(f"{where}: field 'timestamp' must be ms >= 0, got {ts!r}")
    n_in = _int(_field(obj, "input_length", where), "input_length", where)
    n_out = _int(obj.get("output_length", 0), "output_length", where)
    ids = _field(obj, "hash_ids", where)
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise InputError(f"{where}: field 'hash_ids' must be a list of integers")
    return Request(float(ts) / 1000.0, n_in, n_out, tuple(ids))


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Parameters of a synthetic multi-turn workload (when no trace is given).

    Attributes:
        requests: how many requests.
        rate_per_s: Poisson arrival rate.
        system_prompt_tokens: a prefix every request shares.
        conversations: concurrent conversations; each request continues one of them.
        turn_tokens: mean new tokens a turn adds (exponential).
        max_context_tokens: a conversation restarts beyond this.
        seed: random seed.
    """

    requests: int = 2000
    rate_per_s: float = 4.0
    system_prompt_tokens: int = 2048
    conversations: int = 300
    turn_tokens: int = 1500
    max_context_tokens: int = 64000
    seed: int = 0

    def build(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
        """Generate the trace (deterministic for a seed)."""
        for name in ("requests", "conversations", "turn_tokens", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"synthetic workload: {name} must be >= 1")
        if self.rate_per_s <= 0:
            raise InputError("synthetic workload: rate_per_s must be > 0")
        rng = np.random.default_rng(self.seed)
        next_id = 0
        sys_blocks = []
        for _ in range(self.system_prompt_tokens // block_tokens):
            sys_blocks.append(next_id)
            next_id += 1
        ctx: list[list[int]] = [list(sys_blocks) for _ in range(self.conversations)]
        lengths = [len(sys_blocks) * block_tokens] * self.conversations
        t = 0.0
        out: list[Request] = []
        for _ in range(self.requests):
            t += float(rng.exponential(1.0 / self.rate_per_s))
            c = int(rng.integers(self.conversations))
            add = max(int(rng.exponential(self.turn_tokens)), 1)
            if lengths[c] + add > self.max_context_tokens:
                ctx[c] = list(sys_blocks)
                lengths[c] = len(sys_blocks) * block_tokens
            lengths[c] += add
            while len(ctx[c]) < -(-lengths[c] // block_tokens):
                ctx[c].append(next_id)
                next_id += 1
            out.append(Request(t, lengths[c], 200, tuple(ctx[c])))
            # The next turn carries this one's answer too.
            lengths[c] += 200
        return Trace("synthetic", tuple(out), block_tokens)
