"""The sections of ``kvtier bench gpu_transfer`` (:mod:`kvtier.bench.gpu_transfer`).

Imports torch: :mod:`.gpu_transfer` imports this module only once torch is there.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.bench import _gpu_case
from kvtier.bench._gpu_case import (
    LLAMA8B,
    LLAMA70B,
    LLAMA70B_TP8,
    Case,
    Geometry,
    _sync,
    fill_random,
    interleave,
    summary,
    timed,
)
from kvtier.bench.common import envelope
from kvtier.transfer import Layout, TransferEngine, TransferHandle, TransferOptions
from kvtier.transfer.engine import unit_kernel_reason


def run_case(
    dev: torch.device, geo: Geometry, tokens: int, reps: int, opts: TransferOptions, perblock: bool
) -> list[dict[str, Any]]:
    c = Case(dev, geo, tokens, Layout.LBNHC, seed=tokens + geo.layers)
    eng = TransferEngine(dev, opts)
    flat = torch.empty(c.nbytes // 8, dtype=torch.int64, device=dev)
    fill_random([flat], 7)
    host_flat = c.host.view(torch.int64)
    # Short transfers get more runs (up to 8x for 2K tokens): five runs of a copy of a
    # few milliseconds are a sample of the machine's moments, not of the engine.
    reps *= max(1, min(8, 16384 // tokens))
    warmup = 3
    rows = []
    try:
        base = {
            "geometry": geo.name,
            "tokens": tokens,
            "blocks": c.n,
            "bytes": c.nbytes,
            "page_bytes": c.kv.geometry.page_bytes,
            "layout": c.layout.value,
            "host": c.host_kind,
            "staging_bytes_per_direction": opts.staging_bytes,
            "slots": opts.slots,
            "ramp_bytes": opts.ramp_bytes,
        }
        # Store (GPU -> host). The engine is timed against the ceiling in a rotation of
        # their own: with the per-block loop (thousands of launches) in the same rotation,
        # the engine run right after it came out lower at 2K (the `small` section shows
        # both), an effect of one baseline on the next run, not of the engine. The
        # per-block ratio comes from its own rotation with the engine.
        ceiling_store = lambda: host_flat.copy_(flat, non_blocking=True)  # noqa: E731
        engine_store = lambda: eng.store(c.kv, c.ids_list, c.host).wait()  # noqa: E731
        t = _rotations(
            dev, ceiling_store, engine_store, c.perblock_store if perblock else None, reps, warmup
        )
        c.host.fill_(0xA5)
        eng.store(c.kv, c.ids_list, c.host).wait()
        ok_store = c.verify_host()
        ok_perblock = None
        if perblock:
            c.host.fill_(0xA5)
            c.perblock_store()
            _sync(dev)
            ok_perblock = c.verify_host()
            c.host.fill_(0xA5)
            eng.store(c.kv, c.ids_list, c.host).wait()
        rows.append(_row(base, "store", t, c.nbytes, ok_store, ok_perblock))

        # Load (host -> GPU); the host holds the stored (verified) bytes.
        before = [w.clone() for w in c.raw]
        t = _rotations(
            dev,
            lambda: flat.copy_(host_flat, non_blocking=True),
            lambda: eng.load(c.host, c.kv, c.ids_list).wait(),
            c.perblock_load if perblock else None,
            reps,
            warmup,
        )
        c.poison_targets()
        h = eng.load(c.host, c.kv, c.ids_list)
        h.wait()
        _sync(dev)
        ok_load = all(torch.equal(a, b) for a, b in zip(c.raw, before, strict=True))
        ok_pb_load = None
        if perblock:
            c.poison_targets()
            c.perblock_load()
            _sync(dev)
            ok_pb_load = all(torch.equal(a, b) for a, b in zip(c.raw, before, strict=True))
        del before
        rows.append(_row(base, "load", t, c.nbytes, ok_load, ok_pb_load))
    finally:
        c.close()
        eng.close()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _warm_up(
    dev: torch.device,
    case: tuple[Geometry, int, bool],
    a: argparse.Namespace,
    opts: TransferOptions,
) -> list[dict[str, float]]:
    """Untimed passes of the first case until ``a.warmup_s`` have gone; their ratios."""
    geo, tokens, _ = case
    passes: list[dict[str, float]] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < a.warmup_s:
        rows = run_case(dev, geo, tokens, 1, opts, False)
        passes.append({r["direction"]: round(r["x_ceiling"], 3) for r in rows})
    print(f"warm-up passes (x ceiling): {passes}", flush=True)
    return passes


def _rotations(
    dev: torch.device,
    ceiling: Callable[[], object],
    engine: Callable[[], object],
    perblock: Callable[[], object] | None,
    reps: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Times of the engine against the ceiling (interleaved), then, when ``perblock`` is
    given, of the per-block loop against the engine in a second rotation
    (``engine_pb``: the engine's runs of that one)."""
    t: dict[str, list[float]] = interleave(
        dev, {"ceiling": ceiling, "engine": engine}, reps, warmup
    )
    if perblock is not None:
        pb: dict[str, list[float]] = interleave(
            dev, {"engine": engine, "perblock": perblock}, max(3, reps // 2), 1
        )
        t["perblock"], t["engine_pb"] = pb["perblock"], pb["engine"]
    return t


def _row(
    base: dict[str, Any],
    direction: str,
    t: dict[str, list[float]],
    nbytes: int,
    ok: bool,
    ok_pb: bool | None,
) -> dict[str, Any]:
    s = {k: summary(v, nbytes) for k, v in t.items()}
    row = {**base, "direction": direction, **{k: v for k, v in s.items()}, "verified": ok}
    row["x_ceiling"] = s["ceiling"]["median_s"] / s["engine"]["median_s"]
    if "perblock" in s:
        row["x_perblock"] = s["perblock"]["median_s"] / s["engine_pb"]["median_s"]
        row["perblock_verified"] = ok_pb
    return row


def run_layouts(
    dev: torch.device, geo: Geometry, tokens: int, reps: int, opts: TransferOptions
) -> list[dict[str, Any]]:
    """Engine vs ceiling for every layout, each verified."""
    rows = []
    for layout in Layout:
        c = Case(dev, geo, tokens, layout, seed=11)
        eng = TransferEngine(dev, opts)
        flat = torch.empty(c.nbytes // 8, dtype=torch.int64, device=dev)
        fill_random([flat], 8)
        hf = c.host.view(torch.int64)
        try:
            ts = interleave(
                dev,
                {
                    "ceiling": lambda: hf.copy_(flat, non_blocking=True),  # noqa: B023
                    "engine": lambda: eng.store(c.kv, c.ids_list, c.host).wait(),  # noqa: B023
                },
                reps,
            )
            c.host.fill_(0xA5)
            eng.store(c.kv, c.ids_list, c.host).wait()
            ok_s = c.verify_host()
            before = [w.clone() for w in c.raw]
            tl = interleave(
                dev,
                {
                    "ceiling": lambda: flat.copy_(hf, non_blocking=True),  # noqa: B023
                    "engine": lambda: eng.load(c.host, c.kv, c.ids_list).wait(),  # noqa: B023
                },
                reps,
            )
            c.poison_targets()
            eng.load(c.host, c.kv, c.ids_list).wait()
            _sync(dev)
            ok_l = all(torch.equal(a, b) for a, b in zip(c.raw, before, strict=True))
            del before
            base = {"geometry": geo.name, "tokens": tokens, "bytes": c.nbytes}
            base["layout"] = layout.value
            base["runs_per_page"] = c.kv.geometry.runs
            rows.append(_row(base, "store", ts, c.nbytes, ok_s, None))
            rows.append(_row(base, "load", tl, c.nbytes, ok_l, None))
        finally:
            c.close()
            eng.close()
            gc.collect()
    return rows


def _store_wait(e: TransferEngine, c: Case) -> None:
    e.store(c.kv, c.ids_list, c.host).wait()


def _load_wait(e: TransferEngine, c: Case) -> None:
    e.load(c.host, c.kv, c.ids_list).wait()


def run_staging_sweep(
    dev: torch.device, geo: Geometry, tokens: int, reps: int, configs: list[tuple[int, int, int]]
) -> list[dict[str, Any]]:
    """Engine rate against the ceiling for several staging sizes, each verified."""
    c = Case(dev, geo, tokens, Layout.LBNHC, seed=13)
    flat = torch.empty(c.nbytes // 8, dtype=torch.int64, device=dev)
    fill_random([flat], 9)
    hf = c.host.view(torch.int64)
    rows = []
    engines = {
        f"{sb >> 20}MiBx{sl}-ramp{rb >> 20}M": TransferEngine(
            dev, TransferOptions(staging_bytes=sb, slots=sl, ramp_bytes=rb)
        )
        for sb, sl, rb in configs
    }
    try:
        ok: dict[str, bool] = {}
        before = [w.clone() for w in c.raw]
        for k, e in engines.items():
            c.host.fill_(0xA5)
            e.store(c.kv, c.ids_list, c.host).wait()
            good = c.verify_host()
            c.poison_targets()
            e.load(c.host, c.kv, c.ids_list).wait()
            _sync(dev)
            ok[k] = good and all(torch.equal(x, y) for x, y in zip(c.raw, before, strict=True))
        del before
        for direction in ("store", "load"):
            fns: dict[str, Callable[[], object]] = {}
            if direction == "store":
                fns["ceiling"] = lambda: hf.copy_(flat, non_blocking=True)
                for k, e in engines.items():
                    fns[k] = functools.partial(_store_wait, e, c)
            else:
                fns["ceiling"] = lambda: flat.copy_(hf, non_blocking=True)
                for k, e in engines.items():
                    fns[k] = functools.partial(_load_wait, e, c)
            t = interleave(dev, fns, reps)
            ceil = statistics.median(t["ceiling"])
            for k in engines:
                s = summary(t[k], c.nbytes)
                rows.append(
                    {
                        "tokens": tokens,
                        "direction": direction,
                        "staging": k,
                        "engine": s,
                        "ceiling": summary(t["ceiling"], c.nbytes),
                        "x_ceiling": ceil / s["median_s"],
                        "verified": ok[k],
                    }
                )
    finally:
        _release(c, engines)
    return rows


def _release(c: Case, engines: dict[Any, TransferEngine]) -> None:
    """Close a case and its engines, and collect: the next case needs the memory."""
    for e in engines.values():
        e.close()
    c.close()
    gc.collect()


def run_small(
    dev: torch.device, geo: Geometry, sizes: list[int], reps: int, trace_dir: str | None
) -> list[dict[str, Any]]:
    """Where small transfers lose time: engine vs ceiling by size, with and without the
    per-block loop in the rotation, plus a CUDA timeline of one store per size."""
    rows: list[dict[str, Any]] = []
    for tokens in sizes:
        c = Case(dev, geo, tokens, Layout.LBNHC, seed=29)
        flat = torch.empty(c.nbytes // 8, dtype=torch.int64, device=dev)
        fill_random([flat], 10)
        hf = c.host.view(torch.int64)
        engines = {
            "ramp0": TransferEngine(dev, TransferOptions(ramp_bytes=0)),
            "ramp4M": TransferEngine(dev, TransferOptions(ramp_bytes=4 << 20)),
            # The default without the unit kernel: one index_select launch per layer.
            "per_layer": TransferEngine(dev, TransferOptions(gather_kernel=False)),
        }
        try:
            fns: dict[str, Callable[[], object]] = {
                "ceiling": lambda: hf.copy_(flat, non_blocking=True),  # noqa: B023
            }
            for k, e in engines.items():
                fns[k] = functools.partial(_store_wait, e, c)
            t = interleave(dev, fns, reps * 3, warmup=3)
            fns["perblock"] = c.perblock_store
            t2 = interleave(dev, fns, reps, warmup=1)
            ceil, ceil2 = statistics.median(t["ceiling"]), statistics.median(t2["ceiling"])
            row: dict[str, Any] = {"tokens": tokens, "bytes": c.nbytes}
            for k in engines:
                row[f"x_ceiling_{k}"] = ceil / statistics.median(t[k])
                row[f"x_ceiling_{k}_with_perblock"] = ceil2 / statistics.median(t2[k])
            row["raw"] = {k: summary(v, c.nbytes) for k, v in t.items()}
            row["raw_with_perblock"] = {k: summary(v, c.nbytes) for k, v in t2.items()}
            # Host-side cost: how long the enqueue call itself takes (no wait).
            enq: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(9):
                for k, e in engines.items():
                    _sync(dev)
                    t0 = time.perf_counter()
                    h = e.store(c.kv, c.ids_list, c.host)
                    enq[k].append(time.perf_counter() - t0)
                    h.wait()
            row["enqueue_s"] = statistics.median(enq["ramp0"])
            row["enqueue_s_by_engine"] = {k: statistics.median(v) for k, v in enq.items()}
            if dev.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with profile(activities=acts) as prof:
                    for _ in range(2):
                        hf.copy_(flat, non_blocking=True)
                        _sync(dev)
                        engines["ramp0"].store(c.kv, c.ids_list, c.host).wait()
                        _sync(dev)
                if trace_dir and tokens <= 8192:
                    prof.export_chrome_trace(os.path.join(trace_dir, f"trace_store_{tokens}.json"))
                row["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
            rows.append(row)
            print(
                f"small {tokens:>6}: x ceil ramp0 {row['x_ceiling_ramp0']:.3f} ramp4M "
                f"{row['x_ceiling_ramp4M']:.3f} per-layer {row['x_ceiling_per_layer']:.3f}; "
                f"enqueue default {row['enqueue_s_by_engine']['ramp4M'] * 1e3:.2f} ms, "
                f"per-layer {row['enqueue_s_by_engine']['per_layer'] * 1e3:.2f} ms; "
                "with perblock in rotation "
                f"{row['x_ceiling_ramp0_with_perblock']:.3f}; "
                f"enqueue {row['enqueue_s'] * 1e3:.2f} ms",
                flush=True,
            )
        finally:
            _release(c, engines)
    return rows


def run_gather(dev: torch.device, geo: Geometry, tokens: int, reps: int) -> dict[str, Any]:
    """Device-only rate of the gather and scatter kernels (no PCIe): HBM bytes read+written."""
    c = Case(dev, geo, tokens, Layout.LBNHC, seed=23)
    try:
        g = c.kv.geometry
        buf = torch.empty(
            (geo.layers, g.runs, c.n, g.run_bytes // 8), dtype=torch.int64, device=dev
        )

        def gather() -> None:
            for layer, w in enumerate(c.kv.layers):
                torch.index_select(w, 1, c.ids_dev, out=buf[layer])

        def scatter() -> None:
            for layer, w in enumerate(c.kv.layers):
                w.index_copy_(1, c.ids_dev, buf[layer])

        flat = torch.empty(c.nbytes // 8, dtype=torch.int64, device=dev)

        def d2d() -> None:
            flat.copy_(buf.view(-1))

        t = interleave(dev, {"gather": gather, "scatter": scatter, "d2d_copy": d2d}, reps)
        out: dict[str, Any] = {"geometry": geo.name, "tokens": tokens, "bytes": c.nbytes}
        for k, v in t.items():
            out[k] = summary(v, 2 * c.nbytes)  # read + write
        return out
    finally:
        c.close()
        gc.collect()


def run_layerwise(
    dev: torch.device, geo: Geometry, tokens: int, reps: int, opts: TransferOptions, size: int
) -> list[dict[str, Any]]:
    """A synthetic forward (matmuls per layer) after a bulk load vs with layer-wise waits."""
    c = Case(dev, geo, tokens, Layout.LBNHC, seed=17)
    eng = TransferEngine(dev, opts)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dt)
    b = torch.randn(size, size, device=dev, dtype=dt)
    rows = []
    try:
        eng.store(c.kv, c.ids_list, c.host).wait()
        layer_load_s = (
            statistics.median(
                [timed(dev, lambda: eng.load(c.host, c.kv, c.ids_list).wait()) for _ in range(3)]
            )
            / geo.layers
        )
        one = statistics.median([timed(dev, lambda: a @ b) for _ in range(5)])
        for ratio in (1.0, 0.25):
            per_layer = max(1, round(ratio * layer_load_s / one))

            def compute(per_layer: int = per_layer) -> None:
                for _ in range(per_layer):
                    torch.matmul(a, b)

            def bulk() -> None:
                eng.load(c.host, c.kv, c.ids_list).wait()
                for _ in range(geo.layers):
                    compute()

            def layerwise() -> None:
                h = eng.load(c.host, c.kv, c.ids_list)
                for i in range(geo.layers):
                    h.wait_for_layer(i)
                    compute()

            def compute_only() -> None:
                for _ in range(geo.layers):
                    compute()

            t = interleave(
                dev, {"bulk": bulk, "layerwise": layerwise, "compute_only": compute_only}, reps
            )
            # The layer-wise run must still deliver every byte.
            before = [w.clone() for w in c.raw]
            c.poison_targets()
            layerwise()
            _sync(dev)
            ok = all(torch.equal(x, y) for x, y in zip(c.raw, before, strict=True))
            del before
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append(
                {
                    "geometry": geo.name,
                    "tokens": tokens,
                    "compute_to_load": ratio,
                    "matmuls_per_layer": per_layer,
                    "matmul_size": size,
                    **{k: summary(v, c.nbytes) for k, v in t.items()},
                    "load_s": layer_load_s * geo.layers,
                    "layerwise_over_bulk": med["layerwise"] / med["bulk"],
                    "layerwise_over_compute_only": med["layerwise"] / med["compute_only"],
                    "verified": ok,
                }
            )
    finally:
        c.close()
        eng.close()
        gc.collect()
    return rows


def run_interference(
    dev: torch.device, geo: Geometry, tokens: int, reps: int, opts: TransferOptions, size: int
) -> dict[str, Any]:
    """Matmul throughput while stores run, against idle; and store rate under matmuls."""
    c = Case(dev, geo, tokens, Layout.LBNHC, seed=19)
    eng = TransferEngine(dev, opts)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dt)
    b = torch.randn(size, size, device=dev, dtype=dt)
    flops = 2 * size**3
    try:
        store_s = statistics.median(
            [timed(dev, lambda: eng.store(c.kv, c.ids_list, c.host).wait()) for _ in range(3)]
        )
        mm_s = statistics.median([timed(dev, lambda: torch.matmul(a, b)) for _ in range(5)])
        n_stores = 3

        def matmul_time(meanwhile: Callable[[], object] = lambda: None) -> float:
            """Seconds for n_mm matmuls on the compute stream (CUDA events where there).

            ``meanwhile`` runs once the matmuls are queued (on the CPU, where nothing is
            queued, before them).
            """
            if dev.type != "cuda":
                meanwhile()
                return float(timed(dev, lambda: [torch.matmul(a, b) for _ in range(n_mm)]))
            e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e0.record()
            for _ in range(n_mm):
                torch.matmul(a, b)
            e1.record()
            meanwhile()
            e1.synchronize()
            return float(e0.elapsed_time(e1)) / 1e3

        store_busy: list[float] = []

        def stores_done(hs: list[TransferHandle], t0: float) -> None:
            for h in hs:
                h.wait()
            store_busy.append(time.perf_counter() - t0)

        n_mm = max(4, int(n_stores * store_s / mm_s))
        idle: list[float] = []
        busy: list[float] = []
        store_alone: list[float] = []
        for _ in range(reps + 1):
            idle.append(matmul_time())
            store_alone.append(
                timed(dev, lambda: [eng.store(c.kv, c.ids_list, c.host) for _ in range(n_stores)])
            )
            # Stores first (they wait for nothing on the compute stream), then the matmuls,
            # timed on the compute stream with events while the stores are in flight.
            _sync(dev)
            t0 = time.perf_counter()
            hs = [eng.store(c.kv, c.ids_list, c.host) for _ in range(n_stores)]
            busy.append(matmul_time(functools.partial(stores_done, hs, t0)))
        idle, busy, store_alone, store_busy = idle[1:], busy[1:], store_alone[1:], store_busy[1:]
        tf_idle = flops * n_mm / statistics.median(idle) / 1e12
        tf_busy = flops * n_mm / statistics.median(busy) / 1e12
        return {
            "geometry": geo.name,
            "tokens": tokens,
            "matmul_size": size,
            "matmuls": n_mm,
            "stores_in_flight": n_stores,
            "tflops_idle": tf_idle,
            "tflops_during_store": tf_busy,
            "matmul_drop": 1 - tf_busy / tf_idle,
            "store_GBps_alone": n_stores * c.nbytes / statistics.median(store_alone) / 1e9,
            "store_GBps_with_matmul": n_stores * c.nbytes / statistics.median(store_busy) / 1e9,
            "idle_s": summary(idle, 1),
            "busy_s": summary(busy, 1),
        }
    finally:
        c.close()
        eng.close()
        gc.collect()


def device_info(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, sms=p.multi_processor_count, memory_bytes=p.total_memory)
        info["cuda_runtime"] = torch.version.cuda
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,pcie.link.gen.current,"
                    "pcie.link.width.current,clocks.sm,clocks.mem",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            info["nvidia_smi"] = out.stdout.strip()
        except OSError as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'case':34} {'dir':5} {'engine GB/s':>12} {'ceiling':>9} {'perblock':>9} "
        f"{'x ceil':>7} {'x pblk':>7} ok"
    ]
    for r in rows:
        name = f"{r['geometry']} {r['tokens'] // 1024}K {r['layout']}"
        pb = r.get("perblock", {}).get("GBps")
        pb_s = f"{pb:.1f}" if pb else "-"
        xpb = f"{r['x_perblock']:.1f}" if "x_perblock" in r else "-"
        bad = "" if r.get("perblock_verified") in (None, True) else " PERBLOCK-FAIL"
        lines.append(
            f"{name:34} {r['direction']:5} {r['engine']['GBps']:12.1f} "
            f"{r['ceiling']['GBps']:9.1f} {pb_s:>9} {r['x_ceiling']:7.2f} {xpb:>7} "
            f"{r['verified']}{bad}"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    """Every section ``a.sections`` names; 0 when every transfer verified."""
    _gpu_case.HOST_MODE = a.host
    dev = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    )
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    sections = set(a.sections.split(","))
    opts = TransferOptions()
    if a.quick:
        cases = [(LLAMA8B, 256, True), (LLAMA70B_TP8, 512, True)]
        main_geo, main_tokens, mm, mm_layer = LLAMA8B, 512, 256, 128
        sweep = [(1 << 20, 2, 0), (4 << 20, 4, 1 << 20)]
    else:
        cases = [
            (LLAMA8B, 2048, True),
            (LLAMA8B, 32768, True),
            (LLAMA8B, 131072, True),
            (LLAMA70B, 32768, True),
            (LLAMA70B_TP8, 32768, True),
        ]
        cases = [c for c in cases if c[1] <= a.max_tokens]
        main_geo, main_tokens, mm, mm_layer = LLAMA8B, 32768, 8192, 4096
        sweep = [
            (32 << 20, 2, 0),
            (64 << 20, 2, 0),
            (256 << 20, 4, 0),
            (256 << 20, 4, 4 << 20),
            (1024 << 20, 4, 4 << 20),
        ]
    payload = envelope("gpu_transfer", [], device=device_info(dev), options=vars(a))
    payload["engine_options"] = {
        "staging_bytes": opts.staging_bytes,
        "slots": opts.slots,
        "ramp_bytes": opts.ramp_bytes,
        "gather_kernel": opts.gather_kernel,
        "kernel_programs": opts.kernel_programs,
        "unit_kernel": unit_kernel_reason(dev, opts) is None,
    }
    out_path = a.json

    def save() -> None:
        if out_path:
            Path(out_path).write_text(json.dumps(payload, indent=2, default=str))

    def section(name: str, fn: Callable[[], Any]) -> Any:
        if name.split("-")[0] not in sections:
            return None
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:  # one failed section must not lose the others
            traceback.print_exc()
            payload.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            res = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        payload.setdefault("section_s", {})[name] = time.perf_counter() - t0
        save()
        print(f"[{name}] {time.perf_counter() - t0:.1f}s", flush=True)
        return res

    print(json.dumps(payload["device"]), flush=True)
    if "cases" in sections and cases and dev.type == "cuda" and a.warmup_s > 0:
        # The headline is meant as the steady state a serving engine is in, not a fresh
        # process's first seconds, whose first 2K passes can come out lower than later
        # ones. The passes' ratios are kept in the JSON, so their spread stays in view.
        payload["warmup"] = section("cases-warmup", lambda: _warm_up(dev, cases[0], a, opts))
    for geo, tokens, pb in cases if "cases" in sections else []:
        rows = section(
            f"cases-{geo.name}-{tokens}",
            functools.partial(run_case, dev, geo, tokens, a.reps, opts, pb),
        )
        payload["rows"].extend(rows or [])
        if rows:
            print(_table(rows), flush=True)
    payload["layouts"] = section(
        "layouts", lambda: run_layouts(dev, main_geo, main_tokens, max(3, a.reps - 2), opts)
    )
    payload["staging_sweep"] = section(
        "staging",
        lambda: [
            row
            for tok in (main_tokens // 16, main_tokens)
            for row in run_staging_sweep(dev, main_geo, tok, max(3, a.reps - 2), sweep)
        ],
    )
    payload["gather"] = section("gather", lambda: run_gather(dev, main_geo, main_tokens, a.reps))
    payload["small"] = section(
        "small",
        lambda: run_small(
            dev,
            main_geo,
            [256] if a.quick else [2048, 4096, 8192, 16384],
            a.reps,
            a.trace_dir,
        ),
    )
    payload["layerwise"] = section(
        "layerwise", lambda: run_layerwise(dev, main_geo, main_tokens, a.reps, opts, mm_layer)
    )
    payload["interference"] = section(
        "interference", lambda: run_interference(dev, main_geo, main_tokens, a.reps, opts, mm)
    )
    save()
    print("\n== summary ==")
    print(_table(payload["rows"]))
    if payload["layouts"]:
        print(_table(payload["layouts"]))
    for r in payload.get("staging_sweep") or []:
        print(
            f"staging {r['tokens']:>6} {r['staging']:>22} {r['direction']:5} "
            f"{r['engine']['GBps']:6.1f} GB/s "
            f"x ceil {r['x_ceiling']:.3f} ok={r['verified']}"
        )
    for r in payload.get("layerwise") or []:
        print(
            f"layerwise c/l={r['compute_to_load']}: bulk {r['bulk']['median_s'] * 1e3:.1f} ms, "
            f"layerwise {r['layerwise']['median_s'] * 1e3:.1f} ms, compute only "
            f"{r['compute_only']['median_s'] * 1e3:.1f} ms -> x{r['layerwise_over_bulk']:.3f} "
            f"ok={r['verified']}"
        )
    gt = payload.get("gather")
    if gt:
        print(
            "device-only, GB/s read+write: "
            + ", ".join(f"{k} {gt[k]['GBps']:.0f}" for k in ("gather", "scatter", "d2d_copy"))
        )
    itf = payload.get("interference")
    if itf:
        print(
            f"interference: matmul {itf['tflops_idle']:.0f} -> {itf['tflops_during_store']:.0f} "
            f"TFLOP/s (drop {itf['matmul_drop'] * 100:.1f}%), store {itf['store_GBps_alone']:.1f}"
            f" -> {itf['store_GBps_with_matmul']:.1f} GB/s"
        )
    if payload.get("errors"):
        print("ERRORS:", payload["errors"])
    ok = all(r["verified"] for r in payload["rows"]) and not payload.get("errors")
    return 0 if ok else 1
