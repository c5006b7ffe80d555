"""Round trips through the transfer engine, every byte checked.

Runs on CPU everywhere (the direct path and the staged pipeline) and on CUDA where a
device exists; the CUDA cases skip with the reason otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.config import Switch  # noqa: E402
from kvtier.errors import ClosedError, InputError  # noqa: E402
from kvtier.tiers.memory import SharedArena  # noqa: E402
from kvtier.transfer import (  # noqa: E402
    HostOrder,
    Layout,
    PagedKV,
    TransferEngine,
    TransferOptions,
    describe,
    make_paged_cache,
    plan,
)

POISON = 0xA5
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD = 3, 37, 16, 2, 32


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    return None


def _kernel_reason() -> str | None:
    from kvtier.transfer.kernels import unavailable

    return unavailable()


def _host(n: int, device: str, fill: torch.Tensor | int = POISON) -> torch.Tensor:
    """A host buffer of ``n`` bytes, page-locked on CUDA (as the host tier's arena is)."""
    out = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    if isinstance(fill, int):
        out.fill_(fill)
    else:
        out.copy_(fill)
    return out


_CUDA_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason())),
]
_KERNEL_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(_kernel_reason() is not None, reason=str(_kernel_reason())),
]


# (device, staging options): the CPU direct path, the staged pipeline on CPU with slots
# small enough to split layers into block ranges, layer groups, and the same on CUDA.
ENGINES = [
    pytest.param("cpu", TransferOptions(), id="cpu-direct"),
    pytest.param(
        "cpu",
        TransferOptions(staging_bytes=1 << 20, slots=2, cpu_direct=False, ramp_bytes=8192),
        id="cpu-ramp",
    ),
    pytest.param(
        "cpu", TransferOptions(staging_bytes=2 * 40960, slots=2, cpu_direct=False), id="cpu-split"
    ),
    pytest.param(
        "cpu", TransferOptions(staging_bytes=1 << 20, slots=3, cpu_direct=False), id="cpu-groups"
    ),
    pytest.param(
        "cuda",
        TransferOptions(staging_bytes=2 * 40960, slots=2),
        id="cuda-split",
        marks=_CUDA_MARKS,
    ),
    pytest.param(
        "cuda",
        TransferOptions(staging_bytes=1 << 20, slots=2, ramp_bytes=8192),
        id="cuda-ramp",
        marks=_CUDA_MARKS,
    ),
    pytest.param(
        "cuda",
        TransferOptions(staging_bytes=1 << 20, slots=3),
        id="cuda-groups",
        marks=_CUDA_MARKS,
    ),
    # Without the unit kernel (one launch per layer), and the kernel on a 3-program grid
    # (each program loops over many pages).
    pytest.param(
        "cuda",
        TransferOptions(staging_bytes=1 << 20, slots=2, ramp_bytes=8192, gather_kernel=False),
        id="cuda-per-layer",
        marks=_CUDA_MARKS,
    ),
    pytest.param(
        "cuda",
        TransferOptions(staging_bytes=1 << 20, slots=2, ramp_bytes=8192, kernel_programs=3),
        id="cuda-kernel-3",
        marks=_KERNEL_MARKS,
    ),
]


def _dtypes() -> list:
    out = [torch.bfloat16, torch.float16]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.float8_e4m3fn)
    return out


def _fill_random(layers, gen_seed: int) -> None:
    """Random bytes over the whole storage of every layer (shared storages included)."""
    seen = set()
    g = torch.Generator().manual_seed(gen_seed)
    for t in layers:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))


def _fill_poison(layers, value: int = POISON) -> None:
    for t in layers:
        torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(value)


def _ints(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _page_ref(t, b: int, block_dim: int) -> bytes:
    """Bytes of block ``b`` in memory order, computed from the logical tensor alone."""
    v = _ints(t)
    v = v[b] if block_dim == 0 else v[:, b]
    order = sorted(range(v.dim()), key=lambda d: -v.stride(d))
    return v.permute(order).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _host_ref(layers, ids, block_dim: int) -> bytes:
    """Host bytes in the engine's format: [layer][run][block][run_bytes]."""
    out = []
    for t in layers:
        pages = [_page_ref(t, b, block_dim) for b in ids]
        runs = 1 if block_dim == 0 else t.shape[0]
        size = len(pages[0]) // runs
        for r in range(runs):
            out.extend(p[r * size : (r + 1) * size] for p in pages)
    return b"".join(out)


def _block_dim(layout: Layout) -> int:
    return 1 if layout in (Layout.KV_NHD, Layout.KV_HND) else 0


def _make(layout, dtype, device):
    return make_paged_cache(
        layout,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=dtype,
        device=device,
    )


@pytest.mark.parametrize(("device", "options"), ENGINES)
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_round_trip_every_byte(layout, dtype, device, options):
    layers = _make(layout, dtype, device)
    _fill_random(layers, 1)
    kv = PagedKV(layers)
    engine = TransferEngine(device, options)
    ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(2))[:23].tolist()
    bd = _block_dim(layout)

    host = _host(kv.nbytes(len(ids)), device)
    engine.store(kv, ids, host).wait()
    assert host.numpy().tobytes() == _host_ref(layers, ids, bd)

    # Load different random bytes into poisoned blocks: loaded blocks must equal the
    # host bytes, every other block must still be poison.
    g = torch.Generator().manual_seed(3)
    src = _host(
        host.numel(), device, torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=g)
    )
    _fill_poison(layers)
    h = engine.load(src, kv, ids)
    for layer in range(LAYERS):
        h.wait_for_layer(layer)
    h.wait()
    if device == "cuda":
        torch.cuda.synchronize()
    assert _host_ref(layers, ids, bd) == src.numpy().tobytes()
    others = [b for b in range(BLOCKS) if b not in set(ids)]
    poison_bytes = _host_ref(layers, others, bd)
    assert poison_bytes == bytes([POISON]) * len(poison_bytes)


def _rows_ref(layers, ids, block_dim: int) -> bytes:
    """Host bytes in block-major order: [block][layer][run][run_bytes]."""
    return b"".join(_page_ref(t, b, block_dim) for b in ids for t in layers)


# Block-major adds slots smaller than one block of every layer (3 x 4 KiB for bf16), so
# a block is cut into layer ranges.
ROW_ENGINES = [
    *ENGINES,
    pytest.param(
        "cpu", TransferOptions(staging_bytes=2 * 8192, slots=2, cpu_direct=False), id="cpu-rows"
    ),
    pytest.param(
        "cuda", TransferOptions(staging_bytes=2 * 8192, slots=2), id="cuda-rows", marks=_CUDA_MARKS
    ),
]


@pytest.mark.parametrize(("device", "options"), ROW_ENGINES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, _dtypes()[-1]], ids=str)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_block_major_round_trip_every_byte(layout, dtype, device, options):
    layers = _make(layout, dtype, device)
    _fill_random(layers, 11)
    kv = PagedKV(layers)
    engine = TransferEngine(device, options)
    ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(12))[:19].tolist()
    bd = _block_dim(layout)

    host = _host(kv.nbytes(len(ids)), device)
    engine.store(kv, ids, host, order=HostOrder.BLOCK).wait()
    assert host.numpy().tobytes() == _rows_ref(layers, ids, bd)

    g = torch.Generator().manual_seed(13)
    src = _host(
        host.numel(), device, torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=g)
    )
    _fill_poison(layers)
    h = engine.load(src, kv, ids, order=HostOrder.BLOCK)
    for layer in range(LAYERS):
        h.wait_for_layer(layer)
    h.wait()
    if device == "cuda":
        torch.cuda.synchronize()
    assert _rows_ref(layers, ids, bd) == src.numpy().tobytes()
    others = [b for b in range(BLOCKS) if b not in set(ids)]
    poison_bytes = _rows_ref(layers, others, bd)
    assert poison_bytes == bytes([POISON]) * len(poison_bytes)


@pytest.mark.parametrize(("device", "options"), ENGINES)
def test_back_to_back_transfers_reuse_slots(device, options):
    """Several stores and loads queued without waiting in between land intact."""
    layers = _make(Layout.LBNHC, torch.bfloat16, device)
    _fill_random(layers, 4)
    kv = PagedKV(layers)
    engine = TransferEngine(device, options)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randperm(BLOCKS, generator=g)[:k].tolist() for k in (5, 17, 1, 30)]
    hosts = [_host(kv.nbytes(len(b)), device) for b in batches]
    handles = [engine.store(kv, b, h) for b, h in zip(batches, hosts, strict=True)]
    for h in handles:
        h.wait()
    for b, h in zip(batches, hosts, strict=True):
        assert h.numpy().tobytes() == _host_ref(layers, b, 0)

    _fill_poison(layers)
    # Disjoint block sets, so each block has exactly one writer.
    perm = torch.randperm(BLOCKS, generator=g).tolist()
    sets = [perm[0:7], perm[7:20], perm[20:21], perm[21:37]]
    srcs = [
        _host(n, device, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        for n in (kv.nbytes(len(s)) for s in sets)
    ]
    loads = [engine.load(src, kv, s) for src, s in zip(srcs, sets, strict=True)]
    for h in loads:
        h.wait()
    for src, s in zip(srcs, sets, strict=True):
        assert _host_ref(layers, s, 0) == src.numpy().tobytes()


@pytest.mark.parametrize(
    ("device", "options"),
    [p for p in ENGINES if p.id in ("cuda-ramp", "cuda-per-layer", "cuda-split")],
)
def test_transfers_follow_the_callers_stream_and_leave_it_current(device, options):
    """A store sees what the caller's current stream wrote before it, a load lands
    before what that stream runs after it, and both leave that stream current (the
    engine switches between its own streams while it enqueues)."""
    layers = _make(Layout.LBNHC, torch.bfloat16, device)
    kv = PagedKV(layers)
    engine = TransferEngine(device, options)
    ids = list(range(0, BLOCKS, 2))
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        # A long kernel, then the fill: a store not ordered after them would read poison.
        _fill_poison(layers)
        torch.cuda._sleep(20_000_000)
        _fill_poison(layers, 7)
        host = _host(kv.nbytes(len(ids)), device)
        engine.store(kv, ids, host).wait()
        assert torch.cuda.current_stream() == caller
        assert host.numpy().tobytes() == bytes([7]) * host.numel()

        src = _host(host.numel(), device, 9)
        # Enqueued from another stream, busy for a while: the load waits for it, and the
        # read below (on ``caller``, idle) would overtake it without the per-layer waits.
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            torch.cuda._sleep(20_000_000)
            h = engine.load(src, kv, ids)
            assert torch.cuda.current_stream() == other
        h.wait_for_layer(LAYERS - 1)
        h.wait_for_layer(0)
        # Queued on the caller's stream after the waits: reads what the load wrote.
        seen = torch.cat([t[ids].reshape(-1).view(torch.uint8) for t in layers]).cpu()
    assert torch.cuda.current_stream() != caller
    assert bytes(seen.numpy()) == bytes([9]) * seen.numel()


def test_store_into_shared_arena():
    """The host tier's arena is a valid destination (pinned there when CUDA exists)."""
    layers = _make(Layout.LBHNC, torch.float16, "cpu")
    _fill_random(layers, 6)
    kv = PagedKV(layers)
    ids = [3, 1, 4, 15, 9, 2, 6]
    n = kv.nbytes(len(ids))
    arena = SharedArena(n + 8192, "transfer-test", pin=Switch.OFF)
    try:
        arena.array[:] = POISON
        view = torch.from_numpy(arena.array[4096 : 4096 + n])
        TransferEngine(
            "cpu", TransferOptions(cpu_direct=False, staging_bytes=1 << 16, slots=2)
        ).gather(kv, ids, out=view)
        assert arena.array[4096 : 4096 + n].tobytes() == _host_ref(layers, ids, 0)
        assert np.all(arena.array[:4096] == POISON) and np.all(arena.array[4096 + n :] == POISON)
        del view
    finally:
        arena.close()


@pytest.mark.parametrize(
    ("ramp", "at_end"), [(0, False), (4096, False), (4096, True), (1 << 22, True)]
)
@pytest.mark.parametrize(
    ("layers", "n", "page", "slot"),
    [
        (32, 2048, 65536, 64 << 20),
        (32, 128, 65536, 64 << 20),
        (5, 7, 4096, 3 * 4096),
        (1, 1, 100, 100),
    ],
)
def test_plan_covers_each_page_once_within_a_slot(layers, n, page, slot, ramp, at_end):
    seen = np.zeros((layers, n), dtype=np.int64)
    units = plan(layers, n, page, slot, ramp_bytes=ramp, ramp_at_end=at_end)
    for u in units:
        assert (u.l1 - u.l0) * (u.j1 - u.j0) * page <= slot
        assert u.j1 - u.j0 == n or u.l1 - u.l0 == 1  # partial layers are single-layer units
        seen[u.l0 : u.l1, u.j0 : u.j1] += 1
    assert np.all(seen == 1)
    # Units run in layer order, and a layer's block ranges in ascending order, so the
    # unit that ends a layer comes after every other unit of that layer.
    order = [(u.l0, u.j0) for u in units]
    assert order == sorted(order)
    if ramp:
        edge = units[-1] if at_end else units[0]
        assert (edge.l1 - edge.l0) * (edge.j1 - edge.j0) * page <= max(ramp, page)


def test_plan_refuses_a_page_larger_than_a_slot():
    with pytest.raises(InputError, match="does not fit"):
        plan(2, 4, 8192, 4096)


def test_bad_inputs_are_refused():
    layers = _make(Layout.LBHNC, torch.bfloat16, "cpu")
    _fill_random(layers, 7)
    kv = PagedKV(layers)
    eng = TransferEngine("cpu")
    with pytest.raises(InputError, match="span"):
        eng.store(kv, [0, BLOCKS], torch.empty(kv.nbytes(2), dtype=torch.uint8))
    # Ids past int32 (packed by the C helper otherwise) and negative ones are named too.
    with pytest.raises(InputError, match="span"):
        eng.store(kv, (1, 1 << 40), torch.empty(kv.nbytes(2), dtype=torch.uint8))
    with pytest.raises(InputError, match="span"):
        eng.store(kv, [-1, 2], torch.empty(kv.nbytes(2), dtype=torch.uint8))
    with pytest.raises(InputError, match="one-dimensional"):
        eng.store(kv, [[1], [2]], torch.empty(kv.nbytes(2), dtype=torch.uint8))
    with pytest.raises(InputError, match="twice"):
        eng.load(torch.empty(kv.nbytes(2), dtype=torch.uint8), kv, [4, 4])
    with pytest.raises(InputError, match="twice"):
        eng.load(torch.empty(kv.nbytes(2), dtype=torch.uint8), kv, (3, 3))


@pytest.mark.parametrize(
    "ids",
    [[5, 0, 3], (5, 0, 3), torch.tensor([5, 0, 3]), torch.tensor([5, 0, 3], dtype=torch.int32)],
    ids=["list", "tuple", "int64 tensor", "int32 tensor"],
)
def test_every_form_of_block_ids_moves_the_same_blocks(ids):
    layers = _make(Layout.LBHNC, torch.bfloat16, "cpu")
    _fill_random(layers, 11)
    kv = PagedKV(layers)
    eng = TransferEngine("cpu")
    ref = torch.empty(kv.nbytes(3), dtype=torch.uint8)
    eng.store(kv, torch.tensor([5, 0, 3]), ref).wait()
    got = torch.empty_like(ref)
    eng.store(kv, ids, got).wait()
    assert torch.equal(got, ref)
    with pytest.raises(InputError, match="bytes"):
        eng.store(kv, [1, 2], torch.empty(kv.nbytes(2) - 1, dtype=torch.uint8))
    with pytest.raises(InputError, match="uint8"):
        eng.store(kv, [1], torch.empty(kv.nbytes(1) // 2, dtype=torch.int16))
    with pytest.raises(InputError, match="out of range"):
        eng.load(torch.empty(kv.nbytes(1), dtype=torch.uint8), kv, [1]).wait_for_layer(LAYERS)


def test_head_outer_layout_is_refused():
    # vLLM's LHBNC: a block of one layer is split across heads.
    t = torch.empty(HEADS, BLOCKS, BLOCK_SIZE, 2 * HEAD, dtype=torch.bfloat16).permute(1, 0, 2, 3)
    with pytest.raises(InputError, match="contiguous run"):
        describe(t)


def test_layers_of_different_geometry_are_refused():
    a = _make(Layout.LBHNC, torch.bfloat16, "cpu")[0]
    b = torch.empty(BLOCKS, HEADS, BLOCK_SIZE, HEAD, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="geometry"):
        PagedKV([a, b])


def test_gather_and_scatter_take_plain_layer_tensors():
    layers = _make(Layout.KV_HND, torch.float16, "cpu")
    _fill_random(layers, 8)
    ids = [5, 0, 36, 12]
    eng = TransferEngine("cpu", TransferOptions(cpu_direct=False, staging_bytes=1 << 16, slots=2))
    host = eng.gather(layers, ids)
    assert host.numpy().tobytes() == _host_ref(layers, ids, 1)
    _fill_poison(layers)
    eng.scatter(host, layers, ids)
    assert _host_ref(layers, ids, 1) == host.numpy().tobytes()
    eng.close()
    with pytest.raises(ClosedError):
        eng.gather(layers, ids)


def test_empty_transfer_is_a_completed_handle():
    kv = PagedKV(_make(Layout.LBHNC, torch.bfloat16, "cpu"))
    h = TransferEngine("cpu").store(kv, [], torch.empty(0, dtype=torch.uint8))
    assert h.done()


def test_cuda_engine_without_a_device_says_why():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(InputError, match="no CUDA device"):
        TransferEngine("cuda:0")


def test_named_layers_map_to_positions():
    layers = _make(Layout.LBNHC, torch.bfloat16, "cpu")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv = PagedKV.from_named(dict(zip(names, layers, strict=True)))
    assert [kv.layer_index(n) for n in names] == list(range(LAYERS))
    with pytest.raises(InputError, match="no layer named"):
        kv.layer_index("model.layers.99.self_attn.attn")


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "BLHNC"])
def test_caches_are_strided_like_vllm(name):
    """make_paged_cache builds vLLM 0.32's own byte strides (kv_cache_interface)."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = kvi.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    want = kvi.compute_layout_strides(spec, BLOCKS, LAYERS, KVCacheLayout[name])
    layers = make_paged_cache(
        Layout[name],
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=torch.bfloat16,
    )
    es = layers[0].element_size()
    layer_stride = (layers[1].storage_offset() - layers[0].storage_offset()) * es
    # vLLM's last (C) axis is counted in bytes, ours in elements.
    got = (layer_stride, *(s * es for s in layers[0].stride()[:3]), 1)
    assert got == tuple(want)


def test_the_unit_kernel_runs_where_it_can():
    """On CUDA with Triton the default engine fills slots with one launch per unit; a
    CPU engine, or the option turned off, keeps one launch per layer."""
    cpu = TransferEngine("cpu", TransferOptions(cpu_direct=False))
    assert not cpu.unit_kernel
    assert not cpu.prepare(PagedKV(_make(Layout.LBHNC, torch.bfloat16, "cpu")))
    if _kernel_reason() is None:
        assert TransferEngine("cuda").unit_kernel
        assert not TransferEngine("cuda", TransferOptions(gather_kernel=False)).unit_kernel


@pytest.mark.gpu
@pytest.mark.skipif(_kernel_reason() is not None, reason=str(_kernel_reason()))
def test_prepare_compiles_every_variant_transfers_use():
    """After ``prepare``, transfers of any size, host order and unit split compile
    nothing more (the first save of a served request must not wait for the compiler)."""
    from kvtier.transfer import kernels

    layers = _make(Layout.LBNHC, torch.bfloat16, "cuda")
    _fill_random(layers, 21)
    kv = PagedKV(layers)
    engine = TransferEngine(
        "cuda", TransferOptions(staging_bytes=1 << 20, slots=2, ramp_bytes=8192)
    )
    assert engine.prepare(kv)
    before = kernels.compiled_variants()
    if before is None:
        pytest.skip("this Triton does not expose its compiled variants")
    g = torch.Generator().manual_seed(22)
    for k in (1, 2, 5, 16, 23, 37):
        ids = torch.randperm(BLOCKS, generator=g)[:k].tolist()
        for order in HostOrder:
            host = _host(kv.nbytes(k), "cuda")
            engine.store(kv, ids, host, order=order).wait()
            ref = (
                _host_ref(layers, ids, 0) if order is HostOrder.LAYER else _rows_ref(layers, ids, 0)
            )
            assert host.numpy().tobytes() == ref
            engine.load(host, kv, ids, order=order).wait()
    assert kernels.compiled_variants() == before
