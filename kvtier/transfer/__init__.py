"""The transfer engine: whole KV blocks between a paged device cache and host memory.

``PagedKV`` describes vLLM's per-layer KV tensors once; ``TransferEngine`` stores blocks
of every layer to a contiguous host buffer and loads them back, through bounded device
staging, with layer groups pipelined across CUDA streams and per-layer events for
layer-wise loading. The same code runs on CPU (operations complete as they are issued),
which is what CI tests; CUDA streams are imported only for a CUDA device.

Needs torch (imported by this package, not by the rest of the core).
"""

from kvtier.transfer.base import BlockMover, TransferHandle, TransferOptions
from kvtier.transfer.engine import TransferEngine, Unit, plan
from kvtier.transfer.layout import Layout, PagedKV, PageGeometry, describe, make_paged_cache

__all__ = [
    "BlockMover",
    "Layout",
    "PageGeometry",
    "PagedKV",
    "TransferEngine",
    "TransferHandle",
    "TransferOptions",
    "Unit",
    "describe",
    "make_paged_cache",
    "plan",
]
