"""Encryption at rest against real daemons: the nvme tier holds no value in clear, a
restart with the same key file reads everything back, another key file or none is a
clear error at start, and a flipped byte on disk is a counted miss, never bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("cryptography", reason="encryption needs: pip install 'kvtier[crypto]'")

import os
import subprocess
from pathlib import Path

import httpx

from kvtier.crypto import load_master_key

from .conftest import TOKENS, DaemonFactory, free_port, kvtier_cmd

VALUE = 256 * 1024


def _args(data_dir: Path) -> tuple[str, ...]:
    return (
        "--data-dir",
        str(data_dir),
        "--set",
        "encryption.enabled=true",
        "--set",
        "tenants.default_quota.host=32MiB",  # tenants on: a key per tenant
        "--set",
        "service.data_capacity_bytes=64MiB",
    )


def _read_all(url: str, vals: dict[tuple[str, str], bytes]) -> tuple[int, int, int]:
    """(values back with their bytes, with other bytes, misses)."""
    good = wrong = miss = 0
    for (tenant, k), v in vals.items():
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS[tenant]}"}) as c:
            r = c.get(f"/v1/chunks/{k}")
        if r.status_code == 404:
            miss += 1
        else:
            good += r.content == v
            wrong += r.content != v
    return good, wrong, miss


def _fails_to_start(data_dir: Path, tmp: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for t, tok in TOKENS.items():
        env[f"KVTIER_SERVICE__TOKENS__{t.upper()}"] = tok
    p = subprocess.run(
        [*kvtier_cmd(), "serve", "--port", str(free_port()), *_args(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode != 0
    return p.stdout + p.stderr


def test_sealed_at_rest_restart_reads_back_wrong_key_refused_flip_is_a_miss(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    d = daemon_factory(*_args(data), tokens=TOKENS)
    vals = {
        (t, os.urandom(16).hex()): os.urandom(VALUE) for t in ("alice", "bob") for _ in range(6)
    }
    for (tenant, k), v in vals.items():
        with httpx.Client(base_url=d.url, headers=d.headers(tenant)) as c:
            assert c.put(f"/v1/chunks/{k}", content=v).json()["stored"] == 1
    assert d.stop() in (0, -15)  # a clean close moves the host tier's chunks to nvme
    key_file = data / "master_key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    slabs = sorted((data / "nvme").glob("*.slab*"))
    disk = b"".join(p.read_bytes() for p in slabs)
    assert not any(v[4096:4160] in disk for v in vals.values())  # nothing in clear

    d = daemon_factory(*_args(data), tokens=TOKENS)  # the same key file: all back
    assert _read_all(d.url, vals) == (12, 0, 0)
    assert d.stop() in (0, -15)

    original = key_file.read_bytes()
    key_file.unlink()
    load_master_key(key_file, create=True)  # another key
    assert "encryption_key_file" in _fails_to_start(data, tmp_path)
    key_file.unlink()
    # No key file under an encrypted tier: the daemon makes a new key, and the tier
    # still refuses it rather than serving misses.
    assert "encryption_key_file" in _fails_to_start(data, tmp_path)
    key_file.write_bytes(original)

    # One byte flipped in the first sealed value on disk.
    slab = slabs[0]
    raw = bytearray(slab.read_bytes())
    first = next(i for i in range(0, len(raw), 4096) if any(raw[i : i + 64]))
    raw[first + 1000] ^= 0x01
    slab.write_bytes(bytes(raw))
    d = daemon_factory(*_args(data), tokens=TOKENS)
    good, wrong, miss = _read_all(d.url, vals)
    assert (good, wrong) == (11, 0) and miss == 1
