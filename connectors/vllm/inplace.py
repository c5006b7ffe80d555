"""Loads straight from a host tier into vLLM's blocks, with no staging copy.

The worker's staged load copies a hit out of its tier into a staging buffer
(``store.get``: a CPU memcpy), then into the blocks. On a CUDA engine the host tier's
arena is itself page-locked (``cudaHostRegister``, :class:`kvtier.tiers.host.HostTier`),
so the GPU can read the chunks where they lie: each chunk is held in place
(:meth:`~kvtier.store.TieredStore.hold_value`: it cannot be evicted or reused while
held), scattered by the mover's DMA straight from the arena, then released. That takes
the CPU memcpy (4 GiB for a 32K-token Llama-3-8B prompt, about 0.3 s on the lent H100
hosts) off the time to first token. A CPU engine's blocks are host memory too: the
scatter copies from the arena once, instead of twice through staging.

Used only where every chunk of a load is in a memory tier (on CUDA, a pinned one);
anything else (a chunk in nvme, a daemon, a CUDA engine over an arena that is not
pinned) takes the staged path, as does a load that fails here. ``KVTIER_LOAD_IN_PLACE=0``
turns it off (the benchmark's A/B of the two paths).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey
from kvtier.store.handles import HeldValue
from kvtier.store.store import TieredStore

from .mover import BlockMover

log = logging.getLogger(__name__)
_announced = False


def enabled() -> bool:
    """``KVTIER_LOAD_IN_PLACE`` (default on): ``0``, ``off`` or ``false`` turn it off."""
    return os.environ.get("KVTIER_LOAD_IN_PLACE", "1").lower() not in ("0", "off", "false")


def load_in_place(
    store: object,
    mover: BlockMover,
    keys: Sequence[ChunkKey],
    block_ids: Sequence[int],
    skip_blocks: int,
    blocks_per_chunk: int,
) -> bool:
    """Scatter every chunk of ``keys`` from a memory tier into ``block_ids``.

    Called on the engine thread, before the forward; blocks until the blocks are written.

    Args:
        store: the worker's store (only a :class:`TieredStore` qualifies).
        mover: the worker's mover (a CUDA one needs a pinned tier).
        keys: rank keys of the chunks, in order.
        block_ids: their blocks, ``blocks_per_chunk`` per key, the last key's possibly
            fewer (its chunk's leading blocks only).
        skip_blocks: leading blocks not to write (vLLM's own prefix-cache hit).
        blocks_per_chunk: blocks per chunk.

    Returns:
        True when all of them were written; False when nothing qualified or a step
        failed (the caller then runs its staged load, which writes every block again).
    """
    global _announced
    if not isinstance(store, TieredStore) or not enabled():
        return False
    chunk_bytes = blocks_per_chunk * mover.block_bytes
    held: list[HeldValue] = []
    try:
        for key in keys:
            h = store.hold_value(key, max_bytes=chunk_bytes)
            if h is None or h.view.nbytes != chunk_bytes:
                if h is not None:
                    h.release()
                return False  # absent, behind I/O, or not this geometry: staged path
            held.append(h)
        rows = [torch.frombuffer(h.view, dtype=torch.uint8) for h in held]
        if mover.device.type == "cuda" and not all(r.is_pinned() for r in rows):
            return False  # an arena that is not page-locked: DMA would bounce anyway
        shape = (blocks_per_chunk, mover.num_layers, mover.page_bytes)
        for i, row in enumerate(rows):
            first = i * blocks_per_chunk
            last = min(first + blocks_per_chunk, len(block_ids))
            lo = max(first, skip_blocks)
            if lo >= last:
                continue
            mover.scatter(row.view(shape)[lo - first : last - first], block_ids[lo:last])
    except (KVTierError, RuntimeError) as exc:
        log.warning("kvtier in-place load failed, loading through staging: %s", exc)
        return False
    finally:
        for h in held:
            h.release()
    if not _announced:
        _announced = True
        log.info("kvtier: loads read the host tier in place (no staging copy)")
    return True
