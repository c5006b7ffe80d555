"""PNG plots of the calculator: hit rate against capacity per tier, and the cost-latency
frontier. matplotlib is imported when a plot is drawn (the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import InputError

from .simulate import SimResult

Point = tuple[tuple[int, ...], SimResult]


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("plots need matplotlib: pip install 'kvtier[plot]'") from exc
    return plt


def hit_rate_vs_capacity(
    points: Sequence[Point], tier_names: Sequence[str], best: tuple[int, ...], out: Path
) -> Path:
    """One panel per tier: hit rate (total and that tier's) as its capacity varies, the
    other tiers held at the chosen configuration where such points exist."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(tier_names), figsize=(5 * len(tier_names), 4), squeeze=False)
    for i, name in enumerate(tier_names):
        ax = axes[0][i]
        same = [
            (c, r) for c, r in points if all(c[j] == best[j] for j in range(len(best)) if j != i)
        ]
        pts = same if len(same) >= 2 else list(points)
        pts.sort(key=lambda p: p[0][i])
        xs = [c[i] / 1e9 for c, _ in pts]
        ax.plot(xs, [r.hit_rate for _, r in pts], "o-", label="all tiers")
        ax.plot(
            xs,
            [next((t.hit_rate for t in r.tiers if t.name == name), 0.0) for _, r in pts],
            "s--",
            label=f"served from {name}",
        )
        ax.axvline(best[i] / 1e9, color="grey", lw=0.8, ls=":")
        ax.set_xlabel(f"{name} capacity (GB)")
        ax.set_ylabel("chunk hit rate")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _p50(r: SimResult) -> float:
    return r.ttft_p50_s


def _p99(r: SimResult) -> float:
    return r.ttft_p99_s


def cost_latency_frontier(
    points: Sequence[Point],
    best: tuple[int, ...],
    out: Path,
    *,
    slo_s: float | None = None,
    budget_per_month: float | None = None,
) -> Path:
    """Draw :func:`frontier_figure` into the PNG ``out``; returns ``out``."""
    plt = _plt()
    fig = frontier_figure(points, best, slo_s=slo_s, budget_per_month=budget_per_month)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def frontier_figure(
    points: Sequence[Point],
    best: tuple[int, ...],
    *,
    slo_s: float | None = None,
    budget_per_month: float | None = None,
) -> Any:
    """Every simulated configuration as ($/month, TTFT p50) and ($/month, TTFT p99), each
    with its Pareto frontier (line and points), the chosen configuration, and the
    objective (the TTFT p99 SLO as a horizontal line, a budget as a vertical one) marked
    on both panels."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    panels: tuple[tuple[Any, str, Callable[[SimResult], float]], ...] = (
        (axes[0], "TTFT p50 (s)", _p50),
        (axes[1], "TTFT p99 (s)", _p99),
    )
    for ax, label, get in panels:
        ax.scatter(
            [r.cost_per_month for _, r in points],
            [get(r) for _, r in points],
            s=18,
            alpha=0.6,
            label="configurations",
        )
        frontier: list[SimResult] = []
        for _, r in sorted(points, key=lambda p: (p[1].cost_per_month, get(p[1]))):
            if not frontier or get(r) < get(frontier[-1]):
                frontier.append(r)
        # Markers too: a frontier of one point is otherwise an invisible line.
        ax.step(
            [r.cost_per_month for r in frontier],
            [get(r) for r in frontier],
            "r-",
            where="post",
            marker="o",
            ms=5,
            label="frontier",
        )
        if slo_s is not None:
            ax.axhline(
                slo_s, color="tab:orange", ls="--", lw=1.2, label=f"TTFT p99 SLO {slo_s:g} s"
            )
        if budget_per_month is not None:
            ax.axvline(
                budget_per_month,
                color="tab:orange",
                ls="--",
                lw=1.2,
                label=f"budget ${budget_per_month:,.0f}/month",
            )
        for c, r in points:
            if c == best:
                ax.scatter(
                    [r.cost_per_month],
                    [get(r)],
                    s=90,
                    marker="*",
                    color="k",
                    label="chosen",
                    zorder=3,
                )
                break
        ax.set_xlabel("total cost ($/month)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig
