"""One kernel launch to fill or empty a staging slot, whatever its number of layers.

The staged pipeline (:mod:`kvtier.transfer.engine`) fills a slot (store) with one
``index_select`` per layer and empties it (load) with one ``index_copy_`` per layer. Each
launch costs host CPU before the first copy can start, and a short transfer (a few
thousand tokens of a many-layer model) waits for all of them, so it falls short of one
contiguous copy. This kernel moves the pages of every layer of a unit in ONE launch, HBM
to HBM; the copy engine still does the PCIe copy.

A table of layer base addresses (one int64 per layer, built once per cache) lets one
program reach any layer: a task is one slice of ``WORDS`` words of one run of one page,
``(layer, run, block)``, and a persistent grid of ``programs`` takes them in turn.

Tried and dropped: the same kernel reading and writing page-locked host memory directly
(no staging, one launch per transfer). Over PCIe the SMs moved the bytes slower than the
copy engine does, at nearly every size, and they took SMs from the model's own kernels
(concurrent matmuls ran slower).

Needs Triton (shipped with CUDA builds of torch). :func:`unavailable` says why the
kernel cannot run here; the engine then keeps one launch per layer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Words one program moves per slice of a run (a 64 KiB run of int64 words is 8 slices).
_WORDS = 1024


@functools.cache
def unavailable() -> str | None:
    """Why the copy kernels cannot run in this process, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # What varies per transfer (its block count and what follows from it, and the
    # alignment of the table and id slices a unit starts at) is not specialized on, so
    # a cache compiles two variants (store, load) once, whatever the transfers; its
    # strides, run size and the staging slot stay specialized (alignment hints).
    @triton.jit(  # type: ignore[untyped-decorator]
        do_not_specialize=["table", "ids", "n", "tasks", "h_layer", "h_run", "h_block"]
    )
    def copy_pages(  # type: ignore[no-untyped-def]
        table,
        ids,
        host,
        n,
        runs,
        s_run,
        s_block,
        h_layer,
        h_run,
        h_block,
        run_words,
        tasks,
        STORE: tl.constexpr,
        WORDS: tl.constexpr,
    ):
        # A persistent grid: program p takes tasks p, p + P, ... so a transfer occupies
        # only P multiprocessors, whatever its size (the model's kernels keep the rest).
        slices = tl.cdiv(run_words, WORDS)
        for t in range(tl.program_id(0), tasks, tl.num_programs(0)):
            row = t.to(tl.int64) // slices  # type: ignore[attr-defined]
            offs = (t % slices) * WORDS + tl.arange(0, WORDS)
            j = row % n
            lr = row // n
            r = lr % runs
            layer = lr // runs
            base = tl.load(table + layer).to(tl.pointer_type(host.dtype.element_ty))
            page = base + r * s_run + tl.load(ids + j) * s_block
            flat = host + (layer * h_layer + r * h_run + j * h_block) * run_words
            m = offs < run_words
            if STORE:
                tl.store(flat + offs, tl.load(page + offs, mask=m), mask=m)
            else:
                tl.store(page + offs, tl.load(flat + offs, mask=m), mask=m)

    return copy_pages


class LayerTable:
    """The device-side table of one cache's layer addresses, and their shared strides.

    Args:
        layers: the cache's word views (``PagedKV.layers``), all on one CUDA device.

    ``usable`` is False (with ``reason``) when the layers' word strides differ, which a
    single kernel cannot express; the engine then uses the staged pipeline.
    """

    def __init__(self, layers: list[torch.Tensor]) -> None:
        first = layers[0]
        self.s_run, self.s_block = first.stride(0), first.stride(1)
        self.reason: str | None = None
        if any(t.stride()[:2] != (self.s_run, self.s_block) for t in layers):
            self.reason = "layers of this cache have different strides"
        self.table = torch.tensor(
            [t.data_ptr() for t in layers], dtype=torch.int64, device=first.device
        )
        # Made once per cache, on whichever stream is current, and read later from the
        # engine's side streams: let the copy land before any of them can use it.
        if first.is_cuda:
            torch.cuda.current_stream(first.device).synchronize()

    @property
    def usable(self) -> bool:
        return self.reason is None


def compile_for(
    table: LayerTable,
    ids: torch.Tensor,
    stage: torch.Tensor,
    run_words: int,
    runs: int,
    programs: int,
) -> None:
    """Compile both directions for one cache now, without running them (Triton's
    ``warmup``), so the first transfer does not wait for the compiler."""
    for store in (True, False):
        launch(
            store,
            table,
            ids[:1],
            stage,
            first_layer=0,
            num_layers=1,
            runs=runs,
            n=1,
            run_words=run_words,
            block_major=False,
            programs=programs,
            compile_only=True,
        )


def compiled_variants() -> int | None:
    """How many variants of the kernel this process has compiled (None: this Triton
    does not say). For tests: transfers after :func:`compile_for` must add none."""
    caches = getattr(_kernel(), "device_caches", None)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())


def launch(
    store: bool,
    table: LayerTable,
    ids: torch.Tensor,
    stage: torch.Tensor,
    *,
    first_layer: int,
    num_layers: int,
    runs: int,
    n: int,
    run_words: int,
    block_major: bool,
    programs: int,
    words: int = _WORDS,
    warps: int = 4,
    compile_only: bool = False,
) -> None:
    """Enqueue, on the current stream, one copy of pages ``ids`` of layers
    ``[first_layer, first_layer + num_layers)`` into (``store``) or out of ``stage``.

    ``stage``: contiguous words, ``[layer][run][block]`` or, with ``block_major``,
    ``[block][layer][run]`` (the strides below count runs of ``run_words``);
    ``compile_only``: compile this variant, run nothing.
    """
    if block_major:
        h_layer, h_run, h_block = runs, 1, num_layers * runs
    else:
        h_layer, h_run, h_block = runs * n, n, 1
    tasks = num_layers * runs * n * -(-run_words // words)
    grid = (min(programs, tasks),)
    kernel = _kernel()
    run = functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]
    run(
        table.table[first_layer:],
        ids,
        stage,
        n,
        runs,
        table.s_run,
        table.s_block,
        h_layer,
        h_run,
        h_block,
        run_words,
        tasks,
        STORE=store,
        WORDS=words,
        num_warps=warps,
    )
