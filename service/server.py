"""Run the daemon under uvicorn (``kvtier serve``).

Start-up order: bind the port first (a busy port is a one-line ``ConfigError``, exit
status 2, before any memory or disk is taken), then build the store, then serve; the
``ready`` line comes from the app's lifespan once the store is open.

uvicorn handles SIGINT and SIGTERM: it stops accepting connections, waits up to
``service.shutdown_timeout_s`` for requests in flight, then runs the app's lifespan
shutdown, which flushes and closes the store (and so every tier). A stop asked for by a
signal is a clean exit: status 0, so ``make serve`` and service managers see no error.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import signal
import socket
import ssl
from pathlib import Path
from types import FrameType

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import TierSection
from kvtier.tiers.registry import is_shared_kind, tier_options_class

from . import malloc

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, as uvicorn would bind it.

    Listening at once means a client that connects while the store opens waits in the
    kernel's queue and is served when the daemon is ready, instead of being refused.

    Raises:
        ConfigError: the port is taken or the address is not this machine's; the message
            names ``service.port``/``service.host`` and how to pick another.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                "service.port",
                port,
                f"a free port: {host}:{port} is in use (another kvtier serve?); "
                "pass --port N (0 picks a free one) or set KVTIER_SERVICE__PORT",
            ) from None
        raise ConfigError(
            "service.host", host, f"an address of this machine to bind ({exc.strerror or exc})"
        ) from None
    return sock


def serve(cfg: KVTierConfig) -> None:
    """Bind, build the store and serve it until a signal stops the process. Blocking.

    Raises:
        ConfigError: an invalid configuration (including a non-loopback bind without
            tokens, refused when the configuration is loaded) or a busy port.
        PluginError: a tier kind that cannot be imported.
    """
    import uvicorn

    from kvtier.service.app import create_app
    from kvtier.service.dataplane import protocol_class

    cfg = with_data_dir(cfg)
    s = cfg.service
    sock = bind(s.host, s.port)
    malloc.tune()
    try:
        if s.tls_cert_file:  # a bad file or key: a one-line error before the store opens
            tls_context(s.tls_cert_file, s.tls_key_file)
        host, port = sock.getsockname()[:2]
        scheme = "https" if s.tls_cert_file else "http"
        log.info("kvtier daemon bound to %s://%s:%d; opening the store", scheme, host, port)
        app = create_app(cfg)
        config = uvicorn.Config(
            app,
            host=s.host,
            port=port,
            # The data-plane front end: answers one-chunk GETs and PUTs of memory tiers
            # below ASGI, and bounds every request head's size and time
            # (service.max_header_bytes, service.header_timeout_s).
            http=protocol_class(s.max_header_bytes, s.header_timeout_s, app.state.core),
            log_level=cfg.log_level.lower(),
            # uvicorn's records propagate to the one handler kvtier set up (one format,
            # one line each), instead of uvicorn's own handlers and format.
            log_config=None,
            access_log=False,  # one line per chunk would cost more than serving it
            lifespan="on",
            timeout_graceful_shutdown=int(s.shutdown_timeout_s) or None,
            server_header=False,
            # The daemon never reads X-Forwarded-*: without this, uvicorn wraps every
            # request in a middleware that parses them, at a CPU cost on every request.
            proxy_headers=False,
            # TLS on the listener (both set or neither: the config checks). The data plane
            # then writes through the TLS transport, never straight to the socket.
            ssl_certfile=s.tls_cert_file or None,
            ssl_keyfile=s.tls_key_file or None,
        )
        server = uvicorn.Server(config)
        stopped_by: list[int] = []

        def note(signum: int, frame: FrameType | None) -> None:
            stopped_by.append(signum)

        # uvicorn restores the handlers it found and re-raises the signal after its
        # graceful shutdown; noting it here (instead of dying of it) makes the stop exit 0.
        before = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
        if stopped_by:
            log.info("kvtier daemon stopped (%s)", signal.Signals(stopped_by[0]).name)
        elif not server.started:  # uvicorn logged why (e.g. the store failed to open)
            raise SystemExit(3)
    finally:
        sock.close()


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server TLS context of ``service.tls_cert_file`` and ``service.tls_key_file``.

    Raises:
        ConfigError: a file that cannot be read, or a key that does not match.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "service.tls_cert_file",
            cert_file,
            f"a PEM certificate chain whose key is service.tls_key_file ({exc})",
        ) from None
    return ctx


def with_data_dir(cfg: KVTierConfig) -> KVTierConfig:
    """``cfg`` plus an nvme tier under ``service.data_dir``, unless it has one already."""
    s = cfg.service
    if not s.data_dir:
        return cfg
    return with_nvme_under(cfg, Path(s.data_dir).expanduser() / "nvme", s.data_capacity_bytes)


def with_nvme_under(cfg: KVTierConfig, directory: str | Path, capacity_bytes: int) -> KVTierConfig:
    """``cfg`` plus an nvme tier in ``directory``, unless ``cfg`` already has one.

    The tier goes below the local tiers and above any shared one (Redis): a shared tier
    is the lowest level of the hierarchy.
    """
    if any(t.kind == "nvme" for t in cfg.tiers):
        return cfg
    options = tier_options_class("nvme")(dir=str(directory), create_dirs=True)
    section = TierSection("nvme", "nvme", capacity_bytes, options)
    at = next((i for i, t in enumerate(cfg.tiers) if is_shared_kind(t.kind)), len(cfg.tiers))
    return dataclasses.replace(cfg, tiers=(*cfg.tiers[:at], section, *cfg.tiers[at:]))
