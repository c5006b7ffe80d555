"""``KVTierL2Adapter`` under a real ``lmcache server`` (LMCache's multiprocess mode).

A real ``lmcache server`` process loads the adapter from its ``--l2-adapter`` JSON and
uses a real ``kvtier serve`` daemon as L2. The test drives the server through LMCache's
own client (``ServerBenchClient``, CPU mode, engine-driven transfers): store a request,
clear the server's L1 (its HTTP API), then look up and retrieve: the hits must come from
kvtier, and the retrieved KV must equal what was stored (LMCache's checksums). This client sends no ``cache_salt``;
salt separation of ``ObjectKey``s is covered by test_lmcache.py's key test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")

import httpx

from tests.connectors.lmcache_engine import nvme_daemon
from tests.service.conftest import Daemon, free_port, start_daemon


def _server(tmp: Path, url: str) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    rpc, http = free_port(), free_port()
    adapter = {
        "type": "plugin",
        "module_path": "kvtier.connectors.lmcache",
        "class_name": "KVTierL2Adapter",
        "adapter_params": {"url": url},
    }
    log = tmp / "lmcache-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "lmcache.cli.main", "server",
                "--host", "127.0.0.1", "--port", str(rpc), "--http-port", str(http),
                "--chunk-size", "16", "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven",
                "--l2-adapter", json.dumps(adapter),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"LMCACHE_DISABLE_BANNER": "1", **__import__("os").environ},
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            httpx.get(f"http://127.0.0.1:{http}/healthz", timeout=1)
            return proc, rpc, http, log
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("lmcache server did not start:\n" + log.read_text()[-4000:])


@pytest.fixture
def stack(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Daemon, int, int, Path]]:
    # Indirect "full": a daemon of two value slots and no other tier (full by capacity).
    if getattr(request, "param", "") == "full":
        d = start_daemon(
            tmp_path, "--set", "tiers.0.capacity_bytes=2MiB",
            "--set", "store.placement=keep",
        )  # fmt: skip
    else:
        d = nvme_daemon(tmp_path / "daemon")
    proc, rpc, http, log = _server(tmp_path, d.url)
    try:
        yield d, rpc, http, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        d.stop()


def _bench_client(rpc: int, http: int) -> Any:
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    cfg = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{rpc}",
        http_url=f"http://127.0.0.1:{http}",
        mode="cpu",
        transfer_mode="engine_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=64,
        kvcache_shape_spec="(2,64,16,2,8):float16:2",
        num_blocks=64,
        block_size=16,
    )
    client = ServerBenchClient(cfg, lambda _msg: None)
    client.start()
    return client


def _wait_for_chunks(d: Daemon, n: int, log: Path) -> None:
    """Until the daemon holds ``n`` chunks (the server's store controller runs later)."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{d.url}/v1/stats").json()["store"]["chunks"] < n:
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def test_l2_adapter_serves_hits_after_l1_is_cleared(stack: tuple[Daemon, int, int, Path]) -> None:
    d, rpc, http, log = stack
    client = _bench_client(rpc, http)
    try:
        cold = client.create_request(0, "cold", "cold")
        assert cold is not None and cold.total_chunks == 4
        assert client.lookup(cold).hit_chunks == 0
        stored = client.store(cold, 0, cold.num_full_tokens)
        assert stored is not None and stored.succeeded
        before = client.compute_checksums(cold, 0, cold.num_full_tokens)
        client.end_session(cold)

        _wait_for_chunks(d, 4, log)
        r = httpx.post(f"http://127.0.0.1:{http}/cache/clear", json={"tier": "l1"}, timeout=30)
        assert r.status_code == 200, r.text

        warm = client.create_request(0, "warm", "warm")
        assert warm is not None
        assert client.lookup(warm).hit_chunks == 4, log.read_text()[-4000:]
        client.zero_destination(warm, 0, warm.num_full_tokens)
        got = client.retrieve(warm, 0, warm.num_full_tokens)
        assert got is not None and got.succeeded
        after = client.compute_checksums(warm, 0, warm.num_full_tokens)
        assert before and after == before
        client.end_session(warm)
    finally:
        client.close()


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_l2_adapter_on_a_daemon_full_by_capacity_keeps_the_head(
    stack: tuple[Daemon, int, int, Path],
) -> None:
    """Four chunks into a daemon of two slots: the store keeps the head, the rest is
    declined (counted, never an error to LMCache); after L1 is cleared the lookup hits
    exactly the head, whose retrieved KV equals what was stored."""
    d, rpc, http, log = stack
    client = _bench_client(rpc, http)
    try:
        cold = client.create_request(0, "cold", "cold")
        assert cold is not None and cold.total_chunks == 4
        assert client.store(cold, 0, cold.num_full_tokens).succeeded
        head = 2 * 16
        before = client.compute_checksums(cold, 0, head)
        client.end_session(cold)
        _wait_for_chunks(d, 2, log)
        deadline = time.monotonic() + 60
        while (st := httpx.get(f"{d.url}/v1/stats").json()["store"])["put_rejected"] < 2:
            assert time.monotonic() < deadline, (st, log.read_text()[-4000:])
            time.sleep(0.2)
        assert st["chunks"] == 2
        r = httpx.post(f"http://127.0.0.1:{http}/cache/clear", json={"tier": "l1"}, timeout=30)
        assert r.status_code == 200, r.text

        warm = client.create_request(0, "warm", "warm")
        assert warm is not None
        assert client.lookup(warm).hit_chunks == 2, log.read_text()[-4000:]
        client.zero_destination(warm, 0, head)
        got = client.retrieve(warm, 0, head)
        assert got is not None and got.succeeded
        assert client.compute_checksums(warm, 0, head) == before
        client.end_session(warm)
    finally:
        client.close()
