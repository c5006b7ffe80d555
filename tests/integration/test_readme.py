"""Every code block of README.md runs here, as written (issue 12: the README had drifted).

Blocks run in README order from the repository root, with four changes of environment
and none of text but ports:

* ``HOME`` is a temporary folder, so ``~/...`` outputs and the default data directory
  (``~/.local/share/kvtier``) never touch the user's; ``KVTIER_*`` variables are cleared.
* ``VLLM_CACHE_ROOT`` stays vLLM's cache of the user running the tests (vLLM's default
  place under the real home), not one under the temporary ``HOME``: a user's vLLM keeps
  its cache, and an empty one costs the server an extra vLLM import at start.
* Ports: the daemon's 8470 (``KVTIER_SERVICE__PORT`` for ``make serve``, the text for
  ``curl``) and vLLM's 8000 become free ports (other engineers and CI jobs run daemons on
  this machine).
* What runs forever runs in the background: a block with ``make serve`` or vLLM's
  ``api_server`` is started, awaited (``/readyz``, ``/health``), the block after it runs
  against it, then it is stopped as a user would (Ctrl-C for ``make serve``, which must
  end quietly with status 0). vLLM's server is a module fixture: its start is the
  expensive part, so it is launched before the first block (its start overlaps the
  blocks before it; ``_vllm_launches_first``) and awaited at its own step, and
  ``test_the_readme_server_hits_across_processes`` (the checks of ``vllm serve`` across
  its processes) uses the same server; it stops after both.

Two blocks are not executed, on purpose: ``make test`` (this suite; its recipe is checked
with ``make -n``), and the one whose first line says it needs a CUDA host (its
``--kv-transfer-config`` must equal the CPU command's). Every other ``sh`` and ``python``
block runs; no other kind of code block is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.procs import kill_group, vllm_scratch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
GPU_MARK = "# GPU host"


# The embedded default configuration's chunk (``store.chunk_tokens``), which the README's
# server runs on: its text says a 600-token prompt hits "two full 256-token chunks".
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int

    @property
    def kind(self) -> str:
        if self.lang == "python":
            return "python"
        if self.text.startswith(GPU_MARK):
            return "gpu"
        if self.text.strip() == "make test":
            return "make-test"
        if re.search(r"^make serve\b", self.text, re.M):
            return "daemon"
        if "vllm.entrypoints.openai.api_server" in self.text:
            return "vllm"
        return "sh"


def blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(m.group(1).strip(), m.group(2), text[: m.start()].count("\n") + 1)
        for m in FENCE.finditer(text)
    ]


def steps() -> list[tuple[Block, ...]]:
    """Blocks grouped as they run: a server block together with the block after it."""
    out: list[tuple[Block, ...]] = []
    bs = blocks()
    i = 0
    while i < len(bs):
        if bs[i].kind in ("daemon", "vllm"):
            out.append((bs[i], bs[i + 1]))
            i += 2
        else:
            out.append((bs[i],))
            i += 1
    return out


def test_the_readme_has_only_blocks_that_run() -> None:
    bs = blocks()
    assert {b.lang for b in bs} <= {"sh", "python"}, [b.lang for b in bs]
    kinds = [b.kind for b in bs]
    assert kinds.count("gpu") == 1 and kinds.count("daemon") == 1 and kinds.count("vllm") == 1
    # No indented code blocks outside fences: they would escape this test.
    outside = FENCE.sub("", README.read_text())
    assert not re.search(r"\n\n {4}\S", outside), "indented code block in README.md"


def test_the_gpu_form_takes_the_same_kv_transfer_config() -> None:
    (gpu,) = [b for b in blocks() if b.kind == "gpu"]
    (cpu,) = [b for b in blocks() if b.kind == "vllm"]

    def config(text: str) -> dict[str, object]:
        m = re.search(r"--kv-transfer-config \\?\s*'(\{.*?\})'", text, re.S)
        assert m, text
        return json.loads(m.group(1))  # type: ignore[no-any-return]

    assert config(gpu.text) == config(cpu.text)
    assert config(cpu.text)["kv_connector_module_path"] == "kvtier.connectors.vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(HOME=str(home), VLLM_CPU_OMP_THREADS_BIND="nobind")
    e.update(vllm_scratch(tmp_path_factory.mktemp("tmp")))
    e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    e["README_DAEMON_PORT"] = str(free_port())
    e["README_VLLM_PORT"] = str(free_port())
    e["KVTIER_SERVICE__PORT"] = e["README_DAEMON_PORT"]  # `make serve` names no port
    # vLLM's own cache stays where vLLM keeps it for this user (as for a user, whose HOME
    # has it; vLLM's default is $XDG_CACHE_HOME/vllm or ~/.cache/vllm). In an empty one
    # the API server first inspects the model class in a subprocess of its own, one more
    # import of vLLM and torch before it starts.
    e["VLLM_CACHE_ROOT"] = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    return e


def as_run(text: str, env: dict[str, str]) -> str:
    return text.replace("8470", env["README_DAEMON_PORT"]).replace("8000", env["README_VLLM_PORT"])


def top_level() -> set[str]:
    # What setup makes: .venv, and the egg-info of pip's editable install (a fresh
    # checkout has none until its first setup, which a README block may run).
    return {p.name for p in ROOT.iterdir() if not p.name.endswith(".egg-info")} - {".venv"}


def sh(text: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", as_run(text, env)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer:\n{log.read_text()[-4000:]}")


def start(text: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-e", "-c", as_run(text, env)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], sig: int) -> int:
    os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(proc)  # and the shared memory a killed engine leaves
        raise


@dataclass(frozen=True)
class VllmServer:
    block: Block
    url: str
    model: str  # the served model's name: its --model path, ``~`` expanded
    log: Path


@dataclass(frozen=True)
class Launched:
    block: Block
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def readme_vllm_launched(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    """The README's vLLM block (the tiny model, then its API server) started as written;
    not awaited (``readme_vllm`` awaits it). Stopped at the module's end (SIGTERM)."""
    if importlib.util.find_spec("vllm") is None:  # the server imports it, not this process
        pytest.skip("vLLM is not installed (scripts/setup.sh test installs the CPU build)")
    (block,) = [b for b in blocks() if b.kind == "vllm"]
    log = tmp_path_factory.mktemp("readme-vllm") / "vllm.log"
    proc = start(block.text, env, log)
    try:
        yield Launched(block, proc, log)
    finally:
        stop(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def readme_vllm(env: dict[str, str], readme_vllm_launched: Launched) -> VllmServer:
    """The README's vLLM server, once it answers ``/health``."""
    launched = readme_vllm_launched
    url = f"http://127.0.0.1:{env['README_VLLM_PORT']}"
    wait_http(url + "/health", launched.proc, launched.log, 600)
    model = re.search(r"--model (\S+)", launched.block.text)
    assert model, launched.block.text
    return VllmServer(
        launched.block, url, model.group(1).replace("~", env["HOME"], 1), launched.log
    )


def _needs_vllm(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "step" in callspec.params:
        return bool(callspec.params["step"][0].kind == "vllm")
    return "readme_vllm" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="module", autouse=True)
def _vllm_launches_first(request: pytest.FixtureRequest) -> None:
    """Launches the README's vLLM server before this module's first test, when a selected
    test needs it, as a user might start it in another terminal first.

    Its start takes minutes (three processes import vLLM and torch), and the blocks before
    it (daemon, demo, calc) take minutes of their own, mostly on one core: they overlap
    instead of adding up. It cannot make another block pass: it serves only its own port,
    writes only under the temporary HOME (``~/kvtier-tiny-llama``), and every block still
    checks its own output and that nothing was written into the repository root.
    """
    if importlib.util.find_spec("vllm") is None:
        return  # the vLLM tests skip (readme_vllm_launched); the others run
    if any(
        getattr(i, "module", None) is request.module and _needs_vllm(i)
        for i in request.session.items
    ):
        request.getfixturevalue("readme_vllm_launched")


def check_outputs(block: Block, res: subprocess.CompletedProcess[str], home: Path) -> None:
    """What the README says each command prints or writes."""
    out = res.stdout
    if "calc" in block.text and "--slo 7" in block.text:
        assert "objective met: TTFT p99 SLO 7 s" in out, out
        assert (home / "kvtier-calc" / "plan.json").is_file()
        assert (home / "kvtier-calc" / "cost_latency_frontier.png").is_file()
    if "--slo 5" in block.text:
        assert "objective NOT met" in out and "exit status 1:" in out, out
    if "kvtier demo" in block.text:
        assert "every loaded chunk verified byte for byte" in out, out
    if "sweep" in block.text:
        assert "sweep:" in out and "TTFT p99 s" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("step", steps(), ids=lambda s: f"README.md:{s[0].line}")
def test_readme_block_runs_as_written(
    step: tuple[Block, ...], env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    block = step[0]
    home = Path(env["HOME"])
    before = top_level()
    if block.kind == "gpu":
        pytest.skip("needs a CUDA host and the model's weights (config checked above)")
    if block.kind == "make-test":
        res = subprocess.run(
            ["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert res.returncode == 0 and "scripts/setup.sh test" in res.stdout
        assert "pytest" in res.stdout
    elif block.kind == "python":
        res = subprocess.run(
            [sys.executable, "-c", block.text],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert res.returncode == 0, res.stdout + res.stderr
    elif block.kind == "sh":
        res = sh(block.text, env)
        assert res.returncode == 0, res.stdout + res.stderr
        check_outputs(block, res, home)
    elif block.kind == "daemon":
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        log = tmp_path / "make-serve.log"
        proc = start(block.text, env, log)
        try:
            wait_http(f"http://127.0.0.1:{env['README_DAEMON_PORT']}/readyz", proc, log, 300)
            res = sh(step[1].text, env, timeout=120)
            assert res.returncode == 0, res.stdout + res.stderr
            assert '{"status":"ok"}' in res.stdout and "kvtier_store_chunks" in res.stdout
        finally:
            rc = stop(proc, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
        text = log.read_text()
        # make itself always ends by re-raising the SIGINT it got (as any program Ctrl-C
        # stops); quietly means: the daemon shut down cleanly and exited 0, so make prints
        # no "make: *** [serve] Interrupt" (it does when its recipe dies of a signal).
        assert rc in (0, -signal.SIGINT, 128 + signal.SIGINT), text
        assert "kvtier daemon stopped (SIGINT)" in text, text
        assert "make: ***" not in text and "Traceback" not in text, text
        assert (home / ".local/share/kvtier/nvme").is_dir()  # the documented data directory
    elif block.kind == "vllm":
        # Requested here, not in the signature: only this step starts the server.
        server: VllmServer = request.getfixturevalue("readme_vllm")
        assert server.block == block
        res = sh(step[1].text, env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr + server.log.read_text()[-3000:]
        assert res.stdout.strip() == '"cached_tokens":512', res.stdout
    assert top_level() == before, "a README command wrote into the repository root"


def _complete(url: str, model: str, tokens: list[int]) -> dict[str, Any]:
    body = {
        "model": model, "prompt": tokens, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "detokenize": False, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.load(r)
    return out


def _cached(out: dict[str, Any]) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_readme_server_hits_across_processes(readme_vllm: VllmServer) -> None:
    """``vllm serve`` (the README's server: vLLM's default multi-process engine, the
    connector's scheduler side in EngineCore and its worker side in the worker process)
    hits on a repeat, with token ids identical to the computed run.

    This was tests/connectors/test_vllm_serve.py's server test; it runs on the README's
    server so that the suite starts one API server for both. Isolation: its prompt is
    random tokens of its own seed, sharing no leading chunk with the README's
    ``seq 1 600`` prompt, so whichever of the two runs first, each one's first request is
    a miss of its own and each one's hit is its own.
    """
    p = random.Random(11).choices(range(3, 1000), k=3 * DEFAULT_CHUNK_TOKENS + 44)
    first = _complete(readme_vllm.url, readme_vllm.model, p)
    second = _complete(readme_vllm.url, readme_vllm.model, p)
    assert _cached(first) == 0
    assert _cached(second) == 3 * DEFAULT_CHUNK_TOKENS
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
