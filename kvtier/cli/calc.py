"""``kvtier calc``: the offline cost-model calculator, and ``kvtier calc sweep``.

Options before ``sweep`` describe the model, hardware and workload; both commands use
them. kvtier.policies is imported when a command runs, never at CLI start-up.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.cli.console import stdout_console
from kvtier.errors import InputError
from kvtier.units import format_size, parse_size

if TYPE_CHECKING:
    from kvtier.policies.profiles import Hardware
    from kvtier.policies.recompute import ModelCompute
    from kvtier.policies.simulate import SimResult
    from kvtier.policies.trace import Trace

calc_app = typer.Typer(
    help="Size DRAM, CXL and SSD tiers for a workload at minimum cost (offline calculator).",
    no_args_is_help=False,
    invoke_without_command=True,
    rich_markup_mode=None,  # as the main app: no stray "<bool>" in --help
)
out = stdout_console()


@dataclass(frozen=True, slots=True)
class _Inputs:
    model: ModelCompute
    hardware: Hardware
    trace: Trace
    policy: str
    json_out: Path | None
    plots: Path | None


def _capacities(items: list[str], names: list[str], flag: str) -> dict[str, list[int]]:
    """Parse ``tier=SIZE[,SIZE...]`` flags; errors name the flag and the item."""
    got: dict[str, list[int]] = {}
    for item in items:
        name, sep, sizes = item.partition("=")
        name = name.strip()
        if not sep or not sizes.strip():
            raise InputError(f"{flag} {item!r}: expected TIER=SIZE, e.g. host=512GB")
        if name not in names:
            raise InputError(f"{flag} {item!r}: unknown tier {name!r}; the hardware has {names}")
        vals = []
        for s in sizes.split(","):
            try:
                v = parse_size(s.strip())
            except ValueError:
                msg = f"{flag} {item!r}: {s.strip()!r} is not a size like 512GB"
                raise InputError(msg) from None
            if v < 0:
                raise InputError(f"{flag} {item!r}: capacity must be >= 0")
            vals.append(v)
        got[name] = vals
    return got


def _load_inputs(
    model: str,
    hardware: str,
    trace: str | None,
    limit: int | None,
    synthetic_requests: int,
    rate: float,
    conversations: int,
    turn_tokens: int,
    system_tokens: int,
    policy: str,
    json_out: Path | None,
    plots: Path | None,
    gpus: int | None,
) -> _Inputs:
    from kvtier.policies.profiles import load_hardware
    from kvtier.policies.recompute import model_compute
    from kvtier.policies.simulate import POLICIES
    from kvtier.policies.trace import SyntheticWorkload, load_trace

    if policy not in POLICIES:
        raise InputError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
    m = model_compute(model, gpus=gpus)
    hw = load_hardware(hardware)
    if trace is not None:
        tr = load_trace(trace, limit=limit)
    else:
        tr = SyntheticWorkload(
            requests=synthetic_requests,
            rate_per_s=rate,
            conversations=conversations,
            turn_tokens=turn_tokens,
            system_prompt_tokens=system_tokens,
        ).build()
    return _Inputs(m, hw, tr, policy, json_out, plots)


# A typer option per line, its noqa beside it: kept as written, not wrapped.
# fmt: off
@calc_app.callback()
def calc(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", "-m", help="Preset (llama-3-8b, llama-3-70b, qwen2-7b, mixtral-8x7b, deepseek-v3) or a HF config.json.")] = "llama-3-8b",
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset (h200-dram-nvme, h200-dram-cxl-nvme, h200-dram-qlc, h200-dram-redis) or a TOML file.")] = "h200-dram-nvme",
    trace: Annotated[Optional[str], typer.Option(help="Shipped trace (mooncake-conversation, mooncake-synthetic) or a Mooncake-format .jsonl[.gz] file; synthetic workload when absent.")] = None,  # noqa: UP045
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N requests of the trace.")] = None,  # noqa: UP045
    synthetic_requests: Annotated[int, typer.Option(help="Synthetic workload: requests.")] = 2000,
    rate: Annotated[float, typer.Option(help="Synthetic workload: arrivals per second.")] = 4.0,
    conversations: Annotated[int, typer.Option(help="Synthetic workload: concurrent conversations.")] = 300,
    turn_tokens: Annotated[int, typer.Option(help="Synthetic workload: mean new tokens per turn.")] = 1500,
    system_tokens: Annotated[int, typer.Option(help="Synthetic workload: shared system prompt tokens.")] = 2048,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs per replica (default: the preset's).")] = None,  # noqa: UP045
    slo: Annotated[Optional[float], typer.Option(help="Objective: TTFT p99 SLO in seconds; cheapest config meeting it.")] = None,  # noqa: UP045
    budget: Annotated[Optional[float], typer.Option(help="Objective: $/month budget; lowest TTFT p99 within it.")] = None,  # noqa: UP045
    capacity: Annotated[Optional[list[str]], typer.Option(help="Pin a tier: TIER=SIZE (repeatable); all pinned = evaluate only.")] = None,  # noqa: UP045
    policy: Annotated[str, typer.Option(help="kvtier, lru-write-through or arc-write-through.")] = "kvtier",
    rounds: Annotated[int, typer.Option(help="Search rounds (coordinate descent).")] = 3,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the result as JSON.")] = None,  # noqa: UP045
    plots: Annotated[Optional[Path], typer.Option(help="Directory for PNG plots.")] = None,  # noqa: UP045
    write_config: Annotated[Optional[Path], typer.Option("--write-config", help="Write the chosen plan as a kvtier TOML config (for kvtier serve --config or the connector's config_file).")] = None,  # noqa: UP045
    nvme_dir: Annotated[str, typer.Option(help="With --write-config: directory of the nvme tier's slab files.")] = "/var/lib/kvtier/nvme",
) -> None:
# fmt: on
    """Recommend capacities per tier for a workload: hit rates, TTFT, $/month, SSD wear.

    Exit status 1 when --slo or --budget is given and no configuration searched meets it
    (the closest is shown, and the JSON says objective.met = false); 2 on bad input.
    Files are written only where --json and --plots say.
    """
    inputs = _load_inputs(model, hardware, trace, limit, synthetic_requests, rate, conversations,
                          turn_tokens, system_tokens, policy, json_out, plots, gpus)
    if ctx.invoked_subcommand is not None:
        ctx.obj = inputs
        return
    from kvtier.policies.calc import Goal, Objective, plan, report

    if slo is not None and budget is not None:
        raise InputError("--slo and --budget: give one objective, not both")
    goal = (Goal(Objective.SLO, ttft_p99_slo_s=slo) if slo is not None
            else Goal(Objective.BUDGET, budget_per_month=budget) if budget is not None
            else Goal(Objective.COST))
    names = [t.name for t in inputs.hardware.tiers]
    fixed = {k: v[0] for k, v in _capacities(capacity or [], names, "--capacity").items()}
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    n_max = 1 + rounds * 2 * len(names)
    with Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"),
                  BarColumn(), TextColumn("{task.completed} configs"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(f"simulating {inputs.trace.name}", total=n_max)

        def tick(n: int, r: SimResult) -> None:
            prog.update(task, completed=n)

        p = plan(inputs.model, inputs.hardware, inputs.trace, goal, policy=inputs.policy,
                 fixed=fixed, rounds=rounds, progress=tick)
    doc = report(inputs.model, inputs.hardware, p.best, p.capacities_bytes, goal)
    doc["working_set_bytes"] = p.working_set_bytes
    doc["search"] = [
        {"capacities_bytes": list(c), "hit_rate": r.hit_rate, "ttft_p99_s": r.ttft_p99_s,
         "cost_per_month": r.cost_per_month}
        for c, r in p.evaluated
    ]
    _print_report(doc)
    if goal.objective is not Objective.COST:
        target = (f"TTFT p99 SLO {slo:g} s" if slo is not None
                  else f"budget ${budget:,.0f}/month")
        if p.goal_met:
            out.print(f"[green]objective met[/]: {target}")
        else:
            out.print(f"[yellow]objective NOT met[/]: no configuration searched meets the {target}; "
                      "the closest is shown (exit status 1)")
    if inputs.plots is not None:
        doc["plots"] = _plots(inputs.plots, p.evaluated, names, p.capacities_bytes,
                              slo_s=slo, budget_per_month=budget)
    if inputs.json_out is not None:
        _write_json(inputs.json_out, doc)
    if write_config is not None:
        from kvtier.policies.calc import plan_config

        write_config.write_text(plan_config(
            model, inputs.model, hardware, inputs.hardware, inputs.trace, p.capacities_bytes,
            p.best, policy=inputs.policy, nvme_dir=nvme_dir,
        ))
        out.print(f"config: {write_config} (kvtier serve --config {write_config})")
    if not p.goal_met:
        raise typer.Exit(1)


# fmt: off
@calc_app.command()
def sweep(
    ctx: typer.Context,
    tier: Annotated[list[str], typer.Option("--tier", help="TIER=SIZE,SIZE,... grid of one tier (repeatable); unnamed tiers are 0.")],
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every point as JSON.")] = None,  # noqa: UP045
    plots: Annotated[Optional[Path], typer.Option(help="Directory for PNG plots.")] = None,  # noqa: UP045
) -> None:
# fmt: on
    """Simulate a grid of capacities, with a progress bar; table, JSON and plots."""
    from rich.progress import track

    from kvtier.policies.calc import evaluate, report

    inputs: _Inputs = ctx.obj
    names = [t.name for t in inputs.hardware.tiers]
    grid = _capacities(tier, names, "--tier")
    axes = [grid.get(n, [0]) for n in names]
    points: list[tuple[tuple[int, ...], SimResult]] = []
    rows: list[dict[str, Any]] = []
    combos = list(itertools.product(*axes))
    for caps in track(combos, description=f"sweeping {inputs.trace.name}",
                      console=Console(stderr=True)):
        r = evaluate(inputs.model, inputs.hardware, inputs.trace, caps, inputs.policy)
        points.append((tuple(caps), r))
        rows.append(report(inputs.model, inputs.hardware, r, caps))
    t = Table(title=f"sweep: {inputs.model.name} on {inputs.trace.name} ({inputs.policy})")
    for n in names:
        t.add_column(n, justify="right")
    for col in ("hit rate", "TTFT p50 s", "TTFT p99 s", "$/month", "SSD wear %/yr"):
        t.add_column(col, justify="right")
    for caps, r in points:
        wear = r.ssd_wear_pct_per_year
        t.add_row(*(format_size(c) for c in caps), f"{r.hit_rate:.3f}", f"{r.ttft_p50_s:.3f}",
                  f"{r.ttft_p99_s:.3f}", f"{r.cost_per_month:,.0f}",
                  "-" if wear is None else f"{wear:.1f}")
    out.print(t)
    doc: dict[str, Any] = {"points": rows}
    if plots is not None:
        best = min(points, key=lambda p: p[1].cost_per_month)[0]
        doc["plots"] = _plots(plots, points, names, best)
    if json_out is not None:
        _write_json(json_out, doc)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    out.print(f"json: {path}")


def _plots(where: Path, points: Any, names: list[str], best: tuple[int, ...], *,
           slo_s: float | None = None, budget_per_month: float | None = None) -> list[str]:
    from kvtier.policies.plots import cost_latency_frontier, hit_rate_vs_capacity

    where.mkdir(parents=True, exist_ok=True)
    a = hit_rate_vs_capacity(points, names, best, where / "hit_rate_vs_capacity.png")
    b = cost_latency_frontier(points, best, where / "cost_latency_frontier.png", slo_s=slo_s,
                              budget_per_month=budget_per_month)
    out.print(f"plots: {a}, {b}")
    return [str(a), str(b)]


def _print_report(doc: dict[str, Any]) -> None:
    head = Table.grid(padding=(0, 2))
    head.add_row("model", f"{doc['model']}: {doc['kv_bytes_per_token']:,} KV bytes/token, "
                 f"{format_size(doc['chunk_bytes'])} per 512-token chunk")
    head.add_row("hardware / policy", f"{doc['hardware']} / {doc['policy']}")
    head.add_row("workload", f"{doc['trace']}: {doc['requests']:,} requests, working set "
                 f"{format_size(doc.get('working_set_bytes', 0))}")
    out.print(head)
    t = Table(title="recommended tiers")
    for col in ("tier", "capacity", "hit rate", "writes/day", "wear %/yr (rated)", "$/month",
                "seed $/GB-mo"):
        t.add_column(col, justify="right")
    for tier in doc["tiers"]:
        wear = tier["wear_pct_per_year"]
        rated = tier["rated_wear_pct_per_year"]
        t.add_row(
            tier["name"], format_size(tier["capacity_bytes"]), f"{tier['hit_rate']:.3f}",
            format_size(tier["bytes_written_per_day"]),
            "-" if wear is None else f"{wear:.1f} ({rated:.0f})",
            f"{tier['cost_per_month']:,.0f}", f"{tier['seed_cost_per_gb_month']:.2f}",
        )
    out.print(t)
    s = Table.grid(padding=(0, 2))
    s.add_row("hit rate", f"{doc['hit_rate']:.3f} of chunks, {doc['token_hit_rate']:.3f} of tokens")
    s.add_row("TTFT p50 / p99", f"{doc['ttft_p50_s']:.3f} s / {doc['ttft_p99_s']:.3f} s "
              f"(recompute: {doc['recompute_ttft_p50_s']:.3f} s / "
              f"{doc['recompute_ttft_p99_s']:.3f} s)")
    s.add_row("cost", f"${doc['cost_per_month']:,.0f}/month (storage "
              f"${doc['storage_cost_per_month']:,.0f}, "
              f"GPU prefill ${doc['gpu_cost_per_month']:,.0f})")
    wear = doc["ssd_wear_pct_per_year"]
    s.add_row("SSD", f"{format_size(doc['ssd_writes_per_day_bytes'])}/day written, wear "
              + ("-" if wear is None else f"{wear:.1f} %/year"))
    out.print(s)
    st = Table(title="seed threshold matrix (the seed's calibration, not physics)")
    for col in ("scenario", "P99 latency", "CXL bandwidth", "SSD wear", "pass"):
        st.add_column(col)

    def mark(ok: bool | None, text: str) -> str:
        return f"{text} n/a" if ok is None else f"{text} {'ok' if ok else 'FAIL'}"

    for c in doc["seed_thresholds"]["checks"]:
        st.add_row(
            c["scenario"], mark(c["p99_ok"], f"{c['p99_latency_us']:.1f} us"),
            mark(c["bandwidth_ok"], "-" if c["cxl_bandwidth_gbps"] is None
                 else f"{c['cxl_bandwidth_gbps']:.0f} GB/s"),
            mark(c["wear_ok"], "-" if c["ssd_wear_pct_per_year"] is None
                 else f"{c['ssd_wear_pct_per_year']:.1f} %/yr"),
            "yes" if c["passed"] else "no",
        )
    out.print(st)
