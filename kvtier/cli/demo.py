"""``kvtier demo``: replay real prompts through the default store and verify every byte.

Context lengths and prefix reuse come from a Mooncake trace: each 512-token block id of
a request becomes 512 deterministic token ids, so requests that share block ids share
chunk keys, exactly as they would share KV. Each request looks up its prefix, loads the
hits into a buffer and checks them, then stores its new chunks. A second pass reloads the
most recent requests (now spread over the tiers) and checks them again.

KV bytes are random but reproducible from the chunk key, so a wrong or torn chunk is
always detected: every chunk's bytes are a slice of a random pool chosen by its key,
stamped with the key itself.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.cli.console import stdout_console
from kvtier.config import KVTierConfig
from kvtier.factory import build_store
from kvtier.keys import ChunkKey
from kvtier.store.types import StoreStats
from kvtier.units import format_size

TRACE_BLOCK_TOKENS = 512
# A shipped trace (kvtier/data/mooncake/): a clone or an installed kvtier has it.
DEFAULT_TRACE = "mooncake-conversation"
_POOL_BYTES = 64 << 20
# Chunks move in windows of at most this many bytes: the demo's memory stays bounded
# whatever the longest request (a 64K-token Llama-3-8B prompt is 8 GiB of KV).
WINDOW_BYTES = 128 << 20
# With the embedded default tiers, the demo's host tier is this large, so the whole run
# stays under 2 GiB of RSS (the shared-memory arena counts as it fills).
DEMO_HOST_BYTES = 1 << 30
# Unless the config has an nvme tier, the demo keeps one in this folder of the data
# directory (service.data_dir: --data-dir, KVTIER_DATA_DIR); it outlives the run, so a
# second run starts with the chunks the first one left. No data directory: memory only.
DEMO_SUBDIR = "demo-nvme"


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One replayed prompt: its token ids, derived from the trace's block ids."""

    tokens: npt.NDArray[Any]
    input_length: int


def load_requests(trace: str | Path, n: int) -> list[DemoRequest]:
    """The first ``n`` requests of a Mooncake trace (a shipped name or a file).

    Raises:
        InputError: the trace cannot be read or a line is malformed.
    """
    from kvtier.policies.trace import load_trace

    tr = load_trace(trace, limit=n)
    out: list[DemoRequest] = []
    for r in tr.requests:
        blocks = [_block_tokens(int(h)) for h in r.blocks]
        tokens = np.concatenate(blocks)[: r.input_tokens] if blocks else np.zeros(0, np.int32)
        out.append(DemoRequest(tokens, r.input_tokens))
    return out


def _demo_sized(cfg: KVTierConfig) -> KVTierConfig:
    """``cfg`` with a :data:`DEMO_HOST_BYTES` host tier when its tiers are the default ones."""
    from kvtier.config import load_config

    if cfg.tiers != load_config(None, env={}).tiers or cfg.tiers[0].kind != "host":
        return cfg  # the user chose the tiers
    top = dataclasses.replace(
        cfg.tiers[0], capacity_bytes=min(cfg.tiers[0].capacity_bytes, DEMO_HOST_BYTES)
    )
    return dataclasses.replace(cfg, tiers=(top, *cfg.tiers[1:]))


def _block_tokens(block_id: int) -> npt.NDArray[Any]:
    return np.random.default_rng(block_id).integers(
        0, 128000, size=TRACE_BLOCK_TOKENS, dtype=np.int32
    )


class ChunkBytes:
    """Reproducible random bytes for a chunk key (a keyed slice of a random pool)."""

    def __init__(self, chunk_bytes: int, seed: int) -> None:
        self.chunk_bytes = chunk_bytes
        pool = max(_POOL_BYTES, 2 * chunk_bytes)
        self.pool = np.random.default_rng(seed).integers(0, 256, size=pool, dtype=np.uint8)
        self._span = pool - chunk_bytes

    def fill(self, key: ChunkKey, out: npt.NDArray[Any]) -> None:
        start = (int.from_bytes(key[:8], "little") % (self._span // 64)) * 64
        out[:] = self.pool[start : start + self.chunk_bytes]
        out[:16] = np.frombuffer(key, dtype=np.uint8)


def run_demo(cfg: KVTierConfig, *, sequences: int, trace: str | Path | None, seed: int) -> bool:
    """Run the demo; True when every loaded byte verified."""
    console = stdout_console()
    trace_spec = trace or DEFAULT_TRACE
    reqs = load_requests(trace_spec, sequences)  # a bad trace fails before any allocation
    # The seed picks the demo's KV bytes, so it is part of the key namespace: a persistent
    # tier holding another seed's chunks must miss, not fail verification.
    cfg = _demo_sized(cfg)
    if cfg.service.data_dir:
        # The daemon's helper, imported here: the core imports no wing at module level.
        from kvtier.service.server import with_nvme_under

        where = Path(cfg.service.data_dir).expanduser() / DEMO_SUBDIR
        cfg = with_nvme_under(cfg, where, cfg.service.data_capacity_bytes)
    built = build_store(cfg, tenant=f"kvtier-demo-seed-{seed}")
    store, spec, hasher = built.store, built.spec, built.hasher
    chunk_tokens = cfg.store.chunk_tokens
    chunk_bytes = spec.chunk_bytes(chunk_tokens)
    source = f"{trace_spec} (first {len(reqs)} requests)"
    console.print(
        f"[bold]kvtier demo[/bold]: model {cfg.model.name} ({format_size(spec.bytes_per_token)}/token, "
        f"{format_size(chunk_bytes)}/chunk of {chunk_tokens} tokens), tiers "
        + ", ".join(f"{t.name}={format_size(t.capacity_bytes)}" for t in store.tiers)
        + f"; workload: {source}"
    )
    gen = ChunkBytes(chunk_bytes, seed)
    window = max(1, WINDOW_BYTES // chunk_bytes)
    buf = np.empty(window * chunk_bytes, dtype=np.uint8)
    expect = np.empty(chunk_bytes, dtype=np.uint8)
    bad = 0
    first = {"chunks": 0, "hits": 0}
    moved_bytes = 0
    t0 = time.perf_counter()

    def load_and_verify(keys: list[ChunkKey]) -> int:
        nonlocal bad, moved_bytes
        hits = store.lookup(keys).hits
        loaded = 0
        while loaded < hits:  # window by window: bounded memory
            part = keys[loaded : min(hits, loaded + window)]
            res = store.get(part, buf[: len(part) * chunk_bytes]).result()
            for i in range(res.chunks):
                gen.fill(part[i], expect)
                if not np.array_equal(buf[i * chunk_bytes : (i + 1) * chunk_bytes], expect):
                    bad += 1
            moved_bytes += res.nbytes
            loaded += res.chunks
            if res.chunks < len(part):  # evicted meanwhile: the rest is a miss
                break
        return loaded

    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("replaying requests", total=len(reqs))
            all_keys: list[list[ChunkKey]] = []
            for req in reqs:
                keys = hasher.keys(req.tokens)
                all_keys.append(keys)
                hits = load_and_verify(keys)
                first["chunks"] += len(keys)
                first["hits"] += hits
                for lo in range(hits, len(keys), window):
                    new = keys[lo : lo + window]
                    data = buf[: len(new) * chunk_bytes]
                    for i, k in enumerate(new):
                        gen.fill(k, data[i * chunk_bytes : (i + 1) * chunk_bytes])
                    store.put(new, data, prefix=keys[:lo]).result()
                    moved_bytes += data.nbytes
                progress.advance(task)
            second = {"chunks": 0, "hits": 0}
            task2 = progress.add_task("reloading, newest first", total=len(all_keys))
            for keys in reversed(all_keys):
                second["chunks"] += len(keys)
                second["hits"] += load_and_verify(keys)
                progress.advance(task2)
        elapsed = time.perf_counter() - t0
        _report(
            console,
            store.stats(),
            first,
            second,
            reqs,
            all_keys,
            chunk_tokens,
            elapsed,
            moved_bytes,
        )
        if cfg.store.placement != "keep":
            console.print(_placement_line(cfg.store.placement, store.stats()))
    finally:
        store.close()
    if bad:
        console.print(f"[red]FAILED: {bad} chunk(s) came back with wrong bytes[/red]")
        return False
    console.print("[green]every loaded chunk verified byte for byte[/green]")
    return True


def _placement_line(name: str, stats: StoreStats) -> str:
    """Why the placement kept victims out of the slower tiers, by the reasons it counted."""
    total: dict[str, float] = {}
    for c in stats.placement:
        total[c.name] = total.get(c.name, 0.0) + c.value
    reasons = ", ".join(
        f"{int(total.get(f'refused_{why}_chunks', 0))} {why}"
        for why in ("value", "colder", "budget")
    )
    return (
        f"placement {name!r} (victims kept out of a slower tier, by reason: {reasons}): "
        "victims with too little reuse evidence are dropped rather than written (SSD writes "
        "are a budget); --set store.placement=keep writes everything through, as the peers do"
    )


def _report(
    console: Console,
    stats: object,
    first: dict[str, int],
    second: dict[str, int],
    reqs: list[DemoRequest],
    all_keys: list[list[ChunkKey]],
    chunk_tokens: int,
    elapsed: float,
    moved_bytes: int,
) -> None:
    from kvtier.store.types import StoreStats

    assert isinstance(stats, StoreStats)
    t = Table(title="tiers")
    for col in (
        "tier",
        "kind",
        "capacity",
        "used",
        "extents",
        "ext. frag",
        "hits",
        "written",
        "read",
    ):
        t.add_column(col, justify="right" if col not in ("tier", "kind") else "left")
    hits = dict(stats.tier_hits)
    for ts in stats.tiers:
        kind = ts.kind + (" (emulated)" if ts.emulated else "")
        t.add_row(
            ts.name,
            kind,
            format_size(ts.capacity_bytes),
            format_size(ts.used_bytes),
            str(ts.allocated_extents),
            f"{ts.external_fragmentation:.1%}",
            str(hits.get(ts.name, 0)),
            format_size(ts.bytes_written),
            format_size(ts.bytes_read),
        )
    console.print(t)
    h = Table(title="hit rates (chunks)")
    for col in ("pass", "chunks", "hits", "hit rate"):
        h.add_column(col)
    for name, d in (("replay (trace order)", first), ("reload (newest first)", second)):
        rate = d["hits"] / d["chunks"] if d["chunks"] else 0.0
        h.add_row(name, str(d["chunks"]), str(d["hits"]), f"{rate:.1%}")
    console.print(h)
    f = Table(title="adaptive extents vs fixed pages on these prompts")
    for col in ("scheme", "entries/seq (mean)", "internal frag (mean)"):
        f.add_column(col)
    from kvtier.alloc import decompose

    lengths = [r.input_length for r in reqs]
    entries = [len(decompose(len(k), 30)) for k in all_keys]
    f.add_row(
        f"adaptive ({chunk_tokens}-token chunks)",
        f"{np.mean(entries):.1f}",
        f"{np.mean([(-n) % chunk_tokens / (n + (-n) % chunk_tokens) for n in lengths]):.2%}",
    )
    for page in (16, 256, 16384, 32768):
        pages = [-(-n // page) for n in lengths]
        waste = [(p * page - n) / (p * page) for p, n in zip(pages, lengths, strict=True)]
        f.add_row(f"fixed {page}-token pages", f"{np.mean(pages):.1f}", f"{np.mean(waste):.2%}")
    console.print(f)
    console.print(
        f"moved {format_size(moved_bytes)} in {elapsed:.1f} s; "
        f"demoted {stats.demoted_chunks}, promoted {stats.promoted_chunks}, dropped {stats.dropped_chunks} chunks"
    )
