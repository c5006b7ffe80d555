"""The seed document's CXL-SSD latency-cost model, reproduced exactly.

Two artefacts, pinned by unit tests:

* the cost formula ``cost = 12.8 * L_us**0.7 / (C_gbps * 0.85) + 0.33 * P_w`` in
  $/GB-month, with ``L_us`` the access latency in microseconds, ``C_gbps`` the bandwidth
  in GB/s and ``P_w`` the power in watts;
* the threshold matrix below (P99 latency, CXL bandwidth, SSD wear per scenario).

Both are a calibration fitted to one benchmark suite, not physics: the constants carry
the seed's units and its hardware, the exponent 0.7 and the 0.85 efficiency are fitted,
and power enters as watts without being normalised per GB. kvtier's own placement uses
the first-principles model in :mod:`kvtier.policies.placement`; the calculator reports
the seed model beside it and checks a configuration against the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import InputError

SEED_LATENCY_COEFF = 12.8
SEED_LATENCY_EXPONENT = 0.7
SEED_BANDWIDTH_EFFICIENCY = 0.85
SEED_POWER_COEFF = 0.33


def seed_cost_per_gb_month(latency_us: float, bandwidth_gbps: float, power_w: float) -> float:
    """The seed's CXL-SSD cost, $/GB-month (its own units; see the module docstring).

    Raises:
        InputError: negative latency or power, or a bandwidth that is not positive.
    """
    if latency_us < 0 or power_w < 0:
        raise InputError(f"latency_us={latency_us} and power_w={power_w} must be >= 0")
    if bandwidth_gbps <= 0:
        raise InputError(f"bandwidth_gbps={bandwidth_gbps} must be > 0")
    return float(
        SEED_LATENCY_COEFF
        * float(latency_us) ** SEED_LATENCY_EXPONENT
        / (bandwidth_gbps * SEED_BANDWIDTH_EFFICIENCY)
        + SEED_POWER_COEFF * power_w
    )


@dataclass(frozen=True, slots=True)
class SeedScenario:
    """One row of the seed's threshold matrix.

    Attributes:
        name: the scenario.
        p99_latency_us_max: the P99 access latency must be at most this, microseconds.
        cxl_bandwidth_gbps_min: the CXL tier's bandwidth must be at least this, GB/s.
        ssd_wear_pct_per_year_max: SSD wear must stay at or below this, % of rated
            endurance per year.
    """

    name: str
    p99_latency_us_max: float
    cxl_bandwidth_gbps_min: float
    ssd_wear_pct_per_year_max: float


SEED_MATRIX: tuple[SeedScenario, ...] = (
    SeedScenario("LLM inference cache", 23.6, 64.0, 1.8),
    SeedScenario("real-time recommendation cache", 41.2, 32.0, 3.5),
)


@dataclass(frozen=True, slots=True)
class SeedCheck:
    """A configuration against one scenario of the matrix."""

    scenario: str
    p99_latency_us: float
    p99_ok: bool
    cxl_bandwidth_gbps: float | None
    bandwidth_ok: bool | None
    ssd_wear_pct_per_year: float | None
    wear_ok: bool | None

    @property
    def passed(self) -> bool:
        return self.p99_ok and self.bandwidth_ok is not False and self.wear_ok is not False


def check_seed(
    p99_latency_us: float,
    cxl_bandwidth_gbps: float | None,
    ssd_wear_pct_per_year: float | None,
) -> tuple[SeedCheck, ...]:
    """Evaluate a configuration against every scenario of :data:`SEED_MATRIX`.

    Args:
        p99_latency_us: P99 access latency of the memory tier that backs HBM directly
            (CXL where present, else host DRAM), microseconds.
        cxl_bandwidth_gbps: bandwidth of the CXL tier; None when there is none (not judged).
        ssd_wear_pct_per_year: SSD wear; None when there is no SSD (not judged).
    """
    out = []
    for s in SEED_MATRIX:
        out.append(
            SeedCheck(
                scenario=s.name,
                p99_latency_us=p99_latency_us,
                p99_ok=p99_latency_us <= s.p99_latency_us_max,
                cxl_bandwidth_gbps=cxl_bandwidth_gbps,
                bandwidth_ok=None
                if cxl_bandwidth_gbps is None
                else cxl_bandwidth_gbps >= s.cxl_bandwidth_gbps_min,
                ssd_wear_pct_per_year=ssd_wear_pct_per_year,
                wear_ok=None
                if ssd_wear_pct_per_year is None
                else ssd_wear_pct_per_year <= s.ssd_wear_pct_per_year_max,
            )
        )
    return tuple(out)
