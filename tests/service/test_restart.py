"""A clean SIGTERM restart of a real ``kvtier serve`` keeps what it acknowledged.

Every daemon here runs the embedded default configuration (its placement included) with
a small host tier and a temporary ``--data-dir``, as a new user would start it. Values
are random 1 MiB chunks, put one by one; each put is acknowledged before the next.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import signal
import time
from pathlib import Path

import httpx

from kvtier.tiers.memory import SHM_DIR
from tests.service.conftest import Daemon, DaemonFactory, start_daemon

VALUE_BYTES = 1 << 20


def _key() -> str:
    return os.urandom(16).hex()


def _args(data_dir: Path, host: str, nvme: str) -> tuple[str, ...]:
    return (
        "--data-dir",
        str(data_dir),
        "--set",
        f"tiers.0.capacity_bytes={host}",
        "--set",
        f"service.data_capacity_bytes={nvme}",
    )


def _put_all(url: str, n: int) -> dict[str, bytes]:
    vals = {_key(): os.urandom(VALUE_BYTES) for _ in range(n)}
    with httpx.Client(base_url=url, timeout=60) as h:
        for k, v in vals.items():
            r = h.put(f"/v1/chunks/{k}", content=v)
            assert r.status_code == 200 and r.json()["stored"] == 1, r.text  # acknowledged
    return vals


def _survivors(url: str, vals: dict[str, bytes]) -> tuple[int, int]:
    """(values back with their exact bytes, values back with other bytes)."""
    good = wrong = 0
    with httpx.Client(base_url=url, timeout=60) as h:
        for k, v in vals.items():
            r = h.get(f"/v1/chunks/{k}")
            if r.status_code == 200:
                good += r.content == v
                wrong += r.content != v
    return good, wrong


def _stats(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=60) as h:
        return dict(h.get("/v1/stats").json())


def _stop_cleanly(d) -> None:
    rc = d.stop()  # SIGTERM
    assert rc in (0, -signal.SIGTERM), d.log.read_text()[-3000:]
    assert "store closed" in d.log.read_text()


def test_acknowledged_values_that_fit_nvme_survive_a_restart(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    # 48 MiB of values through a 16 MiB host tier into a 64 MiB nvme tier: all fit nvme.
    args = _args(tmp_path, "16MiB", "64MiB")
    first = daemon_factory(*args)
    vals = _put_all(first.url, 48)
    _stop_cleanly(first)
    second = daemon_factory(*args)
    good, wrong = _survivors(second.url, vals)
    assert wrong == 0
    assert good >= 0.95 * len(vals), f"{good} of {len(vals)} survived"


def test_values_only_in_the_host_tier_at_shutdown_survive(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    # The host tier holds all 24 values: nothing was demoted while the daemon ran, so the
    # nvme tier only has them if the shutdown moved them there.
    args = _args(tmp_path, "64MiB", "64MiB")
    first = daemon_factory(*args)
    vals = _put_all(first.url, 24)
    nvme = [t for t in _stats(first.url)["store"]["tiers"] if t["kind"] == "nvme"]
    assert nvme[0]["used_bytes"] == 0
    _stop_cleanly(first)
    assert "24 chunk(s) moved into nvme before closing" in " ".join(first.log.read_text().split())
    second = daemon_factory(*args)
    assert _survivors(second.url, vals) == (24, 0)


def test_an_nvme_only_daemon_stores_and_keeps(daemon_factory: DaemonFactory, tmp_path: Path):
    cfg = tmp_path / "nvme-only.toml"
    cfg.write_text(
        f'[[tiers]]\nkind = "nvme"\ncapacity_bytes = "32MiB"\ndir = "{tmp_path / "nv"}"\n'
        "create_dirs = true\n"
    )
    # Without the fixture's host-tier settings (SMALL): this store has no host tier.
    args = (
        "--config",
        str(cfg),
        "--data-dir",
        str(tmp_path),
        "--set",
        "service.max_value_bytes=1MiB",
    )
    first = daemon_factory(*args, small=False)
    assert [t["kind"] for t in _stats(first.url)["store"]["tiers"]] == ["nvme"]
    vals = _put_all(first.url, 16)
    _stop_cleanly(first)
    second = daemon_factory(*args, small=False)
    assert _survivors(second.url, vals) == (16, 0)


def _wait_for(d: Daemon, text: str, timeout_s: float = 60.0) -> bool:
    """Wait until ``text`` shows in the daemon's log (whitespace-normalised)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in " ".join(d.log.read_text().split()):
            return True
        time.sleep(0.002)
    return False


def test_a_kill_during_the_shutdown_move_keeps_what_moved_and_nothing_wrong(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    # A service manager that runs out of patience (systemd's TimeoutStopSec) SIGKILLs a
    # daemon while it moves its host tier into nvme. What had moved (and been committed)
    # comes back with its exact bytes, the rest is a miss, the next daemon starts and
    # serves, and the killed daemon's shared-memory arena does not outlive it.
    args = _args(tmp_path / "data", "256MiB", "2GiB")
    moving = "chunk(s) (160.0 MiB) into nvme before closing"
    # A clean stop first: how long this machine's move of 160 chunks takes.
    d = start_daemon(tmp_path, *args)
    kept = _put_all(d.url, 160)
    d.proc.send_signal(signal.SIGTERM)
    assert _wait_for(d, moving), d.log.read_text()
    t0 = time.monotonic()
    assert _wait_for(d, "160 chunk(s) moved into nvme before closing"), d.log.read_text()
    move_s = time.monotonic() - t0
    assert d.proc.wait(60) in (0, -signal.SIGTERM)
    rounds: list[tuple[dict[str, bytes], bool, int]] = []
    for fraction in (0.0, 0.3, 0.7):
        d = start_daemon(tmp_path, *args)
        vals = _put_all(d.url, 160)
        d.proc.send_signal(signal.SIGTERM)
        assert _wait_for(d, moving), d.log.read_text()
        time.sleep(fraction * move_s)
        d.proc.kill()
        d.proc.wait()
        finished = "moved into nvme before closing" in " ".join(d.log.read_text().split())
        rounds.append((vals, finished, d.proc.pid))
    # The test means nothing unless some kill landed before the move finished.
    assert not all(finished for _, finished, _ in rounds), f"every move beat its kill ({move_s} s)"
    last = daemon_factory(*args)
    assert _survivors(last.url, kept) == (160, 0)  # the clean stop's chunks, untouched
    for vals, _, pid in rounds:
        assert _survivors(last.url, vals)[1] == 0  # some, all or none back; none wrong
        assert not list(SHM_DIR.glob(f"kvtier-{pid}-*")), f"arena of killed daemon {pid} left"
    nvme = next(t for t in _stats(last.url)["store"]["tiers"] if t["kind"] == "nvme")
    assert nvme["corrupt_chunks"] == 0, nvme
