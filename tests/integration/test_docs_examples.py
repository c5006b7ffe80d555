"""docs/operations.md's Python client snippet runs, as written, against a default daemon.

The default daemon has no tokens, so the snippet must work with ``KVTIER_TOKEN`` unset
(issue 12: it raised ``KeyError: 'KVTIER_TOKEN'``). Only the port is changed (8470 is
shared on this machine), and ``HOME`` is a temporary folder so the default data
directory is not the user's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_readme import free_port, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]


def client_snippet() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## Use from Python") :]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m
    return m.group(1)


@pytest.mark.slow
def test_operations_md_client_snippet_against_the_default_daemon(tmp_path: Path) -> None:
    pytest.importorskip("httpx")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("KVTIER_TOKEN", None)
    env.update(HOME=str(tmp_path), README_DAEMON_PORT=port, README_VLLM_PORT=str(free_port()))
    log = tmp_path / "daemon.log"
    proc = start(f"exec {sys.executable} -m kvtier.cli.main serve --port {port}", env, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, log, 300)
        res = subprocess.run(
            [sys.executable, "-c", client_snippet().replace("8470", port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        assert stop(proc, 2) == 0, log.read_text()
