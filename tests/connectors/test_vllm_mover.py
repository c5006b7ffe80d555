"""The connector's block movers: whole-block, byte-exact, on CPU and CUDA.

Imports no vLLM (the CUDA device that runs the ``gpu`` cases may not have it): the
tensors are shaped and strided the way vLLM 0.32 registers its KV caches. The CUDA cases
skip with the reason where torch sees no CUDA device.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvtier.connectors.vllm import mover as mover_mod  # noqa: E402
from kvtier.connectors.vllm.mover import (  # noqa: E402
    EngineBlockMover,
    TorchBlockMover,
    layout_tag,
    page_view,
    select_mover,
)
from kvtier.errors import InputError, SpecError  # noqa: E402
from kvtier.transfer import Layout, TransferOptions, make_paged_cache  # noqa: E402

NB, H, N, HS = 9, 2, 32, 64  # blocks, kv heads, block size, head size


def lbhnc(layers: int, device: str = "cpu") -> list[torch.Tensor]:
    """CPU backend: one storage, per layer [blocks, heads, block_size, 2*head_size]."""
    whole = torch.randn(layers, NB, H, N, 2 * HS).to(torch.bfloat16).to(device)
    return [whole[i] for i in range(layers)]


def lbnhc(layers: int, device: str = "cpu") -> list[torch.Tensor]:
    """CUDA FlashAttention default: physical [blocks, block_size, heads, C], logical BHNC."""
    whole = torch.randn(layers, NB, N, H, 2 * HS).to(torch.bfloat16).to(device)
    return [whole[i].transpose(1, 2) for i in range(layers)]


def lhbnc(layers: int, device: str = "cpu") -> list[torch.Tensor]:
    """A layout that splits a block across heads: the mover's logical fallback."""
    whole = torch.randn(layers, H, NB, N, 2 * HS).to(torch.bfloat16).to(device)
    return [whole[i].transpose(0, 1) for i in range(layers)]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [lbhnc, lbnhc, lhbnc])
def test_gather_then_scatter_moves_whole_blocks(make, device) -> None:
    src = make(3, device)
    dst = [torch.zeros_like(t) for t in src]
    mover_src, mover_dst = TorchBlockMover(src), TorchBlockMover(dst)
    blocks_out, blocks_in = [5, 2, 7], [1, 8, 3]

    staging = mover_src.gather(blocks_out, mover_src.mark())
    assert staging.device.type == "cpu"
    mover_dst.scatter(staging, blocks_in)
    if device == "cuda":
        torch.cuda.synchronize()

    assert staging.shape == (3, 3, H * N * 2 * HS * 2)
    for s, d in zip(src, dst, strict=True):
        for b_out, b_in in zip(blocks_out, blocks_in, strict=True):
            assert torch.equal(d[b_in], s[b_out])
        untouched = [b for b in range(NB) if b not in blocks_in]
        assert not d[untouched].any()


def test_torch_mover_moves_bytes_through_unaligned_staging_and_odd_pages() -> None:
    """Staging at an odd byte offset (memory shared with a daemon) and pages that are no
    multiple of a word move the same bytes as aligned ones."""
    src = lbhnc(3)
    dst = [torch.zeros_like(t) for t in src]
    mover_src, mover_dst = TorchBlockMover(src), TorchBlockMover(dst)
    blocks_out, blocks_in = [5, 2, 7], [1, 8, 3]
    shape = (3, 3, mover_src.page_bytes)
    raw = torch.zeros(1 + 3 * 3 * mover_src.page_bytes, dtype=torch.uint8)
    odd = raw[1:].view(shape)
    staging = mover_src.gather(blocks_out, out=odd)
    assert staging.data_ptr() == odd.data_ptr()
    assert torch.equal(odd, mover_src.gather(blocks_out))
    mover_dst.scatter(odd, blocks_in)
    for s, d in zip(src, dst, strict=True):
        for b_out, b_in in zip(blocks_out, blocks_in, strict=True):
            assert torch.equal(d[b_in], s[b_out])

    odd_pages = [torch.randint(0, 255, (NB, 3, 5), dtype=torch.uint8) for _ in range(2)]
    copies = [torch.zeros_like(t) for t in odd_pages]
    TorchBlockMover(copies).scatter(TorchBlockMover(odd_pages).gather([4, 0]), [6, 1])
    for s, d in zip(odd_pages, copies, strict=True):
        assert torch.equal(d[6], s[4]) and torch.equal(d[1], s[0])


# -- the transfer engine behind the connector's mover interface (CUDA) ----------------------

POISON = 0xA5
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a CUDA device (torch {torch.__version__} sees none)",
)
# Slots of 8 KiB: one block of 3 layers (3 x 16 KiB for bf16) spans several units, so the
# engine's split path is what these tests move; SLOTS_WIDE groups several blocks a unit.
SLOTS_NARROW = TransferOptions(staging_bytes=2 * 16384, slots=2, ramp_bytes=0)
SLOTS_WIDE = TransferOptions(staging_bytes=3 * 65536 * 2, slots=3, ramp_bytes=16384)


def blhnc(layers: int, device: str = "cpu") -> list[torch.Tensor]:
    """vLLM's cross-layer layout: all layers of a block adjacent."""
    return make_paged_cache(
        Layout.BLHNC,
        num_layers=layers,
        num_blocks=NB,
        block_size=N,
        num_kv_heads=H,
        head_size=HS,
        dtype=torch.bfloat16,
        device=device,
    )


def _fill_bytes(layers: list[torch.Tensor], value: int | None, seed: int = 0) -> None:
    """Random bytes (value None) or one byte value over every layer's whole storage."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for t in layers:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        if value is None:
            raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
        else:
            raw.fill_(value)


def _page(t: torch.Tensor, b: int) -> bytes:
    """Block ``b`` of one layer in memory order, from the logical tensor alone."""
    v = t[b].view(torch.int16)
    order = sorted(range(v.dim()), key=lambda d: -v.stride(d))
    return v.permute(order).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _rows(layers: list[torch.Tensor], blocks: list[int]) -> bytes:
    """The connector's staging bytes for ``blocks``: [block][layer][page]."""
    return b"".join(_page(t, b) for b in blocks for t in layers)


@pytest.mark.parametrize("options", [SLOTS_NARROW, SLOTS_WIDE], ids=["narrow", "wide"])
@pytest.mark.parametrize("make", [lbhnc, lbnhc, blhnc])
@pytest.mark.gpu
@needs_cuda
def test_engine_mover_round_trip_is_byte_exact(make, options) -> None:
    src = make(3, "cuda")
    _fill_bytes(src, None, seed=1)
    mover = select_mover(src, options)
    assert isinstance(mover, EngineBlockMover)
    assert mover.layout == TorchBlockMover(src).layout  # same bytes, so same keys
    blocks_out = [5, 2, 7, 0, 8]

    staging = mover.gather(blocks_out, mover.mark())
    assert staging.device.type == "cpu" and staging.is_pinned()
    assert staging.shape == (5, 3, H * N * 2 * HS * 2)
    assert staging.numpy().tobytes() == _rows(src, blocks_out)
    # The portable mover stages the very same bytes.
    assert torch.equal(staging, TorchBlockMover(src).gather(blocks_out))

    # Scatter rows 1.. (as a load that skips a prefix-cache hit does) into poisoned blocks.
    dst = make(3, "cuda")
    _fill_bytes(dst, POISON)
    blocks_in = [1, 8, 3, 4, 6]
    select_mover(dst, options).scatter(staging[1:], blocks_in[1:])
    assert _rows(dst, blocks_in[1:]) == _rows(src, blocks_out[1:])
    rest = [b for b in range(NB) if b not in blocks_in[1:]]
    assert _rows(dst, rest) == bytes([POISON]) * (len(rest) * 3 * staging.shape[2])


@pytest.mark.gpu
@needs_cuda
def test_engine_and_torch_movers_read_each_others_staging() -> None:
    src = lbnhc(4, "cuda")
    _fill_bytes(src, None, seed=2)
    blocks = [3, 6, 1]
    by_engine = EngineBlockMover(src, SLOTS_NARROW).gather(blocks)
    by_torch = TorchBlockMover(src).gather(blocks)
    for staging, writer in ((by_engine, TorchBlockMover), (by_torch, EngineBlockMover)):
        dst = lbnhc(4, "cuda")
        _fill_bytes(dst, POISON)
        mover = writer(dst) if writer is TorchBlockMover else writer(dst, SLOTS_NARROW)
        mover.scatter(staging, [0, 2, 5])
        torch.cuda.synchronize()
        assert _rows(dst, [0, 2, 5]) == _rows(src, blocks)
        assert _rows(dst, [1, 3, 4, 6, 7, 8]) == bytes([POISON]) * (6 * 4 * staging.shape[2])


@pytest.mark.gpu
@needs_cuda
def test_engine_mover_gather_waits_for_the_marked_step() -> None:
    """Writes queued on the engine thread's stream before mark() are what gather sees."""
    src = lbnhc(2, "cuda")
    _fill_bytes(src, POISON)
    mover = EngineBlockMover(src, SLOTS_WIDE)
    torch.cuda._sleep(200_000_000)  # keeps the stream busy well past the gather's start
    for t in src:
        t[4].fill_(3.0)
    token = mover.mark()
    out: list[torch.Tensor] = []
    saver = threading.Thread(target=lambda: out.append(mover.gather([4], token)))
    saver.start()
    saver.join()
    assert out[0].numpy().tobytes() == _rows(src, [4])
    assert set(out[0].numpy().tobytes()) != {POISON}


@pytest.mark.gpu
@needs_cuda
def test_refused_cuda_layout_falls_back_to_torch_and_logs_once(caplog, monkeypatch) -> None:
    monkeypatch.setattr(mover_mod, "_fallback_logged", False)
    with caplog.at_level("WARNING", logger=mover_mod.__name__):
        first = select_mover(lhbnc(2, "cuda"))  # head-outer: blocks are not byte runs
        tiny = TransferOptions(staging_bytes=2 * 4096, slots=2)
        second = select_mover(lbnhc(2, "cuda"), tiny)  # one page is larger than a slot
    assert type(first) is TorchBlockMover and type(second) is TorchBlockMover
    assert len([r for r in caplog.records if "refuses" in r.getMessage()]) == 1
    # The fallback still moves whole blocks correctly (the logical path for LHBNC).
    src = lhbnc(2, "cuda")
    dst = lhbnc(2, "cuda")
    _fill_bytes(dst, POISON)
    TorchBlockMover(dst).scatter(TorchBlockMover(src).gather([2, 7]), [2, 7])
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[2, 7]], s[[2, 7]])


def test_cpu_caches_keep_the_torch_mover() -> None:
    assert type(select_mover(lbhnc(2))) is TorchBlockMover
    with pytest.raises(InputError, match="CUDA"):
        EngineBlockMover(lbhnc(2))


def test_page_view_only_for_block_compact_layouts() -> None:
    assert page_view(lbhnc(1)[0]) is not None
    assert page_view(lbnhc(1)[0]) is not None
    assert page_view(lhbnc(1)[0]) is None
    tags = {layout_tag(lbhnc(1)[0]), layout_tag(lbnhc(1)[0]), layout_tag(lhbnc(1)[0])}
    assert len(tags) == 3  # bytes of different layouts never share a key


def test_mover_refuses_unequal_layers() -> None:
    with pytest.raises(SpecError):
        TorchBlockMover([torch.zeros(4, 2, 32, 128), torch.zeros(4, 1, 32, 128)])


def test_a_cpu_load_scatters_straight_from_the_host_tier(monkeypatch) -> None:
    """The in-place load on a CPU engine: the blocks get the stored bytes, skipped blocks
    (vLLM's own hit) stay as they were; switched off, the caller's staged path runs."""
    import numpy as np

    from kvtier.config import load_config
    from kvtier.connectors.vllm.inplace import load_in_place
    from kvtier.factory import build_store
    from kvtier.spec import KVSpec

    src = lbhnc(3)
    dst = [torch.zeros_like(t) for t in src]
    mover = TorchBlockMover(dst)
    bpc = 2
    chunk = bpc * mover.block_bytes
    cfg = load_config(None, env={}, overrides=["tiers.0.capacity_bytes=1MiB"])
    store = build_store(cfg, spec=KVSpec(3, H, HS), chunk_bytes=chunk).store
    try:
        keys = [bytes([i]) * 16 for i in range(2)]
        staged = TorchBlockMover(src).gather([0, 1, 2, 3])
        store.put(keys, np.ascontiguousarray(staged.numpy())).result()
        assert load_in_place(store, mover, keys, [4, 5, 6, 7], 1, bpc)
        for s, d in zip(src, dst, strict=True):
            assert not d[4].any()  # skipped: vLLM's own prefix-cache hit
            for b_src, b_dst in ((1, 5), (2, 6), (3, 7)):
                assert torch.equal(d[b_dst], s[b_src])
        assert not load_in_place(store, mover, [bytes([9]) * 16], [8, 0], 0, bpc)  # absent
        monkeypatch.setenv("KVTIER_LOAD_IN_PLACE", "0")
        assert not load_in_place(store, mover, keys, [4, 5, 6, 7], 0, bpc)
    finally:
        store.close()


def _two_chunks(staged: torch.Tensor) -> tuple[Any, list[bytes]]:
    """A host-tier store holding ``staged`` (four blocks) as two chunks, and their keys."""
    import numpy as np

    from kvtier.config import load_config
    from kvtier.factory import build_store
    from kvtier.spec import KVSpec

    cfg = load_config(None, env={}, overrides=["tiers.0.capacity_bytes=1MiB"])
    store = build_store(cfg, spec=KVSpec(3, H, HS), chunk_bytes=staged.nbytes // 2).store
    keys = [bytes([i]) * 16 for i in range(2)]
    store.put(keys, np.ascontiguousarray(staged.numpy())).result()
    return store, keys


def test_a_cpu_mover_enqueues_no_load() -> None:
    """Only a mover with copy engines of its own takes an asynchronous load on the
    engine thread; a CPU one answers None, holding nothing, and the load thread runs it."""

    from kvtier.connectors.vllm.inplace import start_in_place

    src = lbhnc(3)
    mover = TorchBlockMover([torch.zeros_like(t) for t in src])
    assert not mover.enqueues
    store, keys = _two_chunks(TorchBlockMover(src).gather([0, 1, 2, 3]))
    try:
        assert start_in_place(store, mover, keys, [4, 5, 6, 7], 0, 2) is None
        assert store.stats().get_chunks == 0  # nothing was held (a release counts a get)
    finally:
        store.close()


@pytest.mark.gpu
@needs_cuda
def test_an_enqueued_load_is_done_only_when_the_blocks_hold_the_chunks() -> None:
    """The CUDA engine's asynchronous in-place load returns before its copies run (the
    stream is kept busy), reports done only once the blocks hold the stored bytes, and
    leaves vLLM's own hit (skipped blocks) untouched."""

    from kvtier.connectors.vllm.inplace import start_in_place

    src = lbnhc(3, "cuda")
    _fill_bytes(src, None, seed=7)
    dst = lbnhc(3, "cuda")
    _fill_bytes(dst, POISON)
    mover = EngineBlockMover(dst, SLOTS_WIDE)
    assert mover.enqueues
    store, keys = _two_chunks(EngineBlockMover(src, SLOTS_WIDE).gather([0, 1, 2, 3]))
    try:
        torch.cuda._sleep(200_000_000)  # the copies wait for the current stream
        load = start_in_place(store, mover, keys, [4, 5, 6, 7], 1, 2)
        assert load is not None
        assert not load.done()
        assert store.stats().get_chunks == 0  # held while the copies may read them
        while not load.done():
            pass
        assert _rows(dst, [5, 6, 7]) == _rows(src, [1, 2, 3])
        assert _rows(dst, [4]) == bytes([POISON]) * mover.block_bytes
        assert store.stats().get_chunks == 2  # released once done (a release counts a get)
    finally:
        store.close()


def test_an_enqueue_that_fails_part_way_holds_nothing_and_raises_nothing() -> None:
    """A copy engine that refuses the second chunk (a fault no CPU copy produces, hence
    the stand-in): the load is not started, and every chunk is released at once."""

    from kvtier.connectors.vllm.inplace import start_in_place

    class RefusesSecond(TorchBlockMover):
        enqueues = True

        def __init__(self, layers: list[torch.Tensor]) -> None:
            super().__init__(layers)
            self.calls = 0

        def start_scatter(self, staging, block_ids):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls == 2:
                raise ValueError("refused")
            self.scatter(staging, block_ids)
            return None if self.calls > 2 else _Done()

    class _Done:
        def done(self) -> bool:
            return True

        def wait(self) -> None:
            return None

    src = lbhnc(3)
    mover = RefusesSecond([torch.zeros_like(t) for t in src])
    store, keys = _two_chunks(TorchBlockMover(src).gather([0, 1, 2, 3]))
    try:
        assert start_in_place(store, mover, keys, [4, 5, 6, 7], 0, 2) is None
        assert mover.calls == 2
        assert store.stats().get_chunks == 2  # both released (a release counts a get)
    finally:
        store.close()
