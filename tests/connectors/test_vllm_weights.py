"""Other weights under the same path never get the old weights' KV (real vLLM engines).

Three engines run one after the other on one model folder and one host + nvme store (what
a clean shutdown leaves in nvme, the next engine finds): the first serves a prompt with
weights A; the weights file is then rewritten with other values under the same name,
same tensors, same size (a re-export); the second engine must miss and match a
recompute; the third, on the unchanged new weights, hits with the second one's output.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.connectors.conftest import (
    CHUNK,
    HOST_BYTES,
    in_process_engine,
    kv_transfer_config,
    prompt,
)

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FULL = 4 * CHUNK  # full chunks of the 300-token prompt


def store_config(nvme: Path) -> dict:
    cfg = kv_transfer_config()
    cfg["kv_connector_extra_config"]["tiers"] = [
        {"kind": "host", "capacity_bytes": HOST_BYTES, "prefault": False},
        {"kind": "nvme", "capacity_bytes": 8 << 20, "dir": str(nvme), "create_dirs": True},
    ]
    return cfg


def test_rewritten_weights_miss_and_unchanged_weights_hit(tmp_path: Path) -> None:
    from kvtier.bench.tiny_llama import TinyLlama, write_tiny_llama

    model = write_tiny_llama(tmp_path / "model")
    other = write_tiny_llama(tmp_path / "other", TinyLlama(seed=4321))
    weights = model / "model.safetensors"
    assert weights.stat().st_size == (other / "model.safetensors").stat().st_size
    cfg = store_config(tmp_path / "nvme")
    p = prompt(41, 300)

    with in_process_engine(str(model), cfg) as e:
        old = e.generate(p)
    assert old.num_cached_tokens == 0

    # A re-export under the same path: same config.json, same tensors, other values.
    shutil.copyfile(other / "model.safetensors", weights)
    with in_process_engine(str(model), cfg) as e:
        new = e.generate(p)
        ref = e.generate(p, cache_salt="recompute")
        loaded = e.totals().get("load_tokens", 0)
        # Also the one engine here over host + nvme: a chunk it just stored is in its
        # host tier, so the repeat loads before the step's forward (async_loads "auto").
        hot = e.generate(p)
        totals = e.totals()
    assert new.num_cached_tokens == 0 and loaded == 0  # nothing of weights A was served
    assert ref.num_cached_tokens == 0
    assert new.tokens == ref.tokens
    assert new.tokens != old.tokens  # the weights really differ (the test can fail)
    assert hot.num_cached_tokens == FULL and hot.tokens == new.tokens
    assert totals.get("load_async", 0) == 0 and totals.get("load_sync_slow_chunks", 0) == 0

    with in_process_engine(str(model), cfg) as e:
        again = e.generate(p)
        totals = e.totals()
    assert again.num_cached_tokens == FULL  # a restart still hits
    assert totals["load_tokens"] == FULL and totals["load_async"] == 1  # from nvme, off the step
    assert again.tokens == new.tokens
