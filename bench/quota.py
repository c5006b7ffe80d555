"""Put latency of a tenant that writes ten times its quota, against the same flood on a
daemon without quotas, and the other tenant's working set through it.

Two real ``kvtier serve`` daemons with two tokens (``alice``, ``bob``) run side by side:

* ``quota``    -- ``[tenants]`` gives each tenant a host-tier quota of Q bytes in a host
  tier of 4 Q: once Alice's puts pass Q, each one makes room by evicting her own coldest
  chunks (demoted to the nvme tier below);
* ``capacity`` -- no quotas, a host tier of Q: once Alice's puts pass Q, each one makes
  room by evicting the coldest chunks of the tier, whoever put them (what a shared cache
  without quotas does; the baseline).

Bob first puts a working set of Q/2 into each daemon; then Alice puts 10 Q of new values,
put after put, alternating between the daemons so drift on a shared machine hits both
alike. Rows: Alice's put latency (median, p99, min, max) in free room (her first Q/2) and
once each put evicts (past Q), in each daemon, the ratios ``quota``/``capacity``,
and how much of Bob's set each daemon still holds in its host tier after the flood.
Values are random and every put's answer is checked (``stored == 1``).

Run: ``kvtier bench quota --json F`` (``--quota-mib``, ``--value-kib``, ``--flood``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, missing, scratch_dir, write_json

MiB = 1 << 20
TOKENS = {"alice": "alice-bench-token-0123", "bob": "bob-bench-token-012345"}


def _stats(lat_s: list[float]) -> dict[str, float]:
    ordered = sorted(lat_s)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 3),
        "min_ms": round(ordered[0] * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
        "puts": len(ordered),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench quota", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quota-mib", type=int, default=32, help="each tenant's host quota Q")
    ap.add_argument("--value-kib", type=int, default=1024, help="bytes per value")
    ap.add_argument("--flood", type=int, default=10, help="Alice writes this many times Q")
    args = ap.parse_args(argv)
    service = "pip install 'kvtier[service]'"
    if any(missing(p, "every quota row", service) for p in ("fastapi", "uvicorn", "httpx")):
        return 0
    from kvtier.bench._daemon_load import start_kvtier, stop_process
    from kvtier.service.client import Client

    value = args.value_kib * 1024
    quota = args.quota_mib * MiB
    per_q = quota // value
    tmp = scratch_dir("kvtier-bench-quota-")  # both daemons' data: removed at exit
    tokens = tuple(f"service.tokens.{t}={tok}" for t, tok in TOKENS.items())
    daemons: dict[str, Any] = {}
    try:
        daemons["quota"] = start_kvtier(
            tmp,
            str(4 * quota),
            max_value_bytes=value,
            settings=(*tokens, f"tenants.default_quota.host={quota}"),
        )
        daemons["capacity"] = start_kvtier(tmp, str(quota), max_value_bytes=value, settings=tokens)
        clients = {
            (name, t): Client(url, tok)
            for name, (url, _) in daemons.items()
            for t, tok in TOKENS.items()
        }
        bob_keys = [os.urandom(16).hex() for _ in range(per_q // 2)]
        for name in daemons:
            for k in bob_keys:
                assert clients[(name, "bob")].put(k, os.urandom(value)).stored == 1
        lat: dict[tuple[str, str], list[float]] = {}
        for i in range(args.flood * per_q):
            # Free room: below Q/2 in both (Bob holds the other half of the capacity
            # daemon's Q). Evicting: past Q in both (Alice's quota in the quota daemon).
            phase = "free" if i < per_q // 2 else "evicting" if i >= per_q else ""
            for name in daemons:
                k, v = os.urandom(16).hex(), os.urandom(value)
                c = clients[(name, "alice")]
                t0 = time.perf_counter()
                stored = c.put(k, v).stored
                if phase:
                    lat.setdefault((name, phase), []).append(time.perf_counter() - t0)
                assert stored == 1
        resident = {}
        for name in daemons:
            tiers = clients[(name, "bob")].lookup(bob_keys).tiers
            resident[name] = sum(t == "host" for t in tiers) / len(bob_keys)
        for c in clients.values():
            c.close()
    finally:
        for _, proc in daemons.values():
            stop_process(proc)

    rows: list[dict[str, Any]] = []
    print(f"{'phase':9} {'daemon':9} {'p50 ms':>8} {'p99 ms':>8} {'min':>7} {'max':>8} {'puts':>5}")
    for phase in ("free", "evicting"):
        for name in daemons:
            s = _stats(lat[(name, phase)])
            rows.append({"phase": phase, "daemon": name, **s})
            print(
                f"{phase:9} {name:9} {s['p50_ms']:>8.3f} {s['p99_ms']:>8.3f} "
                f"{s['min_ms']:>7.3f} {s['max_ms']:>8.3f} {s['puts']:>5}"
            )
    ratios = {}
    for phase in ("free", "evicting"):
        q, c = _stats(lat[("quota", phase)]), _stats(lat[("capacity", phase)])
        ratios[f"{phase}_p50_quota_vs_capacity"] = round(q["p50_ms"] / c["p50_ms"], 3)
        ratios[f"{phase}_p99_quota_vs_capacity"] = round(q["p99_ms"] / c["p99_ms"], 3)
    q_ev, q_free = _stats(lat[("quota", "evicting")]), _stats(lat[("quota", "free")])
    ratios["quota_p50_evicting_vs_free"] = round(q_ev["p50_ms"] / q_free["p50_ms"], 3)
    print("ratios:", ", ".join(f"{k} {v}" for k, v in ratios.items()))
    print(
        "bob's set in the host tier after the flood: "
        + ", ".join(f"{n} {r:.0%}" for n, r in resident.items())
    )
    write_json(
        args.json,
        envelope(
            "quota",
            rows,
            ratios=ratios,
            bob_resident_fraction=resident,
            value_bytes=value,
            quota_bytes=quota,
            flood=args.flood,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
