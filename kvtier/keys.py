"""Chunk keys: chained xxh3-128 hashes over token ids, seeded by a namespace.

A chunk is a fixed run of ``chunk_tokens`` tokens, the unit of prefix matching. Its key
hashes (parent key, token ids as little-endian int32, extra bytes), so equal keys mean
equal prefixes. The seed is the namespace (model id, the weights' identity, KV-spec
fingerprint, chunk size, tenant), so two models, two checkpoints under one name or two
tenants never share a key. Nothing here depends on
``PYTHONHASHSEED``: keys are identical across processes, restarts and hosts.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.errors import InputError

try:
    from kvtier._speedups import keys16 as _keys16_c
    from kvtier._speedups import pack_i32 as _pack_i32_c
except ImportError:  # built without a C compiler: the array module packs, more slowly
    _pack_i32_c = None
    _keys16_c = None


def token_bytes(token_ids: Sequence[int] | npt.NDArray[Any]) -> bytes | memoryview:
    """Token ids as little-endian int32 bytes: the canonical input of chunk keys."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise InputError(f"token_ids must be one-dimensional, got shape {token_ids.shape}")
        return memoryview(np.ascontiguousarray(token_ids, dtype="<i4").data).cast("B")
    try:
        if _pack_i32_c is not None and isinstance(token_ids, (list, tuple)):
            return bytes(_pack_i32_c(token_ids))
        arr = array.array("i", token_ids)
    except (TypeError, OverflowError) as exc:
        raise InputError(f"token ids must be int32 integers: {exc}") from exc
    if sys.byteorder != "little":
        arr.byteswap()
    return memoryview(arr).cast("B")


ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes: the xxh3-128 digest of one chunk and all chunks before it."""

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes two equal token runs *not* share KV.

    Attributes:
        model: model id (name or path) the KV was computed with.
        spec_fingerprint: :attr:`KVSpec.fingerprint` of geometry and TP rank.
        chunk_tokens: tokens per chunk; a different chunking is a different key space.
        tenant: tenant or isolation salt; empty for a single-tenant deployment.
        weights: identity of the weights the KV was computed with (the vLLM connector's
            ``connectors/vllm/weights.py``: a fingerprint of the checkpoint's files, or
            an operator's ``model_version``); empty where the caller names the weights
            by ``model`` alone. KV of other weights is other KV, even under one name.
    """

    model: str
    spec_fingerprint: str
    chunk_tokens: int
    tenant: str = ""
    weights: str = ""

    def seed(self) -> ChunkKey:
        fields: tuple[str, ...] = (
            self.model,
            self.spec_fingerprint,
            str(self.chunk_tokens),
            self.tenant,
        )
        if self.weights:
            # Appended only when set: namespaces without it keep their keys (and what
            # persistent tiers hold under them).
            fields = (*fields, "weights=" + self.weights)
        canon = "\0".join(("kvtier/ns/v1", *fields))
        return ChunkKey(xxhash.xxh3_128_digest(canon.encode()))


class ChunkHasher:
    """Computes the chained keys of a token sequence's full chunks.

    Thread-safe (immutable after construction). One hash per chunk over the packed
    tokens: packing the token list, not hashing, is most of the cost (docs/benchmarks.md,
    "Chunk keys vs vLLM block hashing").
    """

    def __init__(self, namespace: Namespace) -> None:
        if namespace.chunk_tokens < 1:
            raise InputError(f"chunk_tokens must be >= 1, got {namespace.chunk_tokens}")
        self.namespace = namespace
        self.chunk_tokens = namespace.chunk_tokens
        self._seed = namespace.seed()

    def keys(
        self,
        token_ids: Sequence[int] | npt.NDArray[Any],
        extra: bytes = b"",
        parent: ChunkKey | None = None,
        tag: bytes = b"",
    ) -> list[ChunkKey]:
        """Keys of every *full* chunk of ``token_ids`` (a trailing partial chunk has no key).

        Args:
            token_ids: the prompt's token ids, from its first token (or from the token
                after ``parent``'s chunk).
            extra: bytes that must separate otherwise equal prefixes (LoRA name, cache
                salt, multimodal hashes). Mixed into the first chunk; chaining carries it
                into every later key.
            parent: key of the chunk before ``token_ids[0]``, to extend a known prefix.
            tag: bytes that replace the start of every key (a tenant's tag,
                :mod:`kvtier.store.quota`), before it seeds the next: a prefix extended
                from a tagged ``parent`` gets the keys a whole-prompt call gives.
        """
        buf = memoryview(token_bytes(token_ids))
        step = self.chunk_tokens * 4
        n = buf.nbytes // step
        prev = parent if parent is not None else self._seed
        out: list[ChunkKey] = []
        h = xxhash.xxh3_128()
        for i in range(n):
            h.reset()
            h.update(prev)
            if i == 0 and extra:
                h.update(extra)
            h.update(buf[i * step : (i + 1) * step])
            prev = tag_key(h.digest(), tag) if tag else ChunkKey(h.digest())
            out.append(prev)
        return out


TAG_BYTES = 4
"""Leading bytes of a key that carry its tenant's tag (with ``[tenants]``)."""


def tag_key(key: bytes, tag: bytes) -> ChunkKey:
    """``key`` with its first bytes replaced by a tenant's ``tag``."""
    return ChunkKey(tag + key[len(tag) :])


def check_keys(keys: Iterable[object]) -> list[ChunkKey]:
    """``keys`` as a list, after checking that each is a key of :data:`KEY_BYTES` bytes.

    The store's public methods call this first: a key of another length would be
    truncated or padded by a persistent tier's journal, and after a reopen its value
    would be served under a key never put (tests/store/test_store.py).

    Raises:
        InputError: ``keys`` is not an iterable of keys, or one key is not 16 bytes.
    """
    if _keys16_c is not None:
        fast = _keys16_c(keys)
        if fast is not None:  # a list or tuple of well-formed keys, the usual case
            return fast  # type: ignore[no-any-return]
    try:
        if keys is None or isinstance(keys, (str, bytes, bytearray, memoryview)):
            raise TypeError  # iterable, but not of keys
        out = list(keys)  # type: ignore[call-overload]  # any iterable; checked below
    except TypeError:
        raise InputError(
            f"keys must be a sequence of chunk keys, got {type(keys).__name__}"
        ) from None
    for i, k in enumerate(out):
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            got = f"{len(k)} bytes" if isinstance(k, bytes) else f"a {type(k).__name__}"
            raise InputError(f"chunk key {i} is {got}; a key is {KEY_BYTES} bytes")
    return out  # type: ignore[return-value]  # checked above: bytes of the key's length


def parse_key(text: str) -> ChunkKey:
    """Parse a key from its 32-hex-digit form (the daemon's and the CLI's format)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise InputError(f"key {text!r} is not hexadecimal") from None
    if len(raw) != KEY_BYTES:
        raise InputError(f"key {text!r} has {len(raw)} bytes, expected {KEY_BYTES}")
    return ChunkKey(raw)
