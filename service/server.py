"""Run the daemon under uvicorn (``kvtier serve``).

uvicorn handles SIGINT and SIGTERM: it stops accepting connections, waits up to
``service.shutdown_timeout_s`` for requests in flight, then runs the app's lifespan
shutdown, which flushes and closes the store (and so every tier).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.config import KVTierConfig

log = logging.getLogger(__name__)


def serve(cfg: KVTierConfig) -> None:
    """Build the store and serve it until a signal stops the process. Blocking.

    Raises:
        ConfigError: an invalid configuration (including a non-loopback bind without
            tokens, refused when the configuration is loaded).
        PluginError: a tier kind that cannot be imported.
    """
    import uvicorn

    from kvtier.service.app import create_app
    from kvtier.service.headlimit import protocol_class

    cfg = with_data_dir(cfg)
    app = create_app(cfg)
    s = cfg.service
    config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        # Bounds the request head's size and time (service.max_header_bytes, header_timeout_s).
        http=protocol_class(s.max_header_bytes, s.header_timeout_s),
        log_level=cfg.log_level.lower(),
        access_log=False,  # one line per chunk would cost more than serving it
        lifespan="on",
        timeout_graceful_shutdown=int(s.shutdown_timeout_s) or None,
        server_header=False,
    )
    server = uvicorn.Server(config)
    log.info("kvtier daemon listening on http://%s:%d", s.host, s.port)
    server.run()


def with_data_dir(cfg: KVTierConfig) -> KVTierConfig:
    """``cfg`` plus an nvme tier under ``service.data_dir``, unless it has one already."""
    from kvtier.factory import with_nvme_under

    s = cfg.service
    if not s.data_dir:
        return cfg
    return with_nvme_under(cfg, Path(s.data_dir).expanduser() / "nvme", s.data_capacity_bytes)
