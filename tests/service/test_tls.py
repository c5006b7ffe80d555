"""TLS on the daemon's HTTP listener, against real daemons with a certificate made here.

The client verifies the daemon's certificate (``ca_file``); the data plane answers
one-chunk GETs and PUTs over TLS as over plain HTTP, through the TLS transport.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("cryptography", reason="makes the test's certificate")

import asyncio
import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvtier.config import load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.service.client import AsyncClient, Client
from tests.procs import stop_process

from .conftest import SMALL, TOKENS, free_port, kvtier_cmd

KiB = 1024


def _self_signed(tmp: Path, name: str = "kvtier-test") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


class TLSDaemon:
    def __init__(self, tmp: Path, cert: Path, key: Path) -> None:
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        self.cert = cert
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        for tenant, token in TOKENS.items():
            env[f"KVTIER_SERVICE__TOKENS__{tenant.upper()}"] = token
        self.log = tmp / f"daemon-tls-{port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    *kvtier_cmd(),
                    "serve",
                    "--port",
                    str(port),
                    *SMALL,
                    "--set",
                    f"service.tls_cert_file={cert}",
                    "--set",
                    f"service.tls_key_file={key}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        ctx = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/readyz", verify=ctx, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"daemon did not become ready:\n{self.log.read_text()}")

    def metric(self, name: str) -> int:
        ctx = ssl.create_default_context(cafile=str(self.cert))
        text = httpx.get(
            f"{self.url}/metrics",
            headers={"Authorization": f"Bearer {TOKENS['alice']}"},
            verify=ctx,
        ).text
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def stop(self) -> int:
        return stop_process(self.proc)


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSDaemon]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(tmp)
    d = TLSDaemon(tmp, cert, key)
    yield d
    rc = d.stop()
    assert rc in (0, -signal.SIGTERM), d.log.read_text()
    assert "store closed" in d.log.read_text()


def test_a_client_that_verifies_the_certificate_moves_values_bytes_equal(
    tls_daemon: TLSDaemon,
) -> None:
    d = tls_daemon
    direct_before = d.metric("kvtier_http_direct_answers_total")
    keys = [os.urandom(16) for _ in range(4)]
    values = [os.urandom(n) for n in (256 * KiB, 1024 * KiB, 77, 256 * KiB)]
    with Client(d.url, TOKENS["alice"], ca_file=str(d.cert), same_host=False) as c:
        for k, v in zip(keys, values, strict=True):
            assert c.put(k, v).stored == 1
        for k, v in zip(keys, values, strict=True):
            assert c.get(k) == v
        assert c.get(os.urandom(16)) is None
        assert c.lookup(keys).hits == 4
    # The one-chunk GETs and PUTs were answered by the data plane, over TLS.
    assert d.metric("kvtier_http_direct_answers_total") >= direct_before + 8
    with Client(d.url, TOKENS["bob"], ca_file=str(d.cert), same_host=False) as c:
        assert c.get(keys[0]) is None  # another tenant's key space, as over plain HTTP


def test_the_async_client_verifies_and_moves_values_too(tls_daemon: TLSDaemon) -> None:
    d = tls_daemon
    key, value = os.urandom(16), os.urandom(300 * KiB)

    async def main() -> bytes | None:
        async with AsyncClient(d.url, TOKENS["alice"], ca_file=str(d.cert), same_host=False) as c:
            assert (await c.put(key, value)).stored == 1
            return await c.get(key)

    assert asyncio.run(main()) == value


def test_a_certificate_the_client_does_not_trust_is_refused(
    tls_daemon: TLSDaemon, tmp_path: Path
) -> None:
    d = tls_daemon
    other, _ = _self_signed(tmp_path, "someone-else")
    for ca_file in (None, str(other)):  # the system's CAs, or another certificate
        with (
            Client(d.url, TOKENS["alice"], ca_file=ca_file, same_host=False, retry=None) as c,
            pytest.raises(KVTierError),
        ):
            c.get(os.urandom(16))


def test_plain_http_to_a_tls_daemon_gets_no_answer(tls_daemon: TLSDaemon) -> None:
    port = int(tls_daemon.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while True:
            piece = s.recv(4096)
            if not piece:
                break
            data += piece
        assert b"HTTP/1.1 200" not in data and b'"ok"' not in data
    assert tls_daemon.proc.poll() is None


def test_tls_settings_are_checked_at_start(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    env: dict[str, str] = {}
    with pytest.raises(ConfigError, match=r"service\.tls_key_file"):
        load_config(env=env, overrides=[f"service.tls_cert_file={cert}"])
    with pytest.raises(ConfigError, match=r"service\.tls_cert_file"):
        load_config(env=env, overrides=[f"service.tls_key_file={key}"])
    # TLS does not open a bind beyond loopback to anyone: tokens are still required.
    tls = [f"service.tls_cert_file={cert}", f"service.tls_key_file={key}"]
    with pytest.raises(ConfigError, match=r"service\.tokens"):
        load_config(env=env, overrides=[*tls, "service.host=0.0.0.0"])
    load_config(
        env={"KVTIER_SERVICE__TOKENS__ALICE": TOKENS["alice"]},
        overrides=[*tls, "service.host=0.0.0.0"],
    )
    # A key that is not the certificate's: one line, exit status 2, before serving.
    _, wrong_key = _self_signed(tmp_path, "other")
    env_run = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    run = subprocess.run(
        [
            *kvtier_cmd(),
            "serve",
            "--port",
            str(free_port()),
            *SMALL,
            "--set",
            f"service.tls_cert_file={cert}",
            "--set",
            f"service.tls_key_file={wrong_key}",
        ],
        capture_output=True,
        env=env_run,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr.decode()
    assert b"service.tls_cert_file" in run.stderr


def test_the_vllm_connectors_daemon_mode_verifies_the_daemon(tls_daemon: TLSDaemon) -> None:
    np = pytest.importorskip("numpy")
    from kvtier.connectors.vllm.remote import RemoteStore
    from kvtier.connectors.vllm.settings import daemon_from_extra

    d = tls_daemon
    extra = {"url": d.url, "token": TOKENS["alice"], "daemon_timeout_s": 5, "ca_file": str(d.cert)}
    settings = daemon_from_extra(extra)
    assert settings is not None and settings.ca_file == str(d.cert)
    chunk = 64 * KiB
    store = RemoteStore(settings, chunk)
    try:
        keys = [os.urandom(16) for _ in range(3)]
        data = np.frombuffer(os.urandom(3 * chunk), dtype=np.uint8).copy()
        assert store.put(keys, data).result().stored == 3
        out = np.zeros_like(data)
        assert store.get(keys, out).result().chunks == 3
        assert out.tobytes() == data.tobytes()
    finally:
        store.close()
    # Without the CA it trusts nothing the daemon says: every call is a miss, none raises.
    untrusting = RemoteStore(daemon_from_extra({**extra, "ca_file": ""}) or settings, chunk)
    try:
        assert untrusting.lookup(keys).hits == 0
    finally:
        untrusting.close()
