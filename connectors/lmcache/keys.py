"""LMCache's chunk keys mapped into kvtier's 16-byte key space. Imports nothing from LMCache.

LMCache names a chunk in two ways:

* ``CacheEngineKey`` (the engine and its storage backends): model name, world size,
  worker id (the TP rank), the chunk's prefix hash, the KV dtype, and the request's
  ``lmcache.tag.*`` configs (tags). A layerwise key adds a layer id.
* ``ObjectKey`` (``lmcache server`` and its L2 adapters): the chunk hash as bytes, model
  name, KV rank, object group id and the per-user ``cache_salt``.

Each field goes into a BLAKE2b-128 digest, length-prefixed, after a domain tag. Length
prefixes (not LMCache's ``@``-joined ``to_string()``) make the encoding injective: a
model named ``a@1`` can never produce the bytes of model ``a`` with world size ``1``.
So two models, two TP ranks, two dtypes, two tag sets or two cache salts always give
two kvtier keys, and the two LMCache key kinds can never name each other's chunks.

Stable across restarts only if LMCache's chunk hash is: see ``docs/lmcache.md``
(``pre_caching_hash_algorithm: sha256_cbor`` and a fixed ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Protocol

from kvtier.keys import ChunkKey

ENGINE_DOMAIN = b"kvtier/lmcache/engine-key/v1"
OBJECT_DOMAIN = b"kvtier/lmcache/object-key/v1"


class EngineKeyLike(Protocol):
    """The fields of LMCache's ``CacheEngineKey`` that name a chunk."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: Any
    tags: tuple[tuple[str, Any], ...] | None


class ObjectKeyLike(Protocol):
    """The fields of LMCache's ``ObjectKey``."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str


def _digest(domain: bytes, parts: Iterable[bytes]) -> ChunkKey:
    h = hashlib.blake2b(digest_size=16)
    h.update(len(domain).to_bytes(4, "little"))
    h.update(domain)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return ChunkKey(h.digest())


def _text(value: object) -> bytes:
    return str(value).encode("utf-8", "surrogatepass")


def engine_key(key: EngineKeyLike) -> ChunkKey:
    """kvtier's key for an LMCache ``CacheEngineKey`` (or ``LayerCacheEngineKey``).

    Tags enter in sorted order: LMCache compares them in insertion order, but the same
    set of request configs must name the same chunk whatever order a caller built it in.
    """
    dtype = getattr(key, "_dtype_str", "") or str(key.dtype)
    layer = getattr(key, "layer_id", None)
    parts = [
        _text(key.model_name),
        _text(int(key.world_size)),
        _text(int(key.worker_id)),
        _text(int(key.chunk_hash)),
        _text(dtype),
        b"" if layer is None else _text(int(layer)),
    ]
    for name, value in sorted((str(k), str(v)) for k, v in key.tags or ()):
        parts.append(_text(name))
        parts.append(_text(value))
    return _digest(ENGINE_DOMAIN, parts)


def object_key(key: ObjectKeyLike) -> ChunkKey:
    """kvtier's key for an LMCache ``ObjectKey`` (multiprocess mode, L2 adapters)."""
    return _digest(
        OBJECT_DOMAIN,
        (
            bytes(key.chunk_hash),
            _text(key.model_name),
            _text(int(key.kv_rank)),
            _text(int(key.object_group_id)),
            _text(key.cache_salt),
        ),
    )
