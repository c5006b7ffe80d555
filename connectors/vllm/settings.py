"""The connector's configuration. Imports nothing from vLLM or from the connector's other modules.

Configuration: ``kv_connector_extra_config`` holds ``config_file`` (a kvtier TOML)
and/or inline kvtier settings, either dotted (``"store.chunk_tokens": 64``) or nested
tables (``"store": {"chunk_tokens": 64}``, ``"tiers": [{"kind": "host", ...}]``).
Layering: embedded default, then the file, then the nested tables, then ``KVTIER_*``
environment variables, then the dotted keys. Both sides of vLLM load the same
configuration from the same JSON, so they agree on chunk size and capacity.

Daemon mode (remote.py): ``url``, ``token``, ``daemon_timeout_s`` and ``ca_file`` (the
CA certificates an ``https://`` daemon is verified against) name a running
``kvtier serve`` instead of an embedded store; ``prefill_wait_s`` bounds a consumer's
wait for a named prefill (handoff.py); ``model_version`` names the weights (weights.py);
``async_loads`` says which loads run off the engine step. They are the connector's own
keys, not kvtier settings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig, default_toml, load_config, merge, read_toml
from kvtier.errors import ConfigError

CONFIG_FILE_KEY = "config_file"
URL_KEY = "url"
TOKEN_KEY = "token"
TIMEOUT_KEY = "daemon_timeout_s"
CA_FILE_KEY = "ca_file"
DAEMON_KEYS = frozenset({URL_KEY, TOKEN_KEY, TIMEOUT_KEY, CA_FILE_KEY})
PREFILL_WAIT_KEY = "prefill_wait_s"
MODEL_VERSION_KEY = "model_version"
ASYNC_LOADS_KEY = "async_loads"
# The connector's own keys of kv_connector_extra_config: not kvtier settings.
CONNECTOR_KEYS = DAEMON_KEYS | {
    CONFIG_FILE_KEY,
    PREFILL_WAIT_KEY,
    MODEL_VERSION_KEY,
    ASYNC_LOADS_KEY,
}
# How long a consumer waits, at most, for a prefill named in kv_transfer_params (handoff.py).
DEFAULT_PREFILL_WAIT_S = 5.0

# How many more chunks the scheduler's mirror of the store may list than the store can
# hold. The mirror learns about evictions lazily (a failed load removes the key), so it
# over-approximates; a stale entry costs one failed load, i.e. the recompute a miss
# costs anyway. Listing fewer than the store holds would lose real hits.
MIRROR_SLACK = 2


def config_from_extra(
    extra: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> KVTierConfig:
    """Load the kvtier configuration named by a connector's extra config.

    Raises:
        ConfigError: an unreadable file, an unknown key or a bad value.
    """
    raw = default_toml()
    path = extra.get(CONFIG_FILE_KEY)
    if path:
        raw = merge(raw, read_toml(path))
    nested: dict[str, Any] = {}
    dotted: list[str] = []
    for key, value in extra.items():
        if key in CONNECTOR_KEYS:
            continue
        if "." in key:
            dotted.append(f"{key}={value}")
        else:
            nested[key] = value
    raw = merge(raw, nested)
    return load_config(None, env=env, overrides=dotted, base=raw)


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """How kvtier's chunks tile vLLM's blocks; build with :meth:`of`.

    Attributes:
        chunk_tokens: tokens per chunk (``store.chunk_tokens``).
        block_size: tokens per vLLM block (``cache_config.block_size``).
        blocks_per_chunk: vLLM blocks in one chunk.
    """

    chunk_tokens: int
    block_size: int
    blocks_per_chunk: int

    @classmethod
    def of(cls, chunk_tokens: int, block_size: int) -> ChunkShape:
        """The shape, or a ConfigError when the chunk does not tile vLLM's blocks."""
        if block_size <= 0 or chunk_tokens < block_size or chunk_tokens % block_size:
            raise ConfigError(
                "store.chunk_tokens",
                chunk_tokens,
                f"a multiple of vLLM's block_size ({block_size})",
            )
        return cls(chunk_tokens, block_size, chunk_tokens // block_size)


def mirror_capacity(cfg: KVTierConfig, chunk_bytes: int) -> int:
    """Chunks the scheduler-side mirror may list: the store's capacity, with slack."""
    total = sum(t.capacity_bytes for t in cfg.tiers)
    return max(1, MIRROR_SLACK * total // max(1, chunk_bytes))


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Where the shared daemon is, and how long a step may wait for it.

    Attributes:
        url: the daemon's base URL, e.g. ``http://127.0.0.1:8470``.
        token: bearer token of the tenant; None for a daemon without tokens (loopback).
        timeout_s: read/write timeout of one request, in seconds (connect: half of it).
        ca_file: PEM file of the CAs an ``https://`` daemon's certificate is verified
            against; None: the system's.
    """

    url: str
    token: str | None = None
    timeout_s: float = 1.0
    ca_file: str | None = None


def daemon_from_extra(extra: Mapping[str, Any]) -> DaemonSettings | None:
    """The daemon settings of a connector's extra config, or None for the embedded store.

    Raises:
        ConfigError: a ``url`` that is not http(s), or a non-positive timeout.
    """
    url = extra.get(URL_KEY)
    if not url:
        if extra.get(TOKEN_KEY):
            raise ConfigError(TOKEN_KEY, "***", "set together with 'url'")
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(URL_KEY, url, "an http:// or https:// URL of a kvtier daemon")
    try:
        timeout_s = float(extra.get(TIMEOUT_KEY, 1.0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(TIMEOUT_KEY, extra.get(TIMEOUT_KEY), "seconds > 0") from exc
    if timeout_s <= 0:
        raise ConfigError(TIMEOUT_KEY, timeout_s, "seconds > 0")
    token = extra.get(TOKEN_KEY) or None
    ca_file = extra.get(CA_FILE_KEY) or None
    return DaemonSettings(
        url, str(token) if token else None, timeout_s, str(ca_file) if ca_file else None
    )


def prefill_wait_from_extra(extra: Mapping[str, Any]) -> float:
    """Longest wait of a consumer for a prefill named in ``kv_transfer_params``, in seconds.

    Raises:
        ConfigError: not a number >= 0.
    """
    raw = extra.get(PREFILL_WAIT_KEY, DEFAULT_PREFILL_WAIT_S)
    try:
        wait_s = float(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(PREFILL_WAIT_KEY, raw, "seconds >= 0") from exc
    if not wait_s >= 0 or wait_s == float("inf"):
        raise ConfigError(PREFILL_WAIT_KEY, raw, "seconds >= 0")
    return wait_s


def model_version_from_extra(extra: Mapping[str, Any]) -> str | None:
    """The operator's name for the weights (``model_version``), or None when not set.

    Raises:
        ConfigError: set, but not a non-empty string or number.
    """
    raw = extra.get(MODEL_VERSION_KEY)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, str | int | float) or not str(raw).strip():
        raise ConfigError(MODEL_VERSION_KEY, raw, "a non-empty string naming the weights")
    return str(raw).strip()


class AsyncLoads(enum.Enum):
    """Which loads run off the engine step (``async_loads``; docs/connector.md).

    An asynchronous load does not stall the batch: its request waits while the other
    requests keep running, and starts one or two steps after its chunks are in place. A
    synchronous load completes before the step's forward, so its request starts at once,
    but every request of the step waits for it.
    """

    AUTO = "auto"
    """Daemon mode: every load. Embedded store: a load of chunks that may be below the
    memory tiers (nvme, Redis); chunks this engine stored or loaded recently, within
    what its memory tiers hold, load synchronously."""
    ON = "on"
    """Every load."""
    OFF = "off"
    """None: every load completes before the step's forward (the behaviour before)."""


def async_loads_from_extra(extra: Mapping[str, Any]) -> AsyncLoads:
    """The ``async_loads`` setting (default ``auto``).

    Raises:
        ConfigError: not one of ``auto``, ``on``, ``off``.
    """
    raw = extra.get(ASYNC_LOADS_KEY, AsyncLoads.AUTO.value)
    try:
        return AsyncLoads(str(raw).strip().lower())
    except ValueError:
        raise ConfigError(ASYNC_LOADS_KEY, raw, "one of auto, on, off") from None
