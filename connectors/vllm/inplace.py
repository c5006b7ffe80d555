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

:func:`start_in_place` is the asynchronous form, for a mover whose copies are
themselves asynchronous (the CUDA transfer engine): the engine thread enqueues every
chunk's DMA and goes on; :class:`InPlaceLoad` keeps the chunks held until the device
reports the copies done. A load thread cost about 7 ms a chunk on the H100 host, against
1 ms inside the step (docs/benchmarks.md, "On a CUDA engine"): each of its copies waits
on the device, then for the GIL, which vLLM's engine loop holds while the request waits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey
from kvtier.store.handles import HeldValue
from kvtier.store.store import TieredStore
from kvtier.transfer import TransferHandle

from .mover import BlockMover

log = logging.getLogger(__name__)
_announced = False


def enabled() -> bool:
    """``KVTIER_LOAD_IN_PLACE`` (default on): ``0``, ``off`` or ``false`` turn it off."""
    return os.environ.get("KVTIER_LOAD_IN_PLACE", "1").lower() not in ("0", "off", "false")


def _hold(
    store: object, mover: BlockMover, keys: Sequence[ChunkKey], chunk_bytes: int
) -> list[HeldValue] | None:
    """Every chunk of ``keys`` held in a memory tier, or None (and nothing held)."""
    if not isinstance(store, TieredStore) or not enabled():
        return None
    held: list[HeldValue] = []
    try:
        for key in keys:
            h = store.hold_value(key, max_bytes=chunk_bytes)
            if h is None or h.view.nbytes != chunk_bytes:
                if h is not None:
                    h.release()
                break  # absent, behind I/O, or not this geometry: staged path
            held.append(h)
        else:
            if mover.device.type != "cuda" or all(
                torch.frombuffer(h.view, dtype=torch.uint8).is_pinned() for h in held
            ):
                out, held = held, []
                return out
            # An arena that is not page-locked: DMA would bounce anyway.
    except Exception as exc:  # never a crash of the engine step: the staged path decides
        log.warning("kvtier in-place load failed, loading through staging: %s", exc)
    finally:
        for h in held:  # a held chunk cannot be evicted, and the store's close waits for it
            h.release()
    return None


def _runs(
    mover: BlockMover,
    held: Sequence[HeldValue],
    block_ids: Sequence[int],
    skip_blocks: int,
    blocks_per_chunk: int,
) -> Iterator[tuple[torch.Tensor, Sequence[int]]]:
    """(rows of one chunk, their blocks) for each chunk with blocks to write."""
    shape = (blocks_per_chunk, mover.num_layers, mover.page_bytes)
    for i, h in enumerate(held):
        first = i * blocks_per_chunk
        last = min(first + blocks_per_chunk, len(block_ids))
        lo = max(first, skip_blocks)
        if lo < last:
            row = torch.frombuffer(h.view, dtype=torch.uint8).view(shape)
            yield row[lo - first : last - first], block_ids[lo:last]


def _announce() -> None:
    global _announced
    if not _announced:
        _announced = True
        log.info("kvtier: loads read the host tier in place (no staging copy)")


def load_in_place(
    store: object,
    mover: BlockMover,
    keys: Sequence[ChunkKey],
    block_ids: Sequence[int],
    skip_blocks: int,
    blocks_per_chunk: int,
) -> bool:
    """Scatter every chunk of ``keys`` from a memory tier into ``block_ids``.

    Blocks until the blocks are written.

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
    held = _hold(store, mover, keys, blocks_per_chunk * mover.block_bytes)
    if held is None:
        return False
    try:
        for rows, ids in _runs(mover, held, block_ids, skip_blocks, blocks_per_chunk):
            mover.scatter(rows, ids)
    except (KVTierError, RuntimeError) as exc:
        log.warning("kvtier in-place load failed, loading through staging: %s", exc)
        return False
    finally:
        for h in held:
            h.release()
    _announce()
    return True


@dataclass(eq=False)
class InPlaceLoad:
    """A load :func:`start_in_place` enqueued: its chunks stay held until it is done."""

    held: list[HeldValue]
    handles: list[TransferHandle]

    def done(self) -> bool:
        """Whether the blocks hold every chunk's rows; the chunks are released once true.

        Never blocks. Called on the thread that started the load.
        """
        if not all(h.done() for h in self.handles):
            return False
        self.release()
        return True

    def finish(self) -> None:
        """Wait for the copies, then release the chunks (shutdown). They are released
        even when the wait raises (a device error), which is then raised."""
        try:
            for h in self.handles:
                h.wait()
        finally:
            self.release()

    def release(self) -> None:
        """Release the chunks now, done or not: only once no copy can still read them."""
        held, self.held, self.handles = self.held, [], []
        for h in held:
            h.release()


def start_in_place(
    store: object,
    mover: BlockMover,
    keys: Sequence[ChunkKey],
    block_ids: Sequence[int],
    skip_blocks: int,
    blocks_per_chunk: int,
) -> InPlaceLoad | None:
    """:func:`load_in_place`, enqueued on the mover's device and not waited for.

    Same arguments. Returns the load in flight, or None when nothing qualified (the
    mover copies only synchronously, a chunk is not held in a pinned memory tier) or
    enqueueing failed; then nothing is held or in flight, and the caller loads through
    staging.
    """
    if not mover.enqueues:
        return None
    held = _hold(store, mover, keys, blocks_per_chunk * mover.block_bytes)
    if held is None:
        return None
    load = InPlaceLoad(held, [])
    try:
        for rows, ids in _runs(mover, held, block_ids, skip_blocks, blocks_per_chunk):
            handle = mover.start_scatter(rows, ids)
            if handle is None:
                raise KVTierError(f"{type(mover).__name__} enqueued no copy")
            load.handles.append(handle)
    except Exception as exc:  # never a crash of the engine step: the staged path decides
        log.warning("kvtier in-place load failed, loading through staging: %s", exc)
        try:
            # A transfer that failed part-way left copies with no handle: the chunks are
            # released, and the staged path writes the blocks, only after every one.
            if mover.device.type == "cuda":
                torch.cuda.synchronize(mover.device)
        finally:
            load.release()
        return None
    _announce()
    return load
