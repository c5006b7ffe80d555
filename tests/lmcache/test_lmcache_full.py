"""A kvtier store that cannot take more, under a real LMCache 0.5.6 engine (issue 14).

The full store is real: the nvme tier's directory sits on a small tmpfs mounted for the
test (as root; skipped with the reason otherwise) and filled to ENOSPC with a filler
file, as tests/service/test_full_disk.py does for the daemon. Through both plug points
(embedded store; daemon behind the remote plug-in): stores are dropped with a reason in
LMCache's process log, lookups and retrieves from kvtier miss, LMCache keeps serving
from its local CPU copy, and once the disk has room again stores and hits resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")

import httpx
import torch

from tests.connectors.lmcache_engine import (
    CHUNK,
    PLUGIN,
    REMOTE,
    TOKEN_BYTES,
    Engine,
    engine,
    nvme_toml,
    plugin_config,
    prompt,
    remote_config,
)
from tests.service.conftest import start_daemon
from tests.tmpfs import fill, mounted_tmpfs

N_TOKENS = 4 * CHUNK + 5
FULL = 4 * CHUNK


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    # 16 MiB: room, once the filler is gone, for the daemon's slab to grow by a run of
    # its 1 MiB slots (max_value_bytes) plus the journal.
    with mounted_tmpfs(
        tmp_path, "16m", "needs root to mount a small tmpfs (a real full disk); not root here"
    ) as mnt:
        yield mnt


def _wait_put_over(url: str, chunks: int, timeout_s: float = 60.0) -> None:
    """Wait until the daemon has stored or refused ``chunks`` chunks (its own counters):
    a lookup before then could count a put still in flight, however slow the machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = httpx.get(f"{url}/v1/stats", timeout=5).json()["store"]
        if st["put_chunks"] + st["put_rejected"] >= chunks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the daemon did not finish the put: {st}")
        time.sleep(0.05)


def _equal(out: torch.Tensor, kv: torch.Tensor, n: int) -> bool:
    return bool(torch.equal(out[: n * TOKEN_BYTES], kv[: n * TOKEN_BYTES]))


def _serves_from_local_cpu_but_kvtier_misses(
    e: Engine, backend: str, tokens: list[int], kv: torch.Tensor
) -> None:
    e.store(tokens, kv)
    # The store to kvtier is asynchronous: give it time to fail, then check nothing is held.
    assert e.wait_stored(tokens, backend, timeout_s=3) == 0
    # LMCache keeps serving its own copy, bytes equal.
    n, out = e.retrieve(tokens)
    assert n == FULL and _equal(out, kv, n)
    # Without it, kvtier answers misses (no crash, no wrong bytes).
    e.drop_local(tokens)
    assert e.lookup(tokens) == 0
    n, _ = e.retrieve(tokens)
    assert n == 0


def test_plugin_on_a_full_disk_misses_with_a_reason_while_lmcache_serves(
    tmp_path: Path, small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(nvme_toml(small_fs))
    tokens, kv = prompt(21, N_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvtier")
    with engine(plugin_config(str(cfg))) as e:
        assert PLUGIN in e.backends()
        filler = fill(small_fs)
        _serves_from_local_cpu_but_kvtier_misses(e, PLUGIN, tokens, kv)
        messages = [r.getMessage() for r in caplog.records]
        assert any("No space left" in m for m in messages), caplog.text
        assert any("was not kept" in m for m in messages), caplog.text

        # Room again: the next store goes down to kvtier and hits from there.
        filler.unlink()
        e.store(tokens, kv)
        assert e.wait_stored(tokens, PLUGIN) == FULL
        e.drop_local(tokens)
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)


def test_remote_to_a_daemon_on_a_full_disk_misses_with_a_reason_while_lmcache_serves(
    tmp_path: Path, small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(nvme_toml(small_fs))
    d = start_daemon(tmp_path, "--config", str(cfg), small=False)
    tokens, kv = prompt(22, N_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvtier")
    try:
        with engine(remote_config(d.url)) as e:
            assert REMOTE in e.backends()
            filler = fill(small_fs)
            _serves_from_local_cpu_but_kvtier_misses(e, REMOTE, tokens, kv)
            assert any("kept 0 of" in r.getMessage() for r in caplog.records), caplog.text
            assert "No space left" in d.log.read_text()
            assert d.proc.poll() is None  # the daemon still runs

            filler.unlink()
            e.store(tokens, kv)
            assert e.wait_stored(tokens, REMOTE) == FULL
            e.drop_local(tokens)
            n, out = e.retrieve(tokens)
            assert n == FULL and _equal(out, kv, n)
    finally:
        d.stop()


def _two_slot_host_toml(tmp_path: Path, *more: str) -> Path:
    """A kvtier config of one host tier holding two of the prompt's chunks, admitting
    every chunk; ``more`` lines are appended."""
    cfg = tmp_path / "kvtier.toml"
    lines = [
        "[[tiers]]",
        'kind = "host"',
        f"capacity_bytes = {2 * CHUNK * TOKEN_BYTES}",
        'pin = "off"',
        "",
        "[store]",
        'placement = "keep"',
        "",
        *more,
        "",
    ]
    cfg.write_text("\n".join(lines))
    return cfg


def test_plugin_on_a_store_full_by_capacity_keeps_a_prefix_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Full by capacity, not by disk: one host tier of two slots under a four-chunk
    prompt. The store keeps what fits of the prompt's head (a sequence never pushes out
    its own head), says why it dropped the rest, and never serves a wrong byte."""
    cfg = _two_slot_host_toml(tmp_path)
    tokens, kv = prompt(23, N_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvtier")
    with engine(plugin_config(str(cfg))) as e:
        assert PLUGIN in e.backends()
        e.store(tokens, kv)
        e.wait_stored(tokens, PLUGIN, timeout_s=3)  # never all of it: waits the 3 s
        e.backend(PLUGIN).store.drain()  # the put is over, however slow the machine
        held = e.lookup(tokens, PLUGIN)
        assert 0 < held < FULL, held  # the head that fits, not the whole prompt
        assert any("was not kept" in r.getMessage() for r in caplog.records), caplog.text
        # One store put for LMCache's batch: per-chunk puts raced on the I/O threads,
        # and a tail chunk could take the room before the head's put ran.
        assert e.backend(PLUGIN).store.stats().puts == 1
        n, out = e.retrieve(tokens)  # LMCache's own copy still serves all of it
        assert n == FULL and _equal(out, kv, n)
        e.drop_local(tokens)
        assert e.lookup(tokens) == held
        n, out = e.retrieve(tokens)
        assert n == held and _equal(out, kv, n)


def test_remote_to_a_daemon_full_by_capacity_keeps_a_prefix(tmp_path: Path) -> None:
    """The remote plug-in's counterpart: a daemon whose one host tier holds two of the
    prompt's four chunks keeps a head of the prompt, never a tail it cannot serve."""
    slot = CHUNK * TOKEN_BYTES
    # Memory only (data_dir ""): no nvme tier under the user's data directory.
    cfg = _two_slot_host_toml(tmp_path, "[service]", f"max_value_bytes = {slot}", 'data_dir = ""')
    d = start_daemon(tmp_path, "--config", str(cfg), small=False)
    tokens, kv = prompt(24, N_TOKENS)
    try:
        with engine(remote_config(d.url)) as e:
            assert REMOTE in e.backends()
            e.store(tokens, kv)
            _wait_put_over(d.url, FULL // CHUNK)  # LMCache's put to the daemon is async
            held = e.lookup(tokens, REMOTE)
            assert 0 < held < FULL, held
            e.drop_local(tokens)
            assert e.lookup(tokens) == held
            n, out = e.retrieve(tokens)
            assert n == held and _equal(out, kv, n)
    finally:
        d.stop()
