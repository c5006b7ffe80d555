"""Tenants: bearer tokens name a tenant, and each tenant sees its own key space.

Isolation does not rest on checks that could be forgotten on one route. Every key a
client sends is mapped to an internal store key with a keyed hash::

    internal = BLAKE2b-128(key, key=BLAKE2b-256(tenant, key=salt))

so two tenants that send the same key address two different chunks, and no tenant can
name, guess or probe another's internal keys without the daemon's secret salt (BLAKE2b
keyed is a PRF, unlike xxh3). An absent key takes exactly the same code path for every
tenant: hash, then one index lookup of a key nobody else can reach.

Tokens are compared by their SHA-256 digest in a dict, so lookup time does not depend
on how many leading characters of a guess are right.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.files import make_private_dirs
from kvtier.keys import ChunkKey, tag_key
from kvtier.store.quota import tenant_tag

log = logging.getLogger(__name__)

ANONYMOUS = ""
"""The tenant of every request when no tokens are configured (loopback only)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller. ``name`` is ``""`` for the anonymous tenant."""

    name: str

    @property
    def label(self) -> str:
        """The tenant's name in metrics and stats."""
        return self.name or "anonymous"


def load_or_create_salt(path: Path) -> str:
    """The key salt kept in ``path``; a new random one (file mode 0600) if absent.

    Raises:
        ConfigError: the file cannot be read or created (a directory, a read-only
            filesystem), or it is empty: an empty salt would silently be a new random
            one at every start, making every recovered chunk unreachable.
    """
    key = "service.data_dir"
    try:
        salt = path.read_text().strip()
    except FileNotFoundError:
        salt = None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, str(path.parent), f"a readable key_salt file ({exc})") from exc
    if salt is not None:
        if not salt:
            raise ConfigError(
                key,
                str(path.parent),
                f"a non-empty {path.name}: remove the empty file to generate a new salt"
                " (chunks stored under the old one become unreachable)",
            )
        return salt
    salt = secrets.token_hex(32)
    try:
        make_private_dirs(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(salt + "\n")
    except OSError as exc:
        raise ConfigError(
            key, str(path.parent), f"a writable directory for {path.name} ({exc})"
        ) from exc
    log.info("generated a new key salt in %s", path)
    return salt


class KeyMapper:
    """Maps (tenant, client key) to the store's internal key. Thread-safe (immutable).

    Args:
        salt: the daemon's secret; empty draws a random one (chunks recovered by a
            persistent tier after a restart are then unreachable).
        tagged: each key's first bytes name its tenant (:mod:`kvtier.store.quota`), so
            the store can keep per-tenant quotas.
    """

    def __init__(self, salt: str = "", *, tagged: bool = False) -> None:
        if salt:
            self._salt = hashlib.blake2b(salt.encode(), digest_size=32).digest()
        else:
            self._salt = secrets.token_bytes(32)
        self.random_salt = not salt
        self.tagged = tagged
        self._per_tenant: dict[str, hashlib.blake2b] = {}  # prepared keyed hashers, per tenant

    def _hasher(self, tenant: Tenant) -> hashlib.blake2b:
        h = self._per_tenant.get(tenant.name)
        if h is None:
            tkey = hashlib.blake2b(tenant.name.encode(), key=self._salt, digest_size=32).digest()
            h = hashlib.blake2b(key=tkey, digest_size=16)
            self._per_tenant[tenant.name] = h
        return h

    def map(self, tenant: Tenant, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """The internal keys of ``keys`` for ``tenant``, in order."""
        base = self._hasher(tenant)
        out: list[ChunkKey] = []
        for key in keys:
            h = base.copy()
            h.update(key)
            out.append(ChunkKey(h.digest()))
        if self.tagged:
            tag = tenant_tag(tenant.name)
            out = [tag_key(k, tag) for k in out]
        return out


class Authenticator:
    """Turns an ``Authorization`` header into a :class:`Tenant`, or None when refused.

    Args:
        tokens: tenant name -> bearer token. Empty: every caller is the anonymous
            tenant (the config refuses that unless the daemon binds loopback).
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self.required = bool(tokens)
        self._by_digest = {
            hashlib.sha256(token.encode()).digest(): Tenant(name) for name, token in tokens.items()
        }
        self.tenants = tuple(Tenant(name) for name in sorted(tokens)) or (Tenant(ANONYMOUS),)
        self._anonymous = Tenant(ANONYMOUS)
        # The header value as clients send it, mapped straight to its tenant: one lookup
        # per request instead of a decode, a split and a SHA-256. Only values that
        # authenticate() accepts as they are; any other form takes authenticate(). Bytes
        # hashing is keyed per process (SipHash), so a guess's lookup time says nothing of
        # a token.
        self._by_header = {
            b"Bearer " + token.encode("ascii"): Tenant(name)
            for name, token in tokens.items()
            if token.isascii() and token.strip() == token != ""
        }

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant a header value names; None for a missing, malformed or unknown token."""
        if not self.required:
            return self._anonymous
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_digest.get(hashlib.sha256(token.strip().encode()).digest())

    def authenticate_header(self, value: bytes | None) -> Tenant | None:
        """:meth:`authenticate` of a raw header value (as servers hand it over, latin-1)."""
        if not self.required:
            return self._anonymous
        if value is None:
            return None
        tenant = self._by_header.get(value)
        if tenant is not None:
            return tenant
        return self.authenticate(value.decode("latin-1"))
