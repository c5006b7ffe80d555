"""kvtier placement + admission against LRU write-through, on both Mooncake traces.

At equal capacities (default: Llama-3-8B KV, 0.25 / 1 / 2 / 4 TB host DRAM over 8 TB of
Gen5 TLC NVMe), the whole of each trace is replayed through the real store in
metadata-only mode under:

* ``lru-write-through`` (the baseline: keep everything, demote tier by tier, LRU; what
  LMCache and vLLM's tiering do. The store's tiers are exclusive, so this writes each
  block to SSD when it leaves DRAM: a lower bound on what inclusive write-through writes),
* ``kvtier`` (what a live store does by default: cache-like placement, the default value
  of a user's waiting, a 0.8 DWPD write budget per day paced by price, LRU order),
* ``kvtier-paced`` (the same budget held per hour: a peak hour cannot spend the day).

Ratios are against ``lru-write-through`` on the same trace and capacities. The target:
<= 0.5x the SSD bytes written at >= 0.95x the hit rate; cost per month beside it. The run also times the
simulator (requests/s; the bound is 30 s per configuration on the conversation trace)
and validates it against real bytes (host + nvme tiers, or host + emulated cxl where the
nvme kind is not installed) on a scaled-down trace.

Usage: ``kvtier bench policy [--json F] [--model M] [--hardware H] [--caps-gb 1000,8000]
[--limit N] [--validate-requests N]``
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, write_json
from kvtier.policies.profiles import load_hardware
from kvtier.policies.recompute import model_compute
from kvtier.policies.simulate import SimConfig, simulate
from kvtier.policies.trace import load_trace
from kvtier.policies.validate import validate

TRACES = ("conversation_trace", "synthetic_trace")
VARIANTS: dict[str, dict[str, Any]] = {
    "lru-write-through": {"policy": "lru-write-through"},
    # kvtier as a live store runs it by default ([placement] and [store] defaults).
    "kvtier": {"policy": "kvtier"},
    # The same budget held per hour: a peak hour cannot spend the day.
    "kvtier-paced": {"policy": "kvtier", "budget_window_s": 3600.0},
}
SPEED_BOUND_S = 30.0


def _shipped(name: str) -> str:
    """The shipped trace (kvtier/data/mooncake) for a report name such as conversation_trace."""
    return "mooncake-" + name.removesuffix("_trace")


def _met(flag: bool | None) -> str:
    return "" if flag is None else ("yes" if flag else "no")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench policy")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h200-dram-nvme")
    ap.add_argument(
        "--caps-gb",
        default="250,8000;1000,8000;2000,8000;4000,8000",
        help="capacity per tier in GB; configurations separated by ';'",
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--validate-requests", type=int, default=1500)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument(
        "--latency-values",
        default="",
        help="extra kvtier rows pricing user waiting at these $/s (sensitivity)",
    )
    args = ap.parse_args(argv)
    variants = dict(VARIANTS)
    for v in filter(None, args.latency_values.split(",")):
        variants[f"kvtier-wait-{v}"] = {**VARIANTS["kvtier"], "value_of_latency_per_s": float(v)}

    model = model_compute(args.model)
    hw = load_hardware(args.hardware)
    configs = [tuple(int(float(x) * 1e9) for x in c.split(",")) for c in args.caps_gb.split(";")]
    rows: list[dict[str, Any]] = []
    speed: list[dict[str, Any]] = []
    print(
        f"{'trace':20} {'policy':18} {'hit':>6} {'ssd TB':>8} {'$/month':>9} "
        f"{'hit x':>6} {'ssd x':>6} {'cost x':>6} {'met':>4} {'wall s':>7} {'cpu s':>6}"
    )
    traces = {n: load_trace(_shipped(n), limit=args.limit) for n in args.traces.split(",")}
    for (name, trace), caps in itertools.product(traces.items(), configs):
        base: dict[str, Any] | None = None
        for variant, kw in variants.items():
            r = simulate(SimConfig(model, hw, caps, **kw), trace)
            row: dict[str, Any] = {
                "trace": name,
                "policy": variant,
                "capacities_bytes": list(caps),
                "hit_rate": r.hit_rate,
                "ssd_bytes_written": r.ssd_bytes_written,
                "cost": r.cost_per_month,
                "tier_hit_rate": {t.name: t.hit_rate for t in r.tiers},
                "tier_bytes_written": {t.name: t.bytes_written for t in r.tiers},
                "ssd_wear_pct_per_year": r.ssd_wear_pct_per_year,
                "storage_cost_per_month": r.storage_cost_per_month,
                "gpu_cost_per_month": r.gpu_cost_per_month,
                "ttft_p50_s": r.ttft_p50_s,
                "ttft_p99_s": r.ttft_p99_s,
                "requests": r.requests,
                "wall_s": r.wall_s,
                "cpu_s": r.cpu_s,
                "requests_per_s": r.requests_per_s,
            }
            if r.placement is not None:
                row["placement"] = asdict(r.placement)
            if r.reuse is not None:
                row["reuse"] = asdict(r.reuse)
            if base is None:
                base = row
            row["hit_ratio"] = row["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
            row["ssd_write_ratio"] = (
                row["ssd_bytes_written"] / base["ssd_bytes_written"]
                if base["ssd_bytes_written"]
                else None
            )
            row["cost_ratio"] = row["cost"] / base["cost"] if base["cost"] else None
            row["target_met"] = (
                bool(
                    row["ssd_write_ratio"] is not None
                    and row["ssd_write_ratio"] <= 0.5
                    and row["hit_ratio"] is not None
                    and row["hit_ratio"] >= 0.95
                )
                if variant.startswith("kvtier")
                else None
            )
            rows.append(row)
            speed.append(
                {
                    "trace": name,
                    "policy": variant,
                    "requests": r.requests,
                    "wall_s": r.wall_s,
                    "cpu_s": r.cpu_s,
                    "requests_per_s": r.requests_per_s,
                }
            )
            cap_s = "+".join(f"{c / 1e12:g}" for c in caps)
            label = f"{name[:12]} {cap_s}TB"
            print(
                f"{label:20} {variant:18} {r.hit_rate:6.3f} {r.ssd_bytes_written / 1e12:8.2f} "
                f"{r.cost_per_month:9.0f} {row['hit_ratio'] or 0:6.3f} "
                f"{row['ssd_write_ratio'] or 0:6.3f} {row['cost_ratio'] or 0:6.3f} "
                f"{_met(row['target_met']):>4} "
                f"{r.wall_s:7.1f} {r.cpu_s:6.1f}"
            )
    conv = [s["wall_s"] for s in speed if s["trace"] == "conversation_trace"]
    conv_cpu = [s["cpu_s"] for s in speed if s["trace"] == "conversation_trace"]
    speed_summary = {
        "configs": speed,
        "max_wall_s_conversation": max(conv) if conv else None,
        "max_cpu_s_conversation": max(conv_cpu) if conv_cpu else None,
        "bound_s": SPEED_BOUND_S,
        "within_bound": bool(conv) and max(conv) <= SPEED_BOUND_S and args.limit is None,
        "load_average": list(os.getloadavg()),
    }
    validations: list[dict[str, Any]] = []
    ok = True
    if args.validate_requests > 0:
        trace = load_trace("mooncake-conversation", limit=args.validate_requests)
        chunk = model.kv.chunk_bytes(trace.block_tokens)
        vcaps = (1500 * chunk, 4000 * chunk)
        for variant in ("lru-write-through", "kvtier"):
            v = validate(SimConfig(model, hw, vcaps, **VARIANTS[variant]), trace)
            d = asdict(v)
            d["within_2_points"] = v.max_abs_diff_points <= 2.0
            ok = ok and v.corrupt_chunks == 0
            validations.append(d)
            print(
                f"validate {variant:18} lower={v.lower_kind} predicted={v.predicted} "
                f"measured={v.measured} max diff {v.max_abs_diff_points:.2f} pts, "
                f"{v.verified_chunks} hits verified, {v.corrupt_chunks} wrong"
            )
    if conv:
        print(
            f"simulator: max {max(conv):.1f} s wall, {max(conv_cpu):.1f} s CPU per "
            f"configuration on the conversation trace (bound {SPEED_BOUND_S:.0f} s); "
            f"load average {os.getloadavg()[0]:.1f}"
        )
    write_json(
        args.json,
        envelope(
            "policy",
            rows,
            model=args.model,
            hardware=hw.name,
            capacities_bytes=[list(c) for c in configs],
            speed=speed_summary,
            validation=validations,
        ),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
