"""The transfer engine: whole KV blocks between a paged device cache and host memory.

``PagedKV`` describes vLLM's per-layer KV tensors once; ``TransferEngine`` stores blocks
of every layer to a contiguous host buffer and loads them back, through bounded device
staging, with layer groups pipelined across CUDA streams and per-layer events for
layer-wise loading. The same code runs on CPU (operations complete as they are issued),
which is what CI tests; CUDA streams are imported only for a CUDA device.

How an engine connector uses it (vLLM worker side)::

    # register_kv_caches(kv_caches): describe once, allocate staging once.
    kv = PagedKV.from_named(kv_caches)
    engine = TransferEngine(next(iter(kv_caches.values())).device, TransferOptions())

    # save: copy blocks of every layer into a pinned host slot (e.g. the host tier's
    # arena), then hand the bytes to the store once the handle is done.
    h = engine.store(kv, block_ids, host_bytes)

    # load: enqueue before the forward, then per attention layer
    h = engine.load(host_bytes, kv, block_ids)
    h.wait_for_layer(kv.layer_index(layer_name))   # in wait_for_layer_load(layer_name)

Host bytes are ``[layer][run][block][page bytes]`` (``kv.nbytes(n)`` of them), so a
chunk of blocks stored together is one contiguous value.

Needs torch (imported by this package, not by the rest of the core).
"""

from kvtier.transfer.base import HostOrder, PagedTransfer, TransferHandle, TransferOptions
from kvtier.transfer.engine import TransferEngine, Unit, plan
from kvtier.transfer.layout import Layout, PagedKV, PageGeometry, describe, make_paged_cache

__all__ = [
    "HostOrder",
    "Layout",
    "PageGeometry",
    "PagedKV",
    "PagedTransfer",
    "TransferEngine",
    "TransferHandle",
    "TransferOptions",
    "Unit",
    "describe",
    "make_paged_cache",
    "plan",
]
