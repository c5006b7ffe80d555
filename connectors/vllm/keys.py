"""The connector's key scheme. Imports nothing from vLLM or from the connector's other modules.

Keys, in two levels:

* The **logical key** of a chunk is :class:`kvtier.keys.ChunkHasher` over the request's
  token ids, seeded by (model, weights identity, rank-0 KV spec, chunk size) with the
  LoRA name and the cache salt in the extra bytes. The scheduler side computes it; it is
  the same on every rank, in every process, after every restart of the same weights.
* The **rank key** is what a worker stores under: a hash of the logical key with that
  worker's KV-spec fingerprint (which holds the TP rank and size), its pipeline stage and
  the byte layout of its pages. Each rank holds only its own heads and layers, so ranks
  never share entries, and two layouts (or dtypes) never read each other's bytes.

With tenants (an embedded store whose configuration has ``[tenants]``), a request's
``cache_salt`` names its tenant: the first bytes of each logical key are then the
tenant's tag (:mod:`kvtier.store.quota`), and the rank and group keys derived from it
keep them, so the worker's store charges each chunk to its tenant's quotas and figures.
A request without a salt is the anonymous tenant ``""``. Without tenants every key is
as it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from kvtier.keys import TAG_BYTES, ChunkHasher, ChunkKey, Namespace, tag_key
from kvtier.spec import KVSpec
from kvtier.store.quota import tenant_tag

_TENANTS = b"tenants\0"
"""The end of a rank salt whose rank keys keep their logical key's tenant tag."""


def request_extra(lora_name: str | None, cache_salt: str | None) -> bytes:
    """Bytes that separate otherwise equal prompts: LoRA adapter and cache salt.

    Empty when neither is set, so plain prompts share keys across deployments.
    """
    if not lora_name and not cache_salt:
        return b""
    return b"vllm\0lora=" + (lora_name or "").encode() + b"\0salt=" + (cache_salt or "").encode()


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """Logical keys for the scheduler side, rank keys for one worker.

    Attributes:
        model: model id the KV was computed with (vLLM's ``model_config.model``).
        spec: the KV spec of rank 0 (``tp_rank=0``): the logical namespace.
        chunk_tokens: tokens per chunk, a multiple of vLLM's block size.
        weights: the weights' identity (weights.py); empty: the model's name alone.
        tenants: logical keys carry the tag of the tenant their request's cache salt
            names (see the module docstring).
    """

    model: str
    spec: KVSpec
    chunk_tokens: int
    weights: str = ""
    tenants: bool = False

    def hasher(self) -> ChunkHasher:
        logical = replace(self.spec, tp_rank=0)
        return ChunkHasher(
            Namespace(self.model, logical.fingerprint, self.chunk_tokens, weights=self.weights)
        )

    def logical_keys(
        self,
        token_ids: Sequence[int],
        extra: bytes = b"",
        parent: ChunkKey | None = None,
        tag: bytes = b"",
    ) -> list[ChunkKey]:
        """Keys of every full chunk of ``token_ids`` (see :meth:`ChunkHasher.keys`)."""
        return self.hasher().keys(token_ids, extra, parent, tag)

    def tag(self, cache_salt: str | None) -> bytes:
        """The tenant tag the logical keys of a request with ``cache_salt`` carry (the
        ``tag`` of :meth:`ChunkHasher.keys`); empty without tenants."""
        return tenant_tag(cache_salt or "") if self.tenants else b""


def rank_salt(spec: KVSpec, pp_rank: int, layout: str, *, tenants: bool = False) -> bytes:
    """The per-worker prefix of rank keys: TP rank (in the fingerprint), PP stage, layout;
    with ``tenants``, a mark that its rank keys keep their tenant tag (the scheduler side
    reads the salt from the worker's updates, so it derives the same keys)."""
    salt = f"kvtier/vllm/rank/v1\0{spec.fingerprint}\0pp{pp_rank}\0{layout}\0".encode()
    return salt + _TENANTS if tenants else salt


def rank_keys(salt: bytes, logical: Sequence[bytes]) -> list[ChunkKey]:
    """Rank keys of logical keys (deterministic, 16 bytes each)."""
    if salt.endswith(_TENANTS):
        return [tag_key(xxhash.xxh3_128_digest(salt + k), k[:TAG_BYTES]) for k in logical]
    return [ChunkKey(xxhash.xxh3_128_digest(salt + k)) for k in logical]
