"""The ``nvme`` tier's options and enums (a leaf: the package and the tier both read them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.enums import Switch
from kvtier.tiers.nvme.journal import Durability


class EngineKind(enum.Enum):
    """Which I/O engine moves the bytes (``uring`` was measured and dropped: docs/benchmarks.md)."""

    AUTO = "auto"
    KVIKIO = "kvikio"
    POSIX = "posix"


class Codec(enum.Enum):
    """Per-chunk compression of what goes to disk."""

    NONE = "none"
    LZ4_SHUFFLE = "lz4-shuffle"


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "nvme"`` options."""

    # Directories for the slab files, one per device or mount; the capacity is split
    # evenly between them. The index (checkpoint + journal) lives in the first one.
    paths: tuple[str, ...] = ()
    # Shorthand for one directory, used when ``paths`` is empty.
    dir: str = ""
    # Create missing directories instead of refusing to start.
    create_dirs: bool = False
    # I/O engine: auto (kvikio where libcuda and kvikio exist, else posix), kvikio, posix.
    engine: EngineKind = EngineKind.AUTO
    # O_DIRECT: auto (use it, fall back to buffered I/O + fdatasync where refused, with
    # a warning), on (refuse to start without it), off (buffered I/O).
    o_direct: Switch = Switch.AUTO
    # When a stored chunk becomes durable: sync (before put completes; group commit),
    # batch (within batch_interval_ms), none (when the OS writes it back).
    durability: Durability = Durability.SYNC
    # Commit period of durability = "batch", in milliseconds.
    batch_interval_ms: float = 50.0
    # Transfers in flight at once (engine threads).
    io_threads: int = 4
    # Large runs are split into transfers of this size, run in parallel.
    io_piece_bytes: int = 4 * 1024 * 1024
    # Reserve the slab files' whole capacity at start (posix_fallocate). False: slabs grow
    # with use, reserving 256 MiB steps ahead of the writes; either way a full disk fails
    # a new write (a miss), never a chunk already stored.
    preallocate: bool = False
    # Reopen what a previous run stored; false discards the old index at start.
    recover: bool = True
    # At start, read every recovered chunk and drop those whose checksum fails
    # (false: trust the index; reads verify anyway).
    verify_on_recover: bool = True
    # Compact the journal into a checkpoint once it holds this many records (and more
    # than twice the live ones).
    checkpoint_min_records: int = 65536
    # Compression of chunks on disk: none or lz4-shuffle (bf16/fp16 byte planes split).
    codec: Codec = Codec.NONE
    # Store a chunk compressed only when raw/compressed is at least this.
    codec_min_ratio: float = 1.1
    # Master key file (mode 0600) that seals every chunk with AES-256-GCM, a key per
    # tenant (kvtier.crypto). Empty: chunks in clear. Usually set by [encryption].
    encryption_key_file: str = ""


__all__ = ["Codec", "Durability", "EngineKind", "Options"]
