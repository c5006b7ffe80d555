"""The one exception tree of kvtier.

Every error kvtier raises on purpose derives from :class:`KVTierError`. Third-party
errors (OSError, redis, httpx, torch) are translated once, at the boundary where they
happen, with ``raise ... from exc``::

    KVTierError
    ├── ConfigError          bad configuration: fails loudly at start-up
    ├── PluginError          a tier/policy plugin that cannot be loaded
    ├── SpecError            a model geometry kvtier cannot describe (e.g. MLA where refused)
    ├── InputError           bad arguments from a caller (wrong buffer size, bad key)
    ├── StoreError           the store cannot do what was asked
    │   ├── CapacityError    the value can never fit (larger than every tier)
    │   ├── ClosedError      the store was closed
    │   └── NotDurableError  done in this process, but the disk did not take it (a full disk)
    ├── TierError            one tier failed; the store turns this into a miss
    │   ├── TierIOError      an I/O call failed (ENOSPC, EIO, a vanished file)
    │   ├── CorruptChunkError  bytes or metadata failed verification
    │   └── TierUnavailableError  the tier cannot run here (no CUDA, no NUMA node)
    └── TransportError       the daemon or a remote tier could not be reached
        └── AuthError        the daemon refused the bearer token (a config problem)

Lower-tier failures never escape the store as exceptions: they become misses, a
counter and one log line (STYLE.md, rule 5).
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KVTierError):
    """A configuration value is missing, malformed or out of range.

    The message names the key, the value and what is allowed.
    """

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"config {key}={value!r} is invalid: expected {allowed}")


class PluginError(KVTierError):
    """A plugin (tier kind, policy) named in the config cannot be loaded."""


class SpecError(KVTierError):
    """A model geometry that kvtier cannot describe or refuses to handle."""


class InputError(KVTierError):
    """A caller passed arguments that can never work (sizes, key formats)."""


class StoreError(KVTierError):
    """The store cannot do what was asked."""


class CapacityError(StoreError):
    """The value cannot fit in any tier, whatever is evicted."""


class ClosedError(StoreError):
    """The store (or tier) has been closed."""


class NotDurableError(StoreError):
    """The operation took effect in this process, but a persistent tier could not make it
    durable (ENOSPC, EIO): after a restart it may be undone. Retry once the disk recovers."""


class TierError(KVTierError):
    """One tier failed. The store degrades it to a miss and counts it."""


class TierIOError(TierError):
    """An I/O call of a tier failed (ENOSPC, EIO, a deleted or truncated file)."""


class CorruptChunkError(TierError):
    """Bytes or metadata of a chunk failed verification; the chunk is a miss."""


class TierUnavailableError(TierError):
    """The tier cannot run on this machine (no CUDA device, no such NUMA node)."""


class TransportError(KVTierError):
    """A daemon or remote tier could not be reached or answered badly."""


class AuthError(TransportError):
    """The daemon refused the credentials (401/403): fix the token, retrying will not help."""
