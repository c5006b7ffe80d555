"""The offline calculator: size each tier for a workload at minimum cost.

:func:`plan` searches tier capacities with the trace simulator. Capacities are taken
from a ladder of fractions of the workload's working set (its unique full blocks, in
bytes); the search is a coordinate descent over that ladder, every point simulated
once (memoised). The objective is one of:

* ``slo``: the cheapest configuration whose TTFT p99 meets the SLO (if none does, the
  one closest to it);
* ``budget``: the lowest TTFT p99 whose total cost fits the budget;
* ``cost``: the cheapest configuration, whatever its latency.

:func:`report` turns a simulation into the calculator's output (the JSON fields of
``kvtier calc --json``), including the seed model's threshold check; :func:`plan_config`
turns the chosen plan into a kvtier TOML configuration (``kvtier calc --write-config``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InputError
from kvtier.tiers.economics import Medium

from .profiles import Hardware
from .recompute import ModelCompute, Recompute
from .seed import check_seed, seed_cost_per_gb_month
from .simulate import SimConfig, SimResult, chunk_recompute_s, simulate
from .trace import Trace

MEMORY_LADDER = (0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
SSD_LADDER = (0.0, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)


class Objective(enum.Enum):
    SLO = "slo"
    BUDGET = "budget"
    COST = "cost"


@dataclass(frozen=True, slots=True)
class Goal:
    """What the search optimises.

    Attributes:
        objective: see the module docstring.
        ttft_p99_slo_s: the SLO (``slo`` only).
        budget_per_month: the budget in $ (``budget`` only).
    """

    objective: Objective = Objective.COST
    ttft_p99_slo_s: float | None = None
    budget_per_month: float | None = None

    def __post_init__(self) -> None:
        if self.objective is Objective.SLO and not (self.ttft_p99_slo_s or 0) > 0:
            raise InputError("objective 'slo' needs a TTFT p99 SLO > 0 seconds (--slo)")
        if self.objective is Objective.BUDGET and not (self.budget_per_month or 0) > 0:
            raise InputError("objective 'budget' needs a budget > 0 $/month (--budget)")

    def key(self, r: SimResult) -> tuple[float, float]:
        """Sort key: (constraint violation, objective); smaller is better."""
        if self.objective is Objective.SLO:
            assert self.ttft_p99_slo_s is not None
            return (max(r.ttft_p99_s - self.ttft_p99_slo_s, 0.0), r.cost_per_month)
        if self.objective is Objective.BUDGET:
            assert self.budget_per_month is not None
            return (max(r.cost_per_month - self.budget_per_month, 0.0), r.ttft_p99_s)
        return (0.0, r.cost_per_month)

    def met(self, r: SimResult) -> bool:
        return self.key(r)[0] == 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """The search's answer and every point it simulated."""

    best: SimResult
    capacities_bytes: tuple[int, ...]
    goal_met: bool
    evaluated: tuple[tuple[tuple[int, ...], SimResult], ...]
    working_set_bytes: int


def ladders(hw: Hardware, working_set_bytes: int) -> list[list[int]]:
    """Candidate capacities per tier, in bytes."""
    out = []
    for t in hw.tiers:
        fracs = SSD_LADDER if t.medium is Medium.SSD else MEMORY_LADDER
        out.append(sorted({int(f * working_set_bytes) for f in fracs}))
    return out


def plan(
    model: ModelCompute,
    hw: Hardware,
    trace: Trace,
    goal: Goal,
    *,
    policy: str = "kvtier",
    fixed: dict[str, int] | None = None,
    rounds: int = 3,
    progress: Callable[[int, SimResult], None] | None = None,
) -> Plan:
    """Search capacities for ``goal``; ``fixed`` pins some tiers (name -> bytes).

    Raises:
        InputError: a fixed tier that the hardware does not have.
    """
    fixed = dict(fixed or {})
    names = [t.name for t in hw.tiers]
    for name in fixed:
        if name not in names:
            raise InputError(f"capacity given for tier {name!r}; the hardware has {names}")
    chunk = model.kv.chunk_bytes(trace.block_tokens)
    for name, cap in fixed.items():
        if 0 < cap < chunk:
            raise InputError(
                f"capacity of tier {name!r} is {cap} B: it cannot hold one {chunk}-byte chunk "
                f"of {model.name} (use 0 to leave the tier out)"
            )
    ws = max(trace.unique_full_blocks() * chunk, chunk)
    lad = ladders(hw, ws)
    for i, name in enumerate(names):
        if name in fixed:
            lad[i] = [fixed[name]]
    memo: dict[tuple[int, ...], SimResult] = {}

    def run(idx: tuple[int, ...]) -> SimResult:
        caps = tuple(lad[i][j] for i, j in enumerate(idx))
        if caps not in memo:
            run_caps = caps
            if all(c < chunk for c in caps):
                # No cache at all: the store still needs a tier; one chunk of the top
                # tier stands in for "nothing" (it holds one block of a 20K-block trace).
                run_caps = (chunk, *caps[1:])
            memo[caps] = simulate(SimConfig(model, hw, run_caps, policy=policy), trace)
            if progress is not None:
                progress(len(memo), memo[caps])
        return memo[caps]

    state = tuple(len(lv) // 2 for lv in lad)
    best = run(state)
    for _ in range(rounds):
        improved = False
        for i in range(len(lad)):
            for step in (-1, 1):
                j = state[i] + step
                if not 0 <= j < len(lad[i]):
                    continue
                cand = (*state[:i], j, *state[i + 1 :])
                r = run(cand)
                if goal.key(r) < goal.key(best):
                    best, state, improved = r, cand, True
        if not improved:
            break
    caps = tuple(lad[i][j] for i, j in enumerate(state))
    return Plan(best, caps, goal.met(best), tuple(memo.items()), ws)


def evaluate(
    model: ModelCompute, hw: Hardware, trace: Trace, capacities: Sequence[int], policy: str
) -> SimResult:
    """Simulate one given configuration."""
    return simulate(SimConfig(model, hw, tuple(capacities), policy=policy), trace)


def report(
    model: ModelCompute,
    hw: Hardware,
    r: SimResult,
    capacities: Sequence[int],
    goal: Goal | None = None,
) -> dict[str, Any]:
    """The calculator's output for one configuration (the ``--json`` document)."""
    by_name = {t.name: t for t in r.tiers}
    tiers: list[dict[str, Any]] = []
    for spec, cap in zip(hw.tiers, capacities, strict=True):
        t = by_name.get(spec.name)
        tiers.append(
            {
                "name": spec.name,
                "medium": spec.medium.value,
                "capacity_bytes": int(cap),
                "hit_rate": t.hit_rate if t else 0.0,
                "bytes_written_per_day": t.writes_per_day if t else 0.0,
                "wear_pct_per_year": t.wear_pct_per_year if t else None,
                "rated_wear_pct_per_year": 100.0 / spec.warranty_years if spec.wears else None,
                "write_budget_bytes_per_day": (
                    spec.write_budget_Bps(cap) * 86400 if spec.wears else None
                ),
                "cost_per_month": t.cost_per_month if t else 0.0,
                "latency_s": spec.latency_s,
                "p99_latency_s": spec.p99_latency_s,
                "bandwidth_Bps": spec.bandwidth_Bps,
                "seed_cost_per_gb_month": seed_cost_per_gb_month(
                    spec.latency_s * 1e6, spec.bandwidth_Bps / 1e9, spec.power_w
                ),
            }
        )
    present = [(spec, cap) for spec, cap in zip(hw.tiers, capacities, strict=True) if cap > 0]
    cxl = [s for s, _ in present if s.medium is Medium.CXL]
    mem = cxl or [s for s, _ in present if s.medium is Medium.DRAM] or [hw.tiers[0]]
    checks = check_seed(
        p99_latency_us=mem[0].p99_latency_s * 1e6,
        cxl_bandwidth_gbps=cxl[0].bandwidth_Bps / 1e9 if cxl else None,
        ssd_wear_pct_per_year=r.ssd_wear_pct_per_year,
    )
    ssd_per_day = sum(t["bytes_written_per_day"] for t in tiers if t["medium"] == "ssd")
    out: dict[str, Any] = {
        "model": model.name,
        "hardware": hw.name,
        "trace": r.trace,
        "policy": r.policy,
        "requests": r.requests,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "chunk_bytes": model.kv.chunk_bytes(512),
        "tiers": tiers,
        "hit_rate": r.hit_rate,
        "token_hit_rate": r.token_hit_rate,
        "ttft_p50_s": r.ttft_p50_s,
        "ttft_p90_s": r.ttft_p90_s,
        "ttft_p99_s": r.ttft_p99_s,
        "recompute_ttft_p50_s": r.recompute_ttft_p50_s,
        "recompute_ttft_p99_s": r.recompute_ttft_p99_s,
        "cost_per_month": r.cost_per_month,
        "storage_cost_per_month": r.storage_cost_per_month,
        "gpu_cost_per_month": r.gpu_cost_per_month,
        "ssd_writes_per_day_bytes": ssd_per_day,
        "ssd_wear_pct_per_year": r.ssd_wear_pct_per_year,
        "seed_thresholds": {
            "note": "the seed's CXL-SSD model: a calibration from one benchmark suite, in its "
            "own units (latency us, bandwidth GB/s, power W), not physics",
            "checks": [
                {
                    "scenario": c.scenario,
                    "passed": c.passed,
                    "p99_latency_us": c.p99_latency_us,
                    "p99_ok": c.p99_ok,
                    "cxl_bandwidth_gbps": c.cxl_bandwidth_gbps,
                    "bandwidth_ok": c.bandwidth_ok,
                    "ssd_wear_pct_per_year": c.ssd_wear_pct_per_year,
                    "wear_ok": c.wear_ok,
                }
                for c in checks
            ],
        },
        "simulator_wall_s": r.wall_s,
    }
    if goal is not None:
        out["objective"] = {
            "kind": goal.objective.value,
            "ttft_p99_slo_s": goal.ttft_p99_slo_s,
            "budget_per_month": goal.budget_per_month,
            "met": goal.met(r),
        }
    return out


_KIND_OF_MEDIUM = {
    Medium.DRAM: "host",
    Medium.CXL: "cxl",
    Medium.SSD: "nvme",
    Medium.REMOTE: "redis",
}


def _toml(value: object) -> str:
    """One TOML value (strings, numbers, booleans: what the plan holds)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def plan_config(
    model_source: str,
    model: ModelCompute,
    hardware_source: str,
    hw: Hardware,
    trace: Trace,
    capacities: Sequence[int],
    r: SimResult,
    *,
    policy: str = "kvtier",
    nvme_dir: str = "/var/lib/kvtier/nvme",
) -> str:
    """The plan as a kvtier TOML configuration (``kvtier calc --write-config``).

    ``kvtier serve --config`` and the vLLM connector's ``config_file`` accept it: the
    tiers the plan keeps with its capacities, and a ``[placement]`` section holding the
    economics the simulation priced (model, GPU, the workload's average recompute time
    per chunk, value of waiting, write budget), so the live store decides as the
    calculator's simulation did. Tiers the plan leaves at 0 are left out.

    Raises:
        InputError: the plan keeps no tier at all.
    """
    chunk = model.kv.chunk_bytes(trace.block_tokens)
    kept = [(spec, cap) for spec, cap in zip(hw.tiers, capacities, strict=True) if cap >= chunk]
    if not kept:
        raise InputError(
            "the plan keeps no tier (every capacity is 0): no configuration to "
            "write; pin one with --capacity TIER=SIZE"
        )
    sim = SimConfig(model, hw, tuple(capacities), policy=policy)
    rc = Recompute(model, hw.gpu)
    ssd = [spec for spec, _ in kept if spec.wears]
    hits = ", ".join(f"{t.name} {t.hit_rate:.3f}" for t in r.tiers)
    lines = [
        f"# Written by kvtier calc: {model.name} on {hw.name}, workload {r.trace}",
        f"# ({r.requests} requests). Predicted hit rate {r.hit_rate:.3f} of chunks ({hits}),",
        f"# TTFT p50 {r.ttft_p50_s:.3f} s, p99 {r.ttft_p99_s:.3f} s, "
        f"${r.cost_per_month:,.0f}/month.",
        "# Use it with `kvtier serve --config FILE` or the vLLM connector's config_file.",
        "",
        "[model]",
        f"name = {_toml(model_source)}",
        "",
        "[store]",
        f"chunk_tokens = {trace.block_tokens}",
        f"placement = {_toml('cost' if policy == 'kvtier' else 'keep')}",
        f"eviction = {_toml(sim.eviction if policy == 'kvtier' else policy.split('-')[0])}",
        "",
        "# The economics the calculator priced (docs/cost-model.md).",
        "[placement]",
        f"hardware = {_toml(hardware_source)}",
        f"model = {_toml(model_source)}",
        f"gpus = {model.gpus}",
        f"gpu_peak_flops = {_toml(hw.gpu.peak_flops)}",
        f"gpu_mfu = {_toml(hw.gpu.mfu)}",
        f"gpu_cost_per_hour = {_toml(hw.gpu.cost_per_hour)}",
        f"value_of_latency_per_s = {_toml(sim.value_of_latency_per_s)}",
        "# Seconds to recompute one chunk, averaged over the workload's positions.",
        f"recompute_s = {_toml(chunk_recompute_s(trace, rc))}",
        f"write_budget_dwpd = "
        f"{_toml(ssd[0].endurance_dwpd * ssd[0].write_headroom if ssd else 0.8)}",
        f"write_budget_window_s = {_toml(sim.budget_window_s)}",
    ]
    for spec, cap in kept:
        kind = _KIND_OF_MEDIUM[spec.medium]
        lines += [
            "",
            "[[tiers]]",
            f"kind = {_toml(kind)}",
            f"name = {_toml(spec.name)}",
            f"capacity_bytes = {int(cap)}",
        ]
        if kind == "nvme":
            lines += [
                "# Slab files go here: a directory on the SSD this plan prices.",
                f"dir = {_toml(nvme_dir)}",
                "create_dirs = true",
            ]
        elif kind == "redis":
            lines += ["# The shared Redis this plan prices.", 'url = "redis://127.0.0.1:6379/0"']
    return "\n".join(lines) + "\n"
