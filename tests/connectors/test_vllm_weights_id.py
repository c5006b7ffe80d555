"""The weights' identity in the keys' namespace (weights.py), without an engine."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.connectors.vllm.keys import KeyScheme
from kvtier.connectors.vllm.settings import model_version_from_extra
from kvtier.connectors.vllm.weights import (
    SAMPLE_BYTES,
    SAMPLES_PER_FILE,
    checkpoint_fingerprint,
    weights_identity,
)
from kvtier.errors import ConfigError
from kvtier.keys import ChunkHasher, Namespace
from kvtier.spec import KVSpec


def write_shard(path: Path, data: bytes, name: str = "w") -> None:
    """A safetensors file of one uint8 tensor holding ``data``."""
    header = json.dumps(
        {name: {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def data(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    # Larger than the samples, so that not every byte is read.
    write_shard(d / "model-00001.safetensors", data(4 * SAMPLES_PER_FILE * SAMPLE_BYTES, 1))
    write_shard(d / "model-00002.safetensors", data(1000, 2))
    return d


def test_equal_files_have_one_identity_wherever_they_are(ckpt: Path, tmp_path: Path) -> None:
    a = checkpoint_fingerprint(ckpt)
    copy = shutil.copytree(ckpt, tmp_path / "elsewhere")
    assert a.source == "files" and a.files == 2 and len(a.fingerprint) == 32
    assert checkpoint_fingerprint(copy).fingerprint == a.fingerprint
    # Bounded: headers and samples, not the files.
    assert a.read_bytes < a.total_bytes / 2
    assert checkpoint_fingerprint(ckpt, salt="other config").fingerprint != a.fingerprint


def test_values_rewritten_under_the_same_header_and_size_change_it(ckpt: Path) -> None:
    before = checkpoint_fingerprint(ckpt).fingerprint
    shard = ckpt / "model-00001.safetensors"
    n = 4 * SAMPLES_PER_FILE * SAMPLE_BYTES
    write_shard(shard, data(n, 99))  # a re-export: same name, dtype, shape, size
    assert checkpoint_fingerprint(ckpt).fingerprint != before


def test_a_changed_header_or_a_new_file_change_it(ckpt: Path) -> None:
    before = checkpoint_fingerprint(ckpt).fingerprint
    shard = ckpt / "model-00002.safetensors"
    write_shard(shard, data(1000, 2), name="renamed")
    renamed = checkpoint_fingerprint(ckpt).fingerprint
    assert renamed != before
    write_shard(ckpt / "model-00003.safetensors", b"x" * 8)
    assert checkpoint_fingerprint(ckpt).fingerprint not in (before, renamed)


def test_a_single_file_checkpoint_is_its_file(ckpt: Path) -> None:
    shard = ckpt / "model-00002.safetensors"
    one = checkpoint_fingerprint(shard)
    assert one.source == "files" and one.files == 1
    write_shard(shard, data(1000, 3))
    assert checkpoint_fingerprint(shard).fingerprint != one.fingerprint


def test_a_folder_without_weights_is_unknown(tmp_path: Path) -> None:
    ident = checkpoint_fingerprint(tmp_path)
    assert (ident.source, ident.fingerprint) == ("unknown", "")
    assert "no weight files" in ident.detail
    assert checkpoint_fingerprint(tmp_path / "missing").source == "unknown"


def fake_vllm_config(model: str, load_format: str, device: str = "cpu") -> SimpleNamespace:
    # An object in the config (its str names its address) must not make the identity vary.
    hf = SimpleNamespace(
        to_dict=lambda: {"hidden_size": 256, "num_hidden_layers": 2, "hook": object()}
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, hf_config=hf, dtype="torch.bfloat16", quantization=None, revision=None
        ),
        load_config=SimpleNamespace(load_format=load_format),
        device_config=SimpleNamespace(device_type=device),
    )


def test_engine_identity_sources(ckpt: Path) -> None:
    pytest.importorskip("vllm")
    files = weights_identity(fake_vllm_config(str(ckpt), "safetensors"), None)  # type: ignore[arg-type]
    assert files.source == "files"
    version = weights_identity(fake_vllm_config(str(ckpt), "safetensors"), "rev-7")  # type: ignore[arg-type]
    assert version.source == "model_version" and version.read_bytes == 0
    assert version.fingerprint != files.fingerprint
    other = weights_identity(fake_vllm_config(str(ckpt), "safetensors"), "rev-8")  # type: ignore[arg-type]
    assert other.fingerprint != version.fingerprint
    # Dummy weights come from a fixed seed: equal across engines of one config and device.
    d1 = weights_identity(fake_vllm_config(str(ckpt), "dummy"), None)  # type: ignore[arg-type]
    d2 = weights_identity(fake_vllm_config("elsewhere", "dummy"), None)  # type: ignore[arg-type]
    cuda = weights_identity(fake_vllm_config(str(ckpt), "dummy", "cuda"), None)  # type: ignore[arg-type]
    assert d1.source == "dummy" and d1.fingerprint == d2.fingerprint != cuda.fingerprint
    assert d1.fingerprint != files.fingerprint
    unknown = weights_identity(fake_vllm_config("no/such-model-xyz", "auto"), None)  # type: ignore[arg-type]
    assert (unknown.source, unknown.fingerprint) == ("unknown", "")


def test_model_version_setting() -> None:
    assert model_version_from_extra({}) is None
    assert model_version_from_extra({"model_version": " v2 "}) == "v2"
    assert model_version_from_extra({"model_version": 3}) == "3"
    for bad in ("", "  ", True, ["v"]):
        with pytest.raises(ConfigError, match="model_version"):
            model_version_from_extra({"model_version": bad})


def test_weights_separate_keys_and_no_weights_keeps_the_old_keys() -> None:
    spec = KVSpec(2, 2, 64)
    toks = list(range(128))
    plain = KeyScheme("m", spec, 64).logical_keys(toks)
    assert plain == ChunkHasher(Namespace("m", spec.fingerprint, 64)).keys(toks)
    a = KeyScheme("m", spec, 64, weights="a" * 32).logical_keys(toks)
    b = KeyScheme("m", spec, 64, weights="b" * 32).logical_keys(toks)
    assert len({plain[0], a[0], b[0]}) == 3
    assert a == KeyScheme("m", spec, 64, weights="a" * 32).logical_keys(toks)
