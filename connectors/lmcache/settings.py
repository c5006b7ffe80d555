"""Reading the kvtier plug points' settings out of LMCache's ``extra_config``.

LMCache finds a plug-in by name: ``remote_storage_plugins: ["kvtier"]`` reads
``remote_storage_plugin.kvtier.*`` and ``storage_plugins: ["kvtier"]`` reads
``storage_plugin.kvtier.*``. LMCache does not tell the class which name it was loaded
under, so the class looks for the names whose ``class_name`` is its own (any name
works, ``kvtier`` is the documented one). Imports nothing from LMCache.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.units import GiB, parse_size

from .link import DaemonSettings

REMOTE_PREFIX = "remote_storage_plugin"
STORAGE_PREFIX = "storage_plugin"
DEFAULT_NAME = "kvtier"
# Shared memory the remote plug-in's loads land in (see .pool): 32 chunks of Llama-3-8B.
DEFAULT_SHARED_BYTES = 1 * GiB


def plugin_name(
    extra: Mapping[str, Any] | None, names: Iterable[str] | None, prefix: str, class_name: str
) -> str:
    """The name this class was configured under (``kvtier`` unless set otherwise).

    Raises:
        ConfigError: two names point at the same class (their settings would be ambiguous).
    """
    extra = extra or {}
    mine = [n for n in names or () if extra.get(f"{prefix}.{n}.class_name") == class_name]
    if len(mine) > 1:
        raise ConfigError(f"{prefix}s", sorted(mine), f"one plug-in of class {class_name}")
    return mine[0] if mine else DEFAULT_NAME


def daemon_settings(extra: Mapping[str, Any] | None, where: str) -> DaemonSettings:
    """``url``, ``token`` and ``timeout_s`` under ``where`` (e.g. ``remote_storage_plugin.kvtier``).

    Raises:
        ConfigError: no ``url``, a URL that is not http(s), or a bad timeout.
    """
    extra = extra or {}
    url = extra.get(f"{where}.url")
    if not url or not isinstance(url, str):
        raise ConfigError(f"{where}.url", url, "the http:// URL of a kvtier daemon")
    raw_timeout = extra.get(f"{where}.timeout_s", 5.0)
    try:
        timeout_s = float(raw_timeout)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.timeout_s", raw_timeout, "seconds > 0") from exc
    token = extra.get(f"{where}.token") or None
    try:
        return DaemonSettings(url, str(token) if token else None, timeout_s)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc.key}", exc.value, exc.allowed) from None


def shared_bytes(extra: Mapping[str, Any] | None, where: str) -> int:
    """``shared_bytes`` under ``where``: the size of the load pool shared with a daemon on
    this host (``0`` turns it off; default :data:`DEFAULT_SHARED_BYTES`).

    Raises:
        ConfigError: not a size, or negative.
    """
    raw = (extra or {}).get(f"{where}.shared_bytes", DEFAULT_SHARED_BYTES)
    try:
        n = parse_size(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.shared_bytes", raw, "a size such as 1GiB, or 0") from exc
    if n < 0:
        raise ConfigError(f"{where}.shared_bytes", raw, "a size >= 0")
    return n


def params_settings(params: Mapping[str, Any]) -> DaemonSettings:
    """The L2 adapter's ``adapter_params``: ``url``, optional ``token`` and ``timeout_s``.

    Raises:
        ConfigError: as :func:`daemon_settings`, or keys it does not know.
    """
    unknown = sorted(set(params) - {"url", "token", "timeout_s"})
    if unknown:
        raise ConfigError("adapter_params", unknown, "only url, token, timeout_s")
    return daemon_settings({f"adapter_params.{k}": v for k, v in params.items()}, "adapter_params")
