"""What travels between the connector's two sides, and its stats.

The scheduler side (EngineCore process) and the worker side (one per worker process)
share no memory: scheduler-to-worker data rides in :class:`KVTierMetadata` (pickled
into every step's scheduler output), worker-to-scheduler data in
:class:`KVTierWorkerMeta` (aggregated over the workers by vLLM, then handed to the
scheduler's ``update_connector_output``). Both are plain dataclasses of bytes, ints and
strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .mirror import IndexUpdate


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Load chunks from kvtier into a request's blocks, before this step's forward.

    Attributes:
        req_id: vLLM's internal request id.
        keys: logical keys of the chunks, in prompt order (a hybrid model: the keys of
            one group's entries, groups.py).
        block_ids: the blocks of those chunks (a group's ``tail_blocks`` per key: every
            entry is read whole), in order;
            ``groups.NULL`` where nothing is written. The last key's may be fewer: its
            leading blocks only, where the request's tokens end inside its chunk (a
            chunk's KV is valid KV of any prefix of it).
        skip_blocks: leading blocks that already hold vLLM's own prefix-cache hit; their
            bytes are read but not written (a chunk is the unit of lookup, a block is the
            unit of vLLM's cache).
        group: vLLM's KV-cache group of the blocks (0 for a model of one group).
        asynchronous: the load runs off the engine step (a slow tier): the request waits
            in vLLM's WAITING_FOR_REMOTE_KVS until the worker reports it in
            ``finished_recving``; otherwise it completes before this step's forward.
    """

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    skip_blocks: int
    group: int = 0
    asynchronous: bool = False


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Save chunks that this step completes, from a request's blocks.

    Attributes:
        req_id: vLLM's internal request id; its blocks stay allocated until the worker
            reports it in ``finished_sending``.
        keys: logical keys of the chunks (a hybrid model: one group's entry keys).
        block_ids: their blocks, ``blocks_per_chunk`` per key (or the group's
            ``tail_blocks``), in order.
        prefix: logical keys of the request's earlier chunks (saved by earlier steps,
            loaded, or already stored): the put protects them while it makes room, so a
            prompt longer than the store keeps its head, not a tail no lookup reaches.
        group: vLLM's KV-cache group of the blocks (0 for a model of one group).
    """

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    prefix: tuple[bytes, ...] = ()
    group: int = 0


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    # Requests preempted this step: their blocks are freed now, so the worker finishes
    # their pending saves before the blocks are zeroed or reused (handle_preemptions).
    preempted: frozenset[str] = frozenset()


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker to scheduler, once per step, summed over workers by :meth:`aggregate`.

    Attributes:
        stored: logical key -> number of ranks on which it is now stored.
        failed: logical key -> number of ranks on which its save failed or was declined.
        missing: logical keys a load did not find (evicted, or a tier failed).
        salts: daemon mode only: the rank-key salts of the workers (settings.rank_salt),
            so the scheduler side can ask the daemon for other engines' chunks.
        index: embedded stores only: rank-key salt -> that rank's store index changes
            (its start-up snapshot first), for the scheduler's mirror (mirror.py).
    """

    stored: dict[bytes, int] = field(default_factory=dict)
    failed: dict[bytes, int] = field(default_factory=dict)
    missing: set[bytes] = field(default_factory=set)
    salts: frozenset[bytes] = frozenset()
    index: dict[bytes, IndexUpdate] = field(default_factory=dict)

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta)
        out = KVTierWorkerMeta(
            dict(self.stored),
            dict(self.failed),
            set(self.missing),
            self.salts | other.salts,
            {**self.index, **other.index},  # one entry per rank: salts differ
        )
        for k, n in other.stored.items():
            out.stored[k] = out.stored.get(k, 0) + n
        for k, n in other.failed.items():
            out.failed[k] = out.failed.get(k, 0) + n
        out.missing |= other.missing
        return out

    def is_empty(self) -> bool:
        return not (self.stored or self.failed or self.missing or self.salts or self.index)


# Counters both sides report; all are sums over the interval and over workers.
STAT_KEYS = (
    # scheduler side
    "lookups",  # requests looked up (once per scheduled request)
    "lookup_tokens",  # prompt tokens looked up
    "hit_tokens",  # tokens kvtier will load, beyond vLLM's own prefix-cache hit
    # worker side
    "load_chunks",
    "load_tokens",
    "load_bytes",
    "load_s",
    "load_failed_blocks",  # blocks reported through get_block_ids_with_load_errors
    "load_async",  # loads run off the engine step (their request waited, the batch went on)
    "load_enqueued",  # of those, copied by the device straight from a pinned memory tier
    "load_sync_slow_chunks",  # chunks a synchronous load read from below the memory tiers
    "save_chunks",
    "save_tokens",
    "save_bytes",
    "save_s",
    "save_failed_chunks",
)


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """kvtier's counters in vLLM's connector-stats channel.

    ``data`` maps every name of :data:`STAT_KEYS` to a number, plus
    ``tier_used_bytes.<tier>`` gauges from the worker's store (summed over ranks).
    """

    @override
    def reset(self) -> None:
        self.data = {}

    @override
    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if k.startswith("tier_used_bytes."):
                self.data[k] = v if k not in self.data else self.data[k] + v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    @override
    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: v for k, v in self.data.items() if isinstance(v, int | float)
        }
        if out.get("load_s"):
            out["load_GBps"] = out.get("load_bytes", 0) / out["load_s"] / 1e9
        if out.get("save_s"):
            out["save_GBps"] = out.get("save_bytes", 0) / out["save_s"] / 1e9
        return out

    @override
    def is_empty(self) -> bool:
        return not any(self.data.values())

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVTierConnectorStats:
        return cls(data=dict(data or {}))
