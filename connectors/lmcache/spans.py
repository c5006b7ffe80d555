"""Loads into LMCache's memory objects in as few operations as their layout allows.

LMCache's local CPU allocator hands out consecutive objects of one chunk size back to
back in one buffer (0.5.6, ``TensorMemoryAllocator``). When a run of objects lies
contiguous, one kvtier get (one store operation, or one HTTP request) can fill them all
with the values packed, instead of one operation per chunk: the per-chunk overhead
(a thread hop, a request, an index lookup) was most of a small load's time. Objects
that are not contiguous (another allocator, a fragmented buffer) each form a span of
their own, so nothing depends on the layout for correctness.

Not thread-safe per call; the functions keep no state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Span:
    """Consecutive memory objects that one get fills, values packed.

    Attributes:
        start: index of the first object in the caller's list.
        count: objects covered.
        view: writable bytes over the objects, ``count * chunk_bytes`` long; the
            objects own the memory (it lives while they are referenced).
    """

    start: int
    count: int
    view: memoryview


def _tensor(obj: MemoryObj) -> torch.Tensor | None:
    t = getattr(obj, "raw_tensor", None)
    return t if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None


def spans(objs: Sequence[MemoryObj], chunk_bytes: int) -> list[Span]:
    """Group ``objs`` (each ``chunk_bytes`` long) into runs that lie back to back."""
    out: list[Span] = []
    i = 0
    while i < len(objs):
        t = _tensor(objs[i])
        j = i + 1
        if t is not None and t.is_contiguous():
            storage = t.untyped_storage()
            base = storage.data_ptr()
            start = t.data_ptr()
            while j < len(objs):
                u = _tensor(objs[j])
                if (
                    u is None
                    or u.untyped_storage().data_ptr() != base
                    or u.data_ptr() != start + (j - i) * chunk_bytes
                ):
                    break
                j += 1
            if j - i > 1 and start - base + (j - i) * chunk_bytes <= storage.nbytes():
                whole = torch.empty(0, dtype=torch.uint8).set_(
                    storage, start - base, ((j - i) * chunk_bytes,), (1,)
                )
                out.append(Span(i, j - i, whole.numpy().data.cast("B")))
                i = j
                continue
            j = i + 1
        out.append(Span(i, 1, objs[i].byte_array.cast("B")))
        i = j
    return out


def split(span_list: Sequence[Span], chunk_bytes: int, ways: int) -> list[Span]:
    """Cut each span into at most ``ways`` consecutive spans of whole chunks.

    For a transport where a few requests in flight beat one long one (the daemon reads
    one piece from its tier while the client receives another).
    """
    out: list[Span] = []
    for sp in span_list:
        step = max(1, -(-sp.count // ways))
        for k in range(0, sp.count, step):
            n = min(step, sp.count - k)
            out.append(Span(sp.start + k, n, sp.view[k * chunk_bytes : (k + n) * chunk_bytes]))
    return out


def collect(
    objs: Sequence[MemoryObj],
    results: Sequence[Sequence[int]],
    span_list: Sequence[Span],
    chunk_bytes: int,
    land: Callable[[MemoryObj, memoryview], MemoryObj],
) -> list[MemoryObj]:
    """The leading run of loaded objects; every other object is released.

    Args:
        objs: the objects the spans cover, in key order.
        results: for each span, the length in bytes of each value it received, in order
            (a prefix of the span's keys; fewer means a miss or a failed read).
        span_list: the spans, in order.
        chunk_bytes: a full chunk's length.
        land: the object a value makes, given the object it was read into and the
            value's bytes (in the span: a value longer than a chunk runs on into the
            next object's memory); e.g. LMCache's ``reshape_partial_chunk`` for the
            value's length. It may return another object, after releasing the one it
            was given; it raises ValueError for a value that is no chunk (a miss).

    A value of another length than a chunk (the prompt's partial last chunk) is kept and
    ends the run: the values after it in a packed span would sit at shifted offsets.
    """
    out: list[MemoryObj] = []
    broken = False
    for sp, lengths in zip(span_list, results, strict=True):
        for k in range(sp.count):
            obj = objs[sp.start + k]
            if not broken and k < len(lengths):
                n = lengths[k]
                try:
                    # Every value before this one in the span was a whole chunk.
                    out.append(land(obj, sp.view[k * chunk_bytes : k * chunk_bytes + n]))
                    broken = n != chunk_bytes
                    continue
                except ValueError as exc:
                    log.warning("kvtier under LMCache: malformed chunk, a miss: %s", exc)
            broken = True
            obj.ref_count_down()
    return out
