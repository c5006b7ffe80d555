"""Daemon mode: vLLM engines in separate processes share one real ``kvtier serve``.

Three engine processes run one after the other (two at once do not fit two cores), all
eager (daemon_driver.py): the first stores; then the daemon restarts cleanly (SIGTERM,
same data directory and port); the second (vLLM's default multi-process engine) and the
third (in-process, so its counters can be read) hit what the first stored, i.e. what the
daemon kept across its restart. The third also lives through the daemon being killed
(SIGKILL, a real fault) and restarted on the same port.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: pip install 'kvtier[vllm]'")
pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.connectors.conftest import BLOCK, CHUNK
from tests.procs import engine_env
from tests.service.conftest import Daemon, free_port, start_daemon

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = 4 * CHUNK  # the 300-token prompt's full chunks


@dataclass
class Runs:
    store: dict[str, Any]
    mp: dict[str, Any]
    mp_store: dict[str, dict[str, int]]  # the daemon's store counters before/after "mp"
    share: dict[str, Any]
    share_log: str


def _driver(model: str, url: str, out: Path, mode: str, log: Path) -> subprocess.Popen[bytes]:
    env = engine_env(log.parent)
    with log.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.connectors.daemon_driver", model, url, str(out), mode],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def _wait(proc: subprocess.Popen[bytes], path: Path, log: Path, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"driver exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"driver never wrote {path.name}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("daemon-mode")
    port = free_port()
    # An nvme tier under a data directory, so the daemon's cache outlives its restarts.
    data = ("--data-dir", str(tmp / "daemon-data"), "--set", "service.data_capacity_bytes=64MiB")
    daemons: list[Daemon] = [start_daemon(tmp, *data, port=port)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = daemons[0].url
        log_a, log_b = tmp / "engine-a.log", tmp / "engine-b.log"
        a = _driver(tiny_model, url, tmp, "store", log_a)
        procs.append(a)
        _wait(a, tmp / "result-store.json", log_a)
        assert a.wait(timeout=120) == 0, log_a.read_text()[-4000:]
        # A clean restart: the engines below find the first one's chunks only if the
        # daemon kept them (its host tier's content moves to nvme at shutdown).
        assert daemons[0].stop() in (0, -signal.SIGTERM), daemons[0].log.read_text()[-3000:]
        daemons.append(start_daemon(tmp, *data, port=port))

        log_mp = tmp / "engine-mp.log"
        before = httpx.get(url + "/v1/stats", timeout=5).json()["store"]
        mp = _driver(tiny_model, url, tmp, "mp", log_mp)
        procs.append(mp)
        _wait(mp, tmp / "result-mp.json", log_mp)
        assert mp.wait(timeout=120) == 0, log_mp.read_text()[-4000:]
        after = httpx.get(url + "/v1/stats", timeout=5).json()["store"]

        b = _driver(tiny_model, url, tmp, "share", log_b)
        procs.append(b)
        _wait(b, tmp / "down?", log_b)
        daemons[-1].proc.kill()  # a crash, not a graceful stop
        daemons[-1].proc.wait()
        (tmp / "down").touch()
        _wait(b, tmp / "up?", log_b)
        daemons.append(start_daemon(tmp, *data, port=port))
        (tmp / "up").touch()
        _wait(b, tmp / "result-share.json", log_b)
        assert b.wait(timeout=120) == 0, log_b.read_text()[-4000:]
        yield Runs(
            json.loads((tmp / "result-store.json").read_text()),
            json.loads((tmp / "result-mp.json").read_text()),
            {"before": before, "after": after},
            json.loads((tmp / "result-share.json").read_text()),
            log_b.read_text(),
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in daemons:
            d.stop()


def test_first_engine_stores_into_the_daemon(runs: Runs) -> None:
    r = runs.store
    assert r["first_cached"] == 0
    # The repeat is loaded back from the daemon (the engine has no store of its own).
    assert r["again_cached"] == HIT_TOKENS
    assert r["totals"]["load_chunks"] == 4
    assert r["again"] == r["first"]


def test_second_engine_hits_what_the_first_stored(runs: Runs) -> None:
    r = runs.share
    # Its own mirror is empty: the scheduler side found the chunks in the daemon, which
    # restarted in between (SIGTERM) and kept them.
    assert r["hit_cached"] == HIT_TOKENS
    assert r["totals_hit"]["load_chunks"] == 4
    assert r["hit"] == runs.store["first"]


def test_multiprocess_engine_hits_what_the_first_stored(runs: Runs) -> None:
    # vLLM's default engine: the salts reach the scheduler side through vLLM's IPC.
    assert runs.mp["mp_cached"] == HIT_TOKENS
    assert runs.mp["mp"] == runs.store["first"]


def test_prefix_cache_repeat_does_not_re_put_what_the_daemon_holds(runs: Runs) -> None:
    # The repeat is served from vLLM's own prefix cache (288 tokens: 9 blocks), beyond
    # kvtier's 4 chunks. It used to save those 4 chunks again (put_present grew by 4).
    assert runs.mp["repeat_cached"] >= HIT_TOKENS
    assert runs.mp["repeat"] == runs.store["first"]
    before, after = runs.mp_store["before"], runs.mp_store["after"]
    assert after["put_present"] == before["put_present"]
    assert after["puts"] == before["puts"]


def test_daemon_killed_degrades_to_misses_and_recovers(runs: Runs) -> None:
    r = runs.share
    # Daemon gone: vLLM keeps serving, every prompt computed, outputs as recomputed.
    assert r["down_new_cached"] == 0
    assert r["down_new"] == r["recomputed"]
    # The shared prompt's chunks are in this engine's mirror (it loaded them from the
    # daemon before): the load is planned, fails for real, and vLLM recomputes the blocks
    # (its num_cached_tokens still counts the tokens the connector promised).
    assert r["down_shared"] == runs.store["first"]
    failed = r["totals_down"].get("load_failed_blocks", 0)
    assert failed - r["totals_hit"].get("load_failed_blocks", 0) == 4 * CHUNK // BLOCK
    assert r["totals_down"].get("save_failed_chunks", 0) >= 4  # the dropped saves
    assert "serving misses and dropping saves" in runs.share_log  # the logged reason
    # Daemon back on the same port: a new prompt stores, and its repeat hits.
    assert r["up_first_cached"] == 0
    assert r["up_again_cached"] == HIT_TOKENS
    assert r["up_again"] == r["up_first"]
    assert r["totals_up"]["load_chunks"] == r["totals_hit"]["load_chunks"] + 4
