"""The connector's parts that need no engine: config, keys, lookup."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvtier.connectors.vllm.keys import KeyScheme, rank_keys, rank_salt, request_extra
from kvtier.connectors.vllm.settings import ChunkShape, config_from_extra
from kvtier.errors import ConfigError, SpecError
from kvtier.spec import KVSpec


def test_extra_config_layers_file_nested_and_dotted(tmp_path) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text("[store]\nchunk_tokens = 512\nio_threads = 3\n")
    cfg = config_from_extra(
        {
            "config_file": str(f),
            "store": {"io_threads": 2},
            "store.chunk_tokens": 128,
            "tiers": [{"kind": "host", "capacity_bytes": "16MiB"}],
        },
        env={},
    )
    assert cfg.store.chunk_tokens == 128  # dotted beats file
    assert cfg.store.io_threads == 2  # nested beats file
    assert cfg.tiers[0].capacity_bytes == 16 << 20
    assert config_from_extra({}, env={}).store.chunk_tokens == 256  # the embedded default


def test_bad_extra_config_fails_loudly(tmp_path) -> None:
    with pytest.raises(ConfigError):
        config_from_extra({"store.chunk_tokenz": 64}, env={})
    with pytest.raises(ConfigError):
        config_from_extra({"config_file": str(tmp_path / "missing.toml")}, env={})
    with pytest.raises(ConfigError):
        ChunkShape.of(48, 32)
    with pytest.raises(ConfigError):
        ChunkShape.of(16, 32)
    assert ChunkShape.of(256, 32).blocks_per_chunk == 8


def test_keys_separate_salts_loras_ranks_and_layouts() -> None:
    spec = KVSpec(2, 2, 64, tp_size=2)
    scheme = KeyScheme("m", spec, 64)
    toks = list(range(200))
    plain = scheme.logical_keys(toks)
    assert len(plain) == 3
    assert plain == KeyScheme("m", replace(spec, tp_rank=1), 64).logical_keys(toks)
    salted = scheme.logical_keys(toks, request_extra(None, "a"))
    lora = scheme.logical_keys(toks, request_extra("a", None))
    assert len({plain[0], salted[0], lora[0]}) == 3
    assert request_extra(None, None) == b""
    r0 = rank_keys(rank_salt(spec, 0, "page-123"), plain)
    r1 = rank_keys(rank_salt(replace(spec, tp_rank=1), 0, "page-123"), plain)
    other_layout = rank_keys(rank_salt(spec, 0, "page-213"), plain)
    assert not set(r0) & set(r1)
    assert not set(r0) & set(other_layout)
    assert r0 == rank_keys(rank_salt(spec, 0, "page-123"), plain)  # deterministic


def test_lookup_counts_leading_chunks_and_waits_for_saves_in_flight() -> None:
    pytest.importorskip("vllm")
    from kvtier.connectors.vllm.scheduler import KeyMirror, matched_chunks

    mirror = KeyMirror(capacity=10)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys[:3]:
        mirror.add(k)
    assert matched_chunks(keys, 5, mirror, {}) == 3
    assert matched_chunks(keys, 2, mirror, {}) == 2
    assert matched_chunks(keys, 5, mirror, {keys[3]: [0, 0]}) is None
    mirror.discard(keys[0])
    assert matched_chunks(keys, 5, mirror, {}) == 0
    # Chunks vLLM's own prefix cache holds need not be stored: a load starts after them.
    assert matched_chunks(keys, 5, mirror, {}, local_chunks=1) == 3
    # A save in flight of a chunk vLLM holds is no reason to wait.
    assert matched_chunks(keys, 5, mirror, {keys[0]: [0, 0]}, local_chunks=1) == 3
    assert matched_chunks(keys, 1, mirror, {}, local_chunks=4) == 1  # capped


def test_a_hit_stops_one_block_short_of_the_last_token() -> None:
    pytest.importorskip("vllm")
    from kvtier.connectors.vllm.scheduler import hit_cap, loadable_chunks

    # Chunks of 64 tokens, blocks of 16: vLLM computes at least the last token.
    assert loadable_chunks(300, 64, 16) == 4  # the 5th chunk is not full: no key
    assert loadable_chunks(257, 64, 16) == 4
    assert loadable_chunks(255, 64, 16) == 3
    # Ending at a chunk boundary: the last chunk loads its first 3 blocks of 4.
    assert loadable_chunks(256, 64, 16) == 4
    assert hit_cap(256, 16) == 256 - 16
    assert loadable_chunks(64, 64, 16) == 1 and hit_cap(64, 16) == 48
    # A chunk of one block has nothing before the last token's block.
    assert loadable_chunks(256, 64, 64) == 3 and hit_cap(256, 64) == 192
    assert loadable_chunks(1, 64, 16) == 0 and hit_cap(1, 16) == 0


def test_mirror_is_bounded_lru() -> None:
    pytest.importorskip("vllm")
    from kvtier.connectors.vllm.scheduler import KeyMirror

    mirror = KeyMirror(capacity=2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    mirror.add(a)
    mirror.add(b)
    mirror.touch([a])
    mirror.add(c)
    assert a in mirror and c in mirror and b not in mirror


def test_mla_spec_is_one_latent_shared_by_every_tp_rank() -> None:
    pytest.importorskip("vllm")
    from kvtier.connectors.vllm.connector import spec_from_vllm, storing_ranks

    def cfg(tp: int) -> SimpleNamespace:
        text = SimpleNamespace(num_hidden_layers=3, kv_lora_rank=512, qk_rope_head_dim=64)
        mc = SimpleNamespace(use_mla=True, model="deepseek", dtype="bfloat16", hf_text_config=text)
        return SimpleNamespace(
            model_config=mc,
            cache_config=SimpleNamespace(cache_dtype="auto"),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )

    one = spec_from_vllm(cfg(1))  # type: ignore[arg-type]
    rank1 = spec_from_vllm(cfg(2), tp_rank=1)  # type: ignore[arg-type]
    assert (one.mla, one.num_kv_heads, one.head_size) == (True, 1, 576)
    assert one.bytes_per_token == 3 * 576 * 2  # one plane, no K and V
    assert rank1.fingerprint == one.fingerprint  # every rank, every TP degree: one copy
    assert storing_ranks(rank1, world_size=4) == 2  # TP 2 x PP 2: TP rank 0 of each stage
    plain = spec_from_vllm(cfg(2), tp_rank=1)  # type: ignore[arg-type]
    assert storing_ranks(replace(plain, mla=False), world_size=4) == 4


def test_kv_groups_of_hybrid_models_and_state_space_refusal() -> None:
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvtier.connectors.vllm.connector import kv_groups
    from kvtier.spec import KVGroup, LayerKind

    def config(*specs: object) -> SimpleNamespace:
        groups = [
            SimpleNamespace(layer_names=[f"l{i}a", f"l{i}b"], kv_cache_spec=s)
            for i, s in enumerate(specs)
        ]
        return SimpleNamespace(kv_cache_groups=groups)

    attn = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    full = FullAttentionSpec(**attn)
    sliding = SlidingWindowSpec(**attn, sliding_window=48)
    assert kv_groups(config(full), 32) == ((), ())  # one group: a plain model, as before
    groups, names = kv_groups(config(sliding, full), 32)
    assert groups == (KVGroup(LayerKind.SLIDING, 2, 47), KVGroup(LayerKind.FULL, 2))
    assert names == (("l0a", "l0b"), ("l1a", "l1b"))
    with pytest.raises(SpecError, match="blocks of 16"):
        kv_groups(config(sliding, full), 16)
    mamba = MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.bfloat16,))
    with pytest.raises(SpecError, match="state-space or linear-attention"):
        kv_groups(config(full, mamba), 32)
