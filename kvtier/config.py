"""Typed, frozen, validated configuration, loaded in one place.

Precedence: the embedded default (``kvtier/default.toml``), then a TOML file, then
``KVTIER_*`` environment variables, then CLI ``--set`` flags. Every setting is listed in
``docs/configuration.md``.

Environment variables address nested keys with double underscores:
``KVTIER_STORE__CHUNK_TOKENS=512``, ``KVTIER_TIERS__0__CAPACITY_BYTES=8GiB``. Flags use
dots: ``--set store.chunk_tokens=512``.

Each tier section is validated against the options class of its ``kind``, so every
component receives only its own typed section.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import ipaddress
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from kvtier import plugins
from kvtier.enums import Switch as Switch  # re-exported: configs name it with their options
from kvtier.errors import ConfigError
from kvtier.tiers.base import TierSection
from kvtier.units import GiB, parse_size

T = TypeVar("T")

ENV_PREFIX = "KVTIER_"
MAX_SIZE_BYTES = 1 << 62  # far past any machine; larger sizes overflow allocators
# The one environment variable without the nested form: people type it. It is
# service.data_dir, like KVTIER_SERVICE__DATA_DIR (which wins when both are set).
DATA_DIR_ENV = "KVTIER_DATA_DIR"

# Top-level settings have no section to nest under, so their variables are read by name
# (KVTIER_LOG_LEVEL, KVTIER_LOG_FORMAT); any other KVTIER_* name without "__" is left
# alone: it is not configuration (a client's KVTIER_TOKEN, say).
TOP_LEVEL_ENV = {f"{ENV_PREFIX}{key.upper()}": key for key in ("log_level", "log_format")}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model's KV the store holds (used for key namespaces and the demo)."""

    # A preset name (llama-3-8b, llama-3-70b, qwen2-7b, mixtral-8x7b, deepseek-v3) or a
    # path to a Hugging Face config.json or its directory.
    name: str = "llama-3-8b"
    # Override of the cache dtype; empty means the model config's torch_dtype.
    dtype: str = ""
    tp_size: int = 1
    tp_rank: int = 0


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The tiered store's own settings."""

    # Tokens per chunk, the unit of prefix matching. A multiple of the engine block size.
    chunk_tokens: int = 256
    # Largest extent (adaptive page), in bytes. Runs longer than this take several
    # extents. Large values mean fewer, larger transfers; see docs/architecture.md.
    max_extent_bytes: int = 4 * GiB
    # Threads that copy and do I/O off the caller's thread.
    io_threads: int = 4
    # On a hit in a lower tier, copy the chunk back into the top tier.
    promote_on_hit: bool = True
    # Eviction order of every tier: "lru" in the core; kvtier.policies adds "arc", "cost".
    eviction: str = "lru"
    # What is admitted and where victims go: "keep" (write everything, demote tier by
    # tier: the peers' write-through) or "cost" (kvtier.policies' latency-cost model with
    # an SSD write budget; see docs/cost-model.md). Unset: the default of the program
    # that runs the store (kvtier.plugins.default): "cost" wherever kvtier.policies is
    # composed in (the kvtier CLI and daemon, the engine connectors), "keep" for a program
    # that uses the core alone.
    placement: str = field(default_factory=lambda: plugins.default(plugins.PLACEMENT))


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """The economics behind ``store.placement = "cost"`` (docs/cost-model.md).

    ``kvtier calc --write-config`` fills this section with the plan it chose.
    """

    # $ per second of a user's waiting (TTFT) that a hit saves, on top of the GPU's own
    # cost. The default prices a second of waiting like a second of one H200 ($3.60/h);
    # 0 values GPU time only (batch work). Reasoning: docs/cost-model.md, section 1.
    value_of_latency_per_s: float = 0.001
    # Prices and speeds of the tiers (kvtier calc's --hardware): a preset
    # (h200-dram-nvme, h200-dram-cxl-nvme, h200-dram-qlc, h200-dram-redis) or a hardware
    # TOML file. Each tier takes the entry of the same name, else the first of its
    # medium (host: DRAM, cxl: CXL, nvme: SSD, redis: remote).
    hardware: str = "h200-dram-nvme"
    # Model whose prefill a hit saves: a preset (llama-3-8b, ...) or a config.json path.
    # Empty: [model].name.
    model: str = ""
    # GPUs that prefill one request; 0: the model preset's count.
    gpus: int = 0
    # The GPU that recomputes: dense peak FLOP/s, the share of it prefill reaches, and
    # $ per GPU-hour (defaults: an H200 SXM at 50% MFU and $3.50/h).
    gpu_peak_flops: float = 989e12
    gpu_mfu: float = 0.5
    gpu_cost_per_hour: float = 3.5
    # Typical tokens of context before a chunk: a chunk deep in a long prompt costs more
    # to recompute (the attention term).
    context_tokens: int = 8192
    # Seconds to recompute one chunk. 0: from the model, the GPU and context_tokens.
    # kvtier calc writes the average over its workload here.
    recompute_s: float = 0.0
    # SSD write budget: drive writes per day of each wearing tier's capacity that
    # demotions may spend (0.8 = 80% of a 1-DWPD drive's rating).
    write_budget_dwpd: float = 0.8
    # Window over which the budget holds, seconds (60 .. 86400): in any window at most
    # write_budget_dwpd x capacity x window / 1 day is written by demotions.
    write_budget_window_s: float = 86400.0


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """The REST daemon (``kvtier serve``): where it listens, who may use it, its limits."""

    # Address to bind. Anything but loopback requires at least one token (the daemon
    # refuses to start without one).
    host: str = "127.0.0.1"
    # TCP port to listen on.
    port: int = 8470
    # Tenant name -> bearer token. Empty: no authentication, allowed on loopback only,
    # and every request belongs to the anonymous tenant "". Set tokens through the
    # environment (KVTIER_SERVICE__TOKENS__ALICE=...) to keep them out of files.
    tokens: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    # Secret that separates tenants' key spaces inside the store. Empty: a random salt
    # per process, so chunks a persistent tier recovers after a restart are unreachable.
    key_salt: str = field(default="", repr=False)
    # Largest value (one chunk) the daemon accepts; also the store's slot size.
    # 0: the bytes of one chunk of [model] (store.chunk_tokens tokens).
    max_value_bytes: int = 0
    # Largest request body, and largest batch-get response, in bytes.
    max_body_bytes: int = 256 * 1024 * 1024
    # Most keys in one lookup, batch get or batch put.
    max_batch_keys: int = 1024
    # Bound on the bytes of all request bodies (and batch-get answers) in flight
    # together; past it a request is answered 503 with Retry-After. At least
    # max_body_bytes.
    max_inflight_bytes: int = 1 * GiB
    # Seconds a request that does not fit in max_inflight_bytes waits (in arrival order,
    # before its body is read) for others to finish; then 503. 0: refuse at once.
    inflight_wait_s: float = 2.0
    # Largest request head (request line and headers), in bytes; larger: 431.
    max_header_bytes: int = 32 * 1024
    # Seconds a client may take to send a request's head; slower: the connection closes.
    header_timeout_s: float = 10.0
    # Seconds uvicorn waits for in-flight requests on shutdown before closing the store.
    shutdown_timeout_s: float = 10.0
    # A directory for what must outlive the process: when set and no [[tiers]] entry is
    # an nvme tier, the daemon adds one of data_capacity_bytes under <data_dir>/nvme, and
    # keeps a generated key_salt in <data_dir>/key_salt (mode 0600) so the chunks it
    # recovers after a restart stay reachable. Empty: memory tiers only.
    data_dir: str = ""
    # Capacity of the nvme tier that data_dir adds.
    data_capacity_bytes: int = 8 * GiB
    # Unix socket of the same-host channel (clients on this machine exchange values
    # through shared memory they create; docs/operations.md). "auto": a fresh private
    # directory (mode 0700) in $XDG_RUNTIME_DIR or the temp dir, removed at shutdown;
    # a path: that socket (its directory made 0700); "": off, HTTP only.
    socket: str = "auto"
    # Largest shared-memory region one same-host client may hand the daemon to map.
    socket_max_region_bytes: int = 1 * GiB
    # Seconds a same-host connection may take to authenticate (its HELLO with a valid
    # token); slower: closed, so idle connections cannot hold every slot.
    socket_auth_timeout_s: float = 10.0
    # TLS on the HTTP listener: a PEM certificate chain and its private key (both, or
    # neither). Set, the daemon speaks HTTPS only.
    tls_cert_file: str = ""
    tls_key_file: str = ""


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Per-tenant byte quotas per tier. Tenants are the daemon's token names (the
    anonymous tenant "" without tokens). Any quota set turns tenants on: each chunk key then carries
    its tenant's tag, so chunks stored before quotas were turned on are unreachable."""

    # Tier name -> byte limit for every tenant not named in `quotas` ("1GiB"). A tier
    # not listed is unlimited. Empty, with `quotas` empty: no tenants, no quotas.
    default_quota: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Tenant name -> {tier name -> byte limit}, e.g. quotas.alice.host = "2GiB". A tier
    # not listed for a named tenant is unlimited for it.
    quotas: Any = field(default_factory=lambda: MappingProxyType({}))

    @property
    def enabled(self) -> bool:
        """Whether chunk keys carry tenants (any quota is set)."""
        return bool(self.default_quota or self.quotas)

    def limits(self, tier_names: list[str]) -> tuple[dict[str, dict[int, int]], dict[int, int]]:
        """The quotas by tier position: ({tenant: {tier: bytes}}, {tier: bytes})."""
        pos = {n: i for i, n in enumerate(tier_names)}
        # ("nvme" is accepted before the daemon adds that tier: a program without it
        # has no such tier to limit.)
        named = {
            tenant: {pos[t]: parse_size(v) for t, v in tiers.items() if t in pos}
            for tenant, tiers in self.quotas.items()
        }
        default = {pos[t]: parse_size(v) for t, v in self.default_quota.items() if t in pos}
        return named, default


@dataclass(frozen=True, slots=True)
class EncryptionConfig:
    """Encryption at rest of the persistent and shared tiers (nvme, redis)."""

    # Seal every value those tiers store with AES-256-GCM, a key per tenant derived from
    # the master key (needs the cryptography package: pip install 'kvtier[crypto]').
    enabled: bool = False
    # Master key file (32 random bytes in hex, mode 0600). It must exist when set.
    # Empty: <service.data_dir>/master_key, made on first start.
    key_file: str = ""


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The whole configuration. Build with :func:`load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    tiers: tuple[TierSection, ...] = ()
    service: ServiceConfig = field(default_factory=ServiceConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)
    # Python logging level name for kvtier's loggers.
    log_level: str = "INFO"
    # How the CLI and the daemon write log records to stderr: "text" (rich columns on a
    # terminal, one plain line per record otherwise) or "json" (one object per line).
    log_format: str = "text"


# -- loading -------------------------------------------------------------------------------


def default_toml() -> dict[str, Any]:
    """The embedded default configuration, as parsed TOML."""
    text = resources.files("kvtier").joinpath("default.toml").read_text()
    return tomllib.loads(text)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> KVTierConfig:
    """Load, merge and validate the configuration.

    Args:
        path: a TOML file layered over the embedded default; None for the default alone.
        env: environment to read ``KVTIER_*`` variables from (``os.environ`` when None).
        overrides: ``key.path=value`` strings from the command line, applied last.
        base: a raw dict used instead of the embedded default (tests, connectors).

    Raises:
        ConfigError: a file that cannot be read or parsed, an unknown key, or a value
            of the wrong type or range. The message names the key and what is allowed.
    """
    raw = copy.deepcopy(base) if base is not None else default_toml()
    if path is not None:
        raw = merge(raw, read_toml(path))
    environ = os.environ if env is None else env
    if DATA_DIR_ENV in environ:
        set_dotted(raw, "service.data_dir", environ[DATA_DIR_ENV], source=DATA_DIR_ENV)
    for name, key in TOP_LEVEL_ENV.items():
        if name in environ:
            set_dotted(raw, key, environ[name], source=name)
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            set_dotted(raw, dotted, value, source=name)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--set", item, "key.path=value")
        set_dotted(raw, key.strip(), value.strip(), source=f"--set {key.strip()}")
    return parse_config(raw)


def read_toml(path: str | Path, *, key: str = "config_file") -> dict[str, Any]:
    """A kvtier TOML file, parsed (the one reader of TOML files: configs, hardware profiles).

    Args:
        path: the file.
        key: the setting that named the file, for the error (e.g. ``hardware``).

    Raises:
        ConfigError: the file cannot be read, or is not valid TOML (the error's key is ``key``).
    """
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(key, str(path), f"a readable TOML file ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(key, str(path), f"valid TOML ({exc})") from exc


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; lists (such as ``tiers``) are replaced whole."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_dotted(raw: dict[str, Any], dotted: str, value: object, *, source: str) -> None:
    """Set ``a.b.0.c`` in a raw config tree, creating tables as needed."""
    parts = dotted.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = _index(part, node, source)
            node = node[idx]
            continue
        if not isinstance(node, dict):
            where = ".".join(parts[:i])
            raise ConfigError(source, value, f"a path into a table, but {where!r} is not one")
        if part not in node:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_index(last, node, source)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(source, value, f"a path into a table, but {dotted!r} is not one")


def _index(part: str, node: list[Any], source: str) -> int:
    if not part.isdigit():
        raise ConfigError(source, part, "a list index")
    idx = int(part)
    if idx > len(node):  # one past the end adds an entry; further would allocate unbounded
        raise ConfigError(source, part, f"a list index of at most {len(node)} (the next entry)")
    while len(node) <= idx:  # KVTIER_TIERS__1__... may add a tier
        node.append({})
    return idx


def tier_tables(raw: object, where: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``[[tiers]]`` tables of a TOML document, each with its place (``where.i``) for errors.

    Shared by the store's configuration and the hardware profiles (``policies.profiles``).

    Raises:
        ConfigError: not a non-empty list, or an entry that is not a table.
    """
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, raw, "a non-empty list of [[tiers]] tables")
    tables: list[tuple[str, dict[str, Any]]] = []
    for i, t in enumerate(raw):
        at = f"{where}.{i}"
        if not isinstance(t, Mapping):
            raise ConfigError(at, t, "a table")
        tables.append((at, dict(t)))
    return tables


def parse_config(raw: Mapping[str, Any]) -> KVTierConfig:
    """Validate a raw (merged) config tree into a :class:`KVTierConfig`."""
    from kvtier.tiers.registry import tier_options_class

    raw = dict(raw)
    tiers_raw = raw.pop("tiers", [])
    cfg = build_dataclass(KVTierConfig, raw, "")
    tiers: list[TierSection] = []
    for where, t in tier_tables(tiers_raw, "tiers"):
        kind = t.pop("kind", None)
        if not isinstance(kind, str):
            raise ConfigError(f"{where}.kind", kind, "a tier kind such as 'host'")
        options_cls = tier_options_class(kind, where)
        known = ["capacity_bytes", "kind", "name"]
        known += [f.name for f in dataclasses.fields(options_cls)]
        for key in t:
            if key not in known:
                raise ConfigError(f"{where}.{key}", t[key], _known_keys(key, known, f"{kind} tier"))
        name = str(t.pop("name", kind))
        if not _TIER_NAME_RE.fullmatch(name):
            # Names become file names (slab files, index directories): no paths.
            raise ConfigError(f"{where}.name", name, "an identifier of [A-Za-z0-9_-], 1-64 chars")
        if "capacity_bytes" not in t:
            raise ConfigError(f"{where}.capacity_bytes", None, "a size such as '4GiB'")
        capacity = _coerce(t.pop("capacity_bytes"), int, f"{where}.capacity_bytes")
        if capacity <= 0:
            raise ConfigError(f"{where}.capacity_bytes", capacity, "a positive size")
        options = build_dataclass(options_cls, t, where)
        tiers.append(TierSection(kind, name, capacity, options))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigError("tiers.*.name", names, "unique tier names")
    cfg = dataclasses.replace(cfg, tiers=tuple(tiers))
    # "nvme": the tier the daemon adds under service.data_dir when none is configured.
    known = names if "nvme" in names else [*names, "nvme"]
    cfg = dataclasses.replace(cfg, tenants=_validate_tenants(cfg.tenants, known))
    _validate(cfg)
    return cfg


def _quota_table(raw: object, where: str, tiers: list[str]) -> Mapping[str, str]:
    """A {tier name: size} table, checked and frozen (sizes kept as given)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(where, raw, "a table of tier names to sizes")
    out: dict[str, str] = {}
    for tier, size in raw.items():
        if tier not in tiers:
            raise ConfigError(f"{where}.{tier}", size, f"a tier name, one of {tiers}")
        try:
            out[str(tier)] = str(parse_size(size))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.{tier}", size, "a size such as '4GiB'") from None
    return MappingProxyType(out)


def _validate_tenants(t: TenantsConfig, tiers: list[str]) -> TenantsConfig:
    if not isinstance(t.quotas, Mapping):
        raise ConfigError("tenants.quotas", t.quotas, "a table of tenant names to tables")
    quotas: dict[str, Mapping[str, str]] = {}
    for tenant, table in t.quotas.items():
        if not _TENANT_RE.fullmatch(str(tenant)):
            raise ConfigError(
                f"tenants.quotas.{tenant}", table, "a tenant name of [a-z0-9_.-], 1-64 chars"
            )
        quotas[str(tenant)] = _quota_table(table, f"tenants.quotas.{tenant}", tiers)
    return dataclasses.replace(
        t,
        quotas=MappingProxyType(quotas),
        default_quota=_quota_table(t.default_quota, "tenants.default_quota", tiers),
    )


def _validate(cfg: KVTierConfig) -> None:
    s = cfg.store
    if s.chunk_tokens < 1:
        raise ConfigError("store.chunk_tokens", s.chunk_tokens, "an integer >= 1")
    if s.max_extent_bytes < 4096:
        raise ConfigError("store.max_extent_bytes", s.max_extent_bytes, "at least 4KiB")
    if not 1 <= s.io_threads <= 256:
        raise ConfigError("store.io_threads", s.io_threads, "an integer in [1, 256]")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError("log_level", cfg.log_level, "DEBUG, INFO, WARNING, ERROR or CRITICAL")
    if cfg.log_format not in ("text", "json"):
        raise ConfigError("log_format", cfg.log_format, '"text" or "json"')
    if not 0 <= cfg.model.tp_rank < cfg.model.tp_size:
        raise ConfigError("model.tp_rank", cfg.model.tp_rank, f"in [0, {cfg.model.tp_size})")
    _validate_service(cfg.service)
    _validate_placement(cfg.placement)


def _validate_placement(p: PlacementConfig) -> None:
    for name in ("value_of_latency_per_s", "gpu_cost_per_hour", "recompute_s", "write_budget_dwpd"):
        v = getattr(p, name)
        if not v >= 0 or v == float("inf"):
            raise ConfigError(f"placement.{name}", v, "a finite number >= 0")
    if not p.gpu_peak_flops > 0 or p.gpu_peak_flops == float("inf"):
        raise ConfigError("placement.gpu_peak_flops", p.gpu_peak_flops, "a number > 0")
    if not 0 < p.gpu_mfu <= 1:
        raise ConfigError("placement.gpu_mfu", p.gpu_mfu, "in (0, 1]")
    if p.gpus < 0:
        raise ConfigError("placement.gpus", p.gpus, "0 (the preset's) or more")
    if p.context_tokens < 0:
        raise ConfigError("placement.context_tokens", p.context_tokens, "an integer >= 0")
    if not 60 <= p.write_budget_window_s <= 86400:
        raise ConfigError(
            "placement.write_budget_window_s", p.write_budget_window_s, "in [60, 86400] seconds"
        )


_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_TIER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def _validate_service(s: ServiceConfig) -> None:
    if not s.host:
        raise ConfigError("service.host", s.host, "an address such as 127.0.0.1")
    if not 0 <= s.port <= 65535:
        raise ConfigError("service.port", s.port, "a port in [0, 65535] (0: any free port)")
    for tenant, token in s.tokens.items():
        if not _TENANT_RE.fullmatch(tenant):
            raise ConfigError(
                f"service.tokens.{tenant}", "<redacted>", "a tenant name of [a-z0-9_.-], 1-64 chars"
            )
        if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
            raise ConfigError(
                f"service.tokens.{tenant}",
                "<redacted>",
                f"a token of at least {MIN_TOKEN_CHARS} printable ASCII characters",
            )
    if len(set(s.tokens.values())) != len(s.tokens):
        raise ConfigError("service.tokens", "<redacted>", "a different token for each tenant")
    if not s.tokens and not is_loopback(s.host):
        raise ConfigError(
            "service.tokens",
            "{}",
            f"at least one token: the daemon binds {s.host!r}, which is not loopback",
        )
    if s.max_value_bytes < 0:
        raise ConfigError(
            "service.max_value_bytes", s.max_value_bytes, "0 (the chunk size) or more"
        )
    if s.max_body_bytes < 4096:
        raise ConfigError("service.max_body_bytes", s.max_body_bytes, "at least 4KiB")
    if not 1 <= s.max_batch_keys <= 1 << 20:
        raise ConfigError("service.max_batch_keys", s.max_batch_keys, "an integer in [1, 1048576]")
    if s.data_capacity_bytes < 1:
        raise ConfigError("service.data_capacity_bytes", s.data_capacity_bytes, "a positive size")
    if s.shutdown_timeout_s < 0:
        raise ConfigError("service.shutdown_timeout_s", s.shutdown_timeout_s, "a number >= 0")
    if s.max_inflight_bytes < s.max_body_bytes:
        raise ConfigError(
            "service.max_inflight_bytes",
            s.max_inflight_bytes,
            f"at least service.max_body_bytes ({s.max_body_bytes})",
        )
    if not 0 <= s.inflight_wait_s <= 600:  # seconds a request may wait for that bound
        raise ConfigError("service.inflight_wait_s", s.inflight_wait_s, "a number in [0, 600]")
    if s.socket_max_region_bytes < 4096:
        raise ConfigError(
            "service.socket_max_region_bytes", s.socket_max_region_bytes, "at least 4KiB"
        )
    if len(s.socket.encode()) > 100:  # sockaddr_un holds 108 bytes
        raise ConfigError("service.socket", s.socket, "a path of at most 100 bytes")
    if not 1024 <= s.max_header_bytes <= 1 << 24:
        raise ConfigError("service.max_header_bytes", s.max_header_bytes, "a size in [1KiB, 16MiB]")
    if not 0 < s.header_timeout_s <= 3600:
        raise ConfigError("service.header_timeout_s", s.header_timeout_s, "seconds in (0, 3600]")
    if not 0 < s.socket_auth_timeout_s <= 3600:
        raise ConfigError(
            "service.socket_auth_timeout_s", s.socket_auth_timeout_s, "seconds in (0, 3600]"
        )
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        missing = "service.tls_key_file" if s.tls_cert_file else "service.tls_cert_file"
        raise ConfigError(missing, "", "set too: TLS takes a certificate and its key")


def build_dataclass(cls: type[T], raw: Mapping[str, Any], where: str) -> T:
    """Build a frozen dataclass from a raw mapping, coercing strings from env and flags.

    Unknown keys are errors (a typo must not silently fall back to a default). Fields
    whose names end in ``_bytes`` accept sizes such as ``"4GiB"``.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(where or "<root>", raw, "a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{where}.{key}" if where else key
        if key not in fields:
            table = f"[{where}] table" if where else "top level"
            raise ConfigError(dotted, value, _known_keys(key, list(fields), table))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_dataclass(hint, value, dotted)  # type: ignore[arg-type]
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            where or "<root>", dict(raw), f"the fields of {cls.__name__}: {exc}"
        ) from exc


def _known_keys(key: str, known: list[str], where: str) -> str:
    """What an unknown key should have been: the closest known one, then all of them."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"one of the known keys of the {where} {sorted(known)}{hint}"


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        empty = value is None or (isinstance(value, str) and value.lower() in ("", "none", "null"))
        if empty and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                last = exc
        assert last is not None
        raise last
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(str(value).lower())
        except ValueError:
            raise ConfigError(key, value, "one of " + ", ".join(m.value for m in hint)) from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(key, value, "true or false")
    if hint is int:
        try:
            if key.endswith("_bytes"):
                size = parse_size(value)
                if not 0 <= size <= MAX_SIZE_BYTES:
                    raise ConfigError(key, value, "a size from 0 to 4EiB")
                return size
            if isinstance(value, (bool, float)):
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            what = "a size such as 4096 or '4GiB'" if key.endswith("_bytes") else "an integer"
            raise ConfigError(key, value, what) from None
    if hint is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(key, value, "a number") from None
        if not math.isfinite(number):
            raise ConfigError(key, value, "a finite number")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, value, "a string")
    if origin in (dict, Mapping):
        # Only Mapping[str, str] is used (service.tokens); frozen as a read-only proxy.
        if not isinstance(value, Mapping):
            raise ConfigError(key, value, "a table of names to strings")
        out: dict[str, str] = {}
        for k, v in value.items():
            if not isinstance(v, (str, int)) or isinstance(v, bool):
                raise ConfigError(f"{key}.{k}", "<redacted>", "a string")
            out[str(k)] = str(v)
        return MappingProxyType(out)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, "a list")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_coerce(v, item, key) for v in value)
    raise ConfigError(key, value, f"a value of type {hint}")
