"""The ``redis`` tier's options (a leaf: the tier and its node pool both read them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.units import MiB


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "redis"`` options."""

    # A single Redis server: redis://[user:password@]host:port/db (rediss:// for TLS).
    url: str = "redis://127.0.0.1:6379/0"
    # Redis Cluster seed nodes as "host:port"; when set, the tier runs in cluster mode
    # and ``url`` is ignored.
    cluster_nodes: tuple[str, ...] = ()
    # First part of every Redis key; tenant and KV spec fingerprint follow it.
    key_prefix: str = "kvtier"
    # Expire a value this many seconds after its last write or read (sliding); 0 keeps
    # values until Redis evicts them under maxmemory.
    ttl_s: float = 0.0
    # The longest a probe (lookup) or a read waits on Redis, in seconds; past it the
    # chunks are misses. Size it to the largest read the engine makes.
    op_budget_s: float = 2.0
    # The longest a write waits, in seconds (writes run on the store's I/O threads).
    write_budget_s: float = 30.0
    # Bound on one TCP connect, and on one wait for a socket read or write, in seconds.
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 2.0
    # Bytes of values in one pipelined round trip to one node. A few MiB keeps the
    # client's and the server's buffers in cache; far larger batches ran slower.
    batch_bytes: int = 8 * MiB
    # Reconnect backoff of a failed node: doubles from min to max, in seconds.
    backoff_min_s: float = 0.05
    backoff_max_s: float = 5.0
    # Value codec: "none", or "lz4-shuffle" (kvtier.codec: lz4 over byte planes; pays
    # where the network is the bottleneck and the KV compresses). Needs lz4.
    codec: str = "none"
    # Bytes per KV element for the lz4 byte-plane shuffle (2 for fp16/bf16, 1 for fp8).
    codec_element_bytes: int = 2
    # Threads that run the per-node parts of one batch in parallel; each that reads
    # keeps a buffer as large as the largest value it has read.
    fanout_threads: int = 8
    # Connections one node's part of a batch is spread over, in parallel.
    streams_per_node: int = 2
    # Master key file (mode 0600) that seals every value with AES-256-GCM, a key per
    # tenant (kvtier.crypto). Empty: values in clear. Usually set by [encryption].
    encryption_key_file: str = ""

    def __post_init__(self) -> None:
        positive = (
            "op_budget_s",
            "write_budget_s",
            "connect_timeout_s",
            "socket_timeout_s",
            "backoff_min_s",
            "backoff_max_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "a positive number of seconds")
        if self.ttl_s < 0:
            raise ConfigError("ttl_s", self.ttl_s, "0 (no expiry) or a positive number of seconds")
        if self.backoff_max_s < self.backoff_min_s:
            raise ConfigError(
                "backoff_max_s", self.backoff_max_s, f">= backoff_min_s ({self.backoff_min_s})"
            )
        if self.batch_bytes < 1:
            raise ConfigError("batch_bytes", self.batch_bytes, "a positive size")
        if not 1 <= self.streams_per_node <= 64:
            raise ConfigError("streams_per_node", self.streams_per_node, "an integer in [1, 64]")
        if not 1 <= self.fanout_threads <= 256:
            raise ConfigError("fanout_threads", self.fanout_threads, "an integer in [1, 256]")
        if self.codec not in ("none", "lz4-shuffle"):
            raise ConfigError("codec", self.codec, "none or lz4-shuffle")
        if self.codec_element_bytes not in (1, 2, 4):
            raise ConfigError("codec_element_bytes", self.codec_element_bytes, "1, 2 or 4")
        if not self.key_prefix:
            raise ConfigError("key_prefix", self.key_prefix, "a non-empty string")
