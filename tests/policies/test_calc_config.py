"""The plan is the configuration: ``kvtier calc --write-config`` writes a kvtier TOML file,
and a store built from that file (real host and nvme tiers) replaying the same workload,
scaled down to small values, reproduces the calculator's per-tier hit rates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.config import load_config
from kvtier.factory import build_store, spec_from_model
from kvtier.policies.simulate import key_of
from kvtier.policies.trace import load_trace
from kvtier.traces import shipped_trace

VALUE = 8192  # bytes of one scaled chunk (a real Llama-3-8B chunk is 64 MiB)
REQUESTS = 1200


def _value(block: int) -> np.ndarray:
    return np.random.default_rng((7, block)).integers(0, 256, VALUE, dtype=np.uint8)


def test_a_store_built_from_the_written_config_matches_the_plan(tmp_path: Path) -> None:
    plan_json, conf = tmp_path / "plan.json", tmp_path / "plan.toml"
    res = CliRunner().invoke(
        app,
        [
            "calc",
            "--trace",
            "mooncake-conversation",
            "--limit",
            str(REQUESTS),
            "--capacity",
            "host=100GB",
            "--capacity",
            "nvme=250GB",
            "--json",
            str(plan_json),
            "--write-config",
            str(conf),
            "--nvme-dir",
            str(tmp_path / "nvme"),
        ],
    )
    assert res.exit_code == 0, res.output
    predicted = {t["name"]: t["hit_rate"] for t in json.loads(plan_json.read_text())["tiers"]}

    cfg = load_config(conf, env={})
    assert cfg.store.placement == "cost" and cfg.placement.recompute_s > 0
    assert [t.kind for t in cfg.tiers] == ["host", "nvme"]
    # Scale: every tier keeps its number of chunks, each chunk VALUE bytes.
    chunk = spec_from_model(cfg.model).chunk_bytes(cfg.store.chunk_tokens)
    cfg = dataclasses.replace(
        cfg,
        tiers=tuple(
            dataclasses.replace(t, capacity_bytes=t.capacity_bytes // chunk * VALUE)
            for t in cfg.tiers
        ),
    )
    trace = load_trace(shipped_trace("mooncake-conversation"), limit=REQUESTS)
    now = [trace.requests[0].t_s]
    built = build_store(cfg, chunk_bytes=VALUE, clock=lambda: now[0])
    store = built.store
    hits = {t.name: 0 for t in cfg.tiers}
    chunks = 0
    try:
        for r in trace.requests:
            now[0] = r.t_s
            blocks = trace.full_blocks(r)
            if not blocks:
                continue
            keys = [key_of(b) for b in blocks]
            chunks += len(keys)
            n = store.lookup(keys).hits
            if n:
                dst = np.empty(n * VALUE, dtype=np.uint8)
                got = store.get(keys[:n], dst).result()
                for j, tier in enumerate(got.tiers):  # never wrong bytes
                    assert np.array_equal(dst[j * VALUE : (j + 1) * VALUE], _value(blocks[j]))
                    hits[tier] += 1
            if n < len(keys):
                data = np.concatenate([_value(b) for b in blocks[n:]])
                store.put(keys[n:], data, prefix=keys[:n]).result()
            store.drain()  # promotions land before the next request, as in the simulator
        assert store.stats().tiers[1].bytes_written > 0  # the nvme tier was used
    finally:
        store.close()
    measured = {name: h / chunks for name, h in hits.items()}
    assert sum(predicted.values()) > 0.05  # a plan with hits to reproduce
    for name, p in predicted.items():
        assert abs(measured[name] - p) <= 0.02, (name, measured, predicted)
