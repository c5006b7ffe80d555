"""KV spec geometry and chunk keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import InputError, SpecError
from kvtier.keys import ChunkHasher, Namespace, parse_key
from kvtier.spec import DType, KVSpec, preset


def test_llama3_8b_bytes_per_token() -> None:
    # 32 layers x (K, V) x 8 heads x 128 x 2 bytes
    assert preset("llama-3-8b").bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_tp_shards_heads_and_replicates_when_fewer_heads() -> None:
    full = KVSpec(80, 8, 128)
    assert KVSpec(80, 8, 128, tp_size=8, tp_rank=3).bytes_per_token == full.bytes_per_token // 8
    assert KVSpec(80, 8, 128, tp_size=16, tp_rank=0).kv_heads_per_rank == 1
    assert (
        KVSpec(80, 8, 128, tp_size=8, tp_rank=1).fingerprint
        != KVSpec(80, 8, 128, tp_size=8).fingerprint
    )


def test_mla_has_one_latent_plane() -> None:
    ds = preset("deepseek-v3")
    assert ds.mla and ds.bytes_per_token == 61 * 576 * 2


def test_from_hf_config(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = KVSpec.from_hf_config(tmp_path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype) == (
        2,
        2,
        64,
        DType.FP16,
    )
    with pytest.raises(SpecError, match="num_hidden_layers"):
        KVSpec.from_hf_config({"hidden_size": 4})
    with pytest.raises(SpecError, match="cannot read"):
        KVSpec.from_hf_config(tmp_path / "missing.json")


def test_bad_spec_values() -> None:
    with pytest.raises(SpecError):
        KVSpec(0, 8, 128)
    with pytest.raises(SpecError):
        KVSpec(2, 8, 128, tp_rank=2, tp_size=2)
    with pytest.raises(SpecError, match="dtype"):
        DType.parse("int3")


def hasher(tenant: str = "", chunk: int = 256) -> ChunkHasher:
    return ChunkHasher(Namespace("m", preset("llama-3-8b").fingerprint, chunk, tenant))


def test_keys_cover_only_full_chunks_and_chain() -> None:
    h = hasher()
    toks = list(range(1000))
    keys = h.keys(toks)
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    assert h.keys(toks[:512]) == keys[:2]  # a prefix has the same keys
    other = toks.copy()
    other[10] = 99999
    assert all(a != b for a, b in zip(h.keys(other), keys, strict=True))  # chaining
    assert h.keys(toks[256:], parent=keys[0]) == keys[1:]
    assert h.keys(np.array(toks, dtype=np.int64)) == keys


def test_namespace_and_extra_separate_keys() -> None:
    toks = list(range(512))
    base = hasher().keys(toks)
    assert hasher(tenant="t2").keys(toks) != base
    assert hasher().keys(toks, extra=b"lora:a") != base
    assert hasher(chunk=128).keys(toks)[1] != base[0]


def test_keys_are_identical_across_processes() -> None:
    code = (
        "from kvtier.keys import *; from kvtier.spec import preset;"
        "h=ChunkHasher(Namespace('m', preset('llama-3-8b').fingerprint, 256));"
        "print(h.keys(list(range(1000)))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin"},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert outs == {hasher().keys(list(range(1000)))[-1].hex()}


def test_parse_key() -> None:
    k = hasher().keys(list(range(256)))[0]
    assert parse_key(k.hex()) == k
    with pytest.raises(InputError):
        parse_key("zz")
    with pytest.raises(InputError):
        parse_key("ab" * 8)


def test_c_and_python_token_packing_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.keys as keys_mod

    toks = [0, 1, 2**31 - 1, -(2**31), 70000, -5] * 100
    fast = bytes(keys_mod.token_bytes(toks))
    monkeypatch.setattr(keys_mod, "_pack_i32_c", None)
    slow = bytes(keys_mod.token_bytes(toks))
    assert fast == slow == np.array(toks, dtype="<i4").tobytes()
    assert bytes(keys_mod.token_bytes(np.array(toks, dtype=np.int64))) == fast


def test_token_ids_out_of_range_are_input_errors() -> None:
    with pytest.raises(InputError):
        hasher().keys([2**31] * 256)
    with pytest.raises(InputError):
        hasher().keys(np.zeros((2, 256), dtype=np.int32))


@pytest.mark.parametrize("c_check", [True, False], ids=["c", "python"])
def test_check_keys_takes_keys_and_names_the_bad_one(
    monkeypatch: pytest.MonkeyPatch, c_check: bool
) -> None:
    import kvtier.keys as keys_mod

    if not c_check:
        monkeypatch.setattr(keys_mod, "_keys16_c", None)
    elif keys_mod._keys16_c is None:
        pytest.skip("kvtier._speedups is not built")
    a, b = b"a" * 16, b"b" * 16
    listed = [a, b]
    out = keys_mod.check_keys(listed)
    assert out == [a, b] and out is not listed  # a copy: the caller may change its list
    assert keys_mod.check_keys((a, b)) == [a, b]
    assert keys_mod.check_keys(k for k in (a, b)) == [a, b]  # any iterable
    assert keys_mod.check_keys([]) == []
    for bad, says in [
        ([a, b"short"], "chunk key 1 is 5 bytes"),
        ((a, bytearray(16)), "chunk key 1 is a bytearray"),
        ([memoryview(a)], "chunk key 0 is a memoryview"),
        (b"x" * 16, "got bytes"),
        ("k" * 16, "got str"),
        (None, "got NoneType"),
        (7, "got int"),
    ]:
        with pytest.raises(InputError, match=says):
            keys_mod.check_keys(bad)
