"""The connector's configuration and key scheme. Imports nothing from vLLM.

Configuration: ``kv_connector_extra_config`` holds ``config_file`` (a kvtier TOML)
and/or inline kvtier settings, either dotted (``"store.chunk_tokens": 64``) or nested
tables (``"store": {"chunk_tokens": 64}``, ``"tiers": [{"kind": "host", ...}]``).
Layering: embedded default, then the file, then the nested tables, then ``KVTIER_*``
environment variables, then the dotted keys. Both sides of vLLM load the same
configuration from the same JSON, so they agree on chunk size and capacity.

Keys, in two levels:

* The **logical key** of a chunk is :class:`kvtier.keys.ChunkHasher` over the request's
  token ids, seeded by (model, rank-0 KV spec, chunk size) with the LoRA name and the
  cache salt in the extra bytes. The scheduler side computes it; it is the same on every
  rank, in every process, after every restart.
* The **rank key** is what a worker stores under: a hash of the logical key with that
  worker's KV-spec fingerprint (which holds the TP rank and size), its pipeline stage and
  the byte layout of its pages. Each rank holds only its own heads and layers, so ranks
  never share entries, and two layouts (or dtypes) never read each other's bytes.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

from kvtier.config import KVTierConfig, default_toml, load_config, merge
from kvtier.errors import ConfigError
from kvtier.keys import ChunkHasher, ChunkKey, Namespace
from kvtier.spec import KVSpec

from .remote import DAEMON_KEYS

CONFIG_FILE_KEY = "config_file"

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
        try:
            raw = merge(raw, tomllib.loads(Path(path).read_text()))
        except OSError as exc:
            raise ConfigError(CONFIG_FILE_KEY, str(path), f"a readable TOML file ({exc})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(CONFIG_FILE_KEY, str(path), f"valid TOML ({exc})") from exc
    nested: dict[str, Any] = {}
    dotted: list[str] = []
    for key, value in extra.items():
        if key == CONFIG_FILE_KEY or key in DAEMON_KEYS:  # daemon mode: see remote.py
            continue
        if "." in key:
            dotted.append(f"{key}={value}")
        else:
            nested[key] = value
    raw = merge(raw, nested)
    return load_config(None, env=env, overrides=dotted, base=raw)


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
    """

    model: str
    spec: KVSpec
    chunk_tokens: int

    def hasher(self) -> ChunkHasher:
        logical = replace(self.spec, tp_rank=0)
        return ChunkHasher(Namespace(self.model, logical.fingerprint, self.chunk_tokens))

    def logical_keys(
        self, token_ids: Sequence[int], extra: bytes = b"", parent: ChunkKey | None = None
    ) -> list[ChunkKey]:
        """Keys of every full chunk of ``token_ids`` (see :meth:`ChunkHasher.keys`)."""
        return self.hasher().keys(token_ids, extra, parent)


def rank_salt(spec: KVSpec, pp_rank: int, layout: str) -> bytes:
    """The per-worker prefix of rank keys: TP rank (in the fingerprint), PP stage, layout."""
    return f"kvtier/vllm/rank/v1\0{spec.fingerprint}\0pp{pp_rank}\0{layout}\0".encode()


def rank_keys(salt: bytes, logical: Sequence[bytes]) -> list[ChunkKey]:
    """Rank keys of logical keys (deterministic, 16 bytes each)."""
    return [ChunkKey(xxhash.xxh3_128_digest(salt + k)) for k in logical]


def check_chunk_tokens(chunk_tokens: int, block_size: int) -> int:
    """Blocks per chunk, or a ConfigError when the chunk does not tile vLLM's blocks."""
    if chunk_tokens < block_size or chunk_tokens % block_size:
        raise ConfigError(
            "store.chunk_tokens", chunk_tokens, f"a multiple of vLLM's block_size ({block_size})"
        )
    return chunk_tokens // block_size


def mirror_capacity(cfg: KVTierConfig, chunk_bytes: int) -> int:
    """Chunks the scheduler-side mirror may list: the store's capacity, with slack."""
    total = sum(t.capacity_bytes for t in cfg.tiers)
    return max(1, MIRROR_SLACK * total // max(1, chunk_bytes))
