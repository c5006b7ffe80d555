"""LMCache's own storage suites, run against kvtier's LMCache plug-ins.

Usage::

    .venv/bin/python scripts/lmcache_conformance.py [--sdist PATH] [--json OUT] [--control]

The tests come from LMCache's published source distribution (``pip download
--no-binary :all: --no-deps lmcache==0.5.6``, cached under ``~/.cache/kvtier``; or
``--sdist`` / ``KVTIER_LMCACHE_SDIST``), extracted into a temporary folder and never
copied into this repository. Each suite is adapted there, at run time, by exact text
substitutions that only swap LMCache's backend for kvtier's plug-in (a substitution
that no longer matches fails the run: a new LMCache release must be looked at); no
assertion is touched. kvtier's side is real: a ``kvtier serve`` daemon per pytest
process, one tenant (token) per adapter so each test starts empty, as LMCache's
fixtures do. ``--control`` also runs the unadapted suites (LMCache's own backends).

Suites (file in LMCache's tests: kvtier plug-in):

* ``v1/storage_backend/test_remote_storage_plugin.py``: ``KVTierConnectorAdapter`` /
  ``KVTierRemoteConnector``;
* ``v1/storage_backend/test_fs_connector.py`` (LMCache's ``RemoteBackend`` over a
  connector): ``KVTierConnectorAdapter`` in place of the ``fs`` connector;
* ``v1/test_connector.py::test_fs_connector`` (a connector alone: ``save_chunk_meta``
  on and off, full and partial chunks, MLA): ``KVTierConnectorAdapter`` likewise;
* ``v1/storage_backend/test_storage_plugin.py``: ``KVTierStoragePlugin``;
* ``v1/distributed/test_mock_l2_adapter.py`` (the L2 adapter contract):
  ``KVTierL2Adapter``;
* ``v1/distributed/test_fs_l2_adapter_delete.py`` (the L2 delete suite): ``KVTierL2Adapter``;
* ``v1/mp_coordinator/test_mp_server_e2e.py``: real ``lmcache server`` processes whose
  node-local L2 is ``KVTierL2Adapter`` (``RUN_MP_E2E=1``).

Prints per file: passed, failed, skipped, and each failure with its known reason
(:data:`KNOWN`); exit status 1 when a failure is not a known LMCache-internal assumption,
2 when the source distribution cannot be had.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

VERSION = "0.5.6"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtier"

# The adaptation layer, written beside LMCache's tests as ``kvtier_conformance.py``.
HELPER = '''
"""kvtier's side of the conformance run (written by scripts/lmcache_conformance.py).

Also a pytest plug-in (``-p kvtier_conformance``): see pytest_unconfigure.
"""
import gc, itertools, os, socket, subprocess, sys, tempfile, time, traceback
import httpx
import pytest

TENANTS = 256
# Memory only, nothing kept. Small: slots of 1 MiB (most of LMCache's test values are
# KiB). Large: slots for the 32 MiB chunks (and their header) of LMCache's connector
# test, few of them.
SLOTS = {False: ("1MiB", "512MiB"), True: ("33MiB", "512MiB")}
_daemons = {}
_procs = []
_tokens = itertools.count()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_url(large=False):
    """A kvtier daemon for this pytest process (started once, stopped at the end)."""
    if large not in _daemons:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        for i in range(TENANTS):
            env[f"KVTIER_SERVICE__TOKENS__T{i}"] = f"conformance-token-{i}"
        log = open(os.path.join(tempfile.gettempdir(), f"kvtier-conformance-{port}.log"), "wb")
        value, capacity = SLOTS[large]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
            "--set", f"service.max_value_bytes={value}",
            "--set", f"tiers.0.capacity_bytes={capacity}",
            "--set", "tiers.0.prefault=false", "--set", "tiers.0.pin=off",
            "--set", "store.io_threads=2", "--set", "service.data_dir="],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        _procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the kvtier daemon did not start: see " + log.name)
            time.sleep(0.2)
        _daemons[large] = url
    return _daemons[large]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Once a failure is reported, drop the failed test's frames: LMCache's connector
    test frees its 1 GiB allocator only when it passes, and its frames would keep
    every failed test's allocator, connector and load pool alive until the end."""
    yield
    if call.excinfo is not None:
        traceback.clear_frames(call.excinfo.tb)
        sys.last_traceback = sys.last_value = None
        gc.collect()


_exit_status = [0]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _exit_status[0] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Stop the daemons, then end the process with pytest's status: pytest has written
    its report. A failing LMCache connector test leaves its event-loop thread running
    (it closes the loop only on success), which would keep the process alive for ever."""
    for proc in _procs:
        proc.terminate()
    for proc in _procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[0])


def next_token():
    """A tenant of its own: each adapter starts empty, as LMCache's fixtures do."""
    return f"conformance-token-{next(_tokens) % TENANTS}"


def remote_extra(name):
    """LMCache's extra_config for kvtier's remote plug-in under ``name``, a tenant of its
    own (the suite's fixtures start each test in a fresh directory: empty)."""
    p = "remote_storage_plugin." + name
    return {
        p + ".module_path": "kvtier.connectors.lmcache",
        p + ".class_name": "KVTierConnectorAdapter",
        p + ".url": daemon_url(large=True),
        p + ".token": next_token(),
        # The load pool (default 1 GiB) small: LMCache's tests load a chunk or a few.
        p + ".shared_bytes": "256MiB",
    }


def l2_params(capacity_bytes=None):
    params = {"url": daemon_url(), "token": next_token()}
    if capacity_bytes is not None:
        params["capacity_bytes"] = int(capacity_bytes)
    return params


def l2_adapter(config=None):
    """KVTierL2Adapter in place of LMCache's adapter; a mock's size becomes the capacity."""
    from kvtier.connectors.lmcache import KVTierL2Adapter

    size_gb = getattr(config, "max_size_gb", None)
    return KVTierL2Adapter(l2_params(None if size_gb is None else size_gb * (1 << 30)))


def plugin_toml():
    """A kvtier config for the embedded plug-in: one 64 MiB host tier."""
    path = os.path.join(tempfile.mkdtemp(prefix="kvtier-conformance-"), "kvtier.toml")
    with open(path, "w") as f:
        f.write('[[tiers]]\\nkind = "host"\\ncapacity_bytes = "64MiB"\\npin = "off"\\n')
    return path
'''

MODULE = '"kvtier.connectors.lmcache"'


@dataclass(frozen=True)
class Swap:
    """Replace ``old`` by ``new`` in ``path``: exactly ``count`` times (0: at least once)."""

    path: str
    old: str
    new: str
    count: int = 1


REMOTE = "tests/v1/storage_backend/test_remote_storage_plugin.py"
REMOTE_BACKEND = "tests/v1/storage_backend/test_fs_connector.py"
CONNECTOR = "tests/v1/test_connector.py"
STORAGE = "tests/v1/storage_backend/test_storage_plugin.py"
L2_CONTRACT = "tests/v1/distributed/test_mock_l2_adapter.py"
L2_DELETE = "tests/v1/distributed/test_fs_l2_adapter_delete.py"
E2E = "tests/v1/mp_coordinator/test_mp_server_e2e.py"
HARNESS = "tests/v1/mp_coordinator/mp_server_harness.py"
# A suite is a file, or one test of a file (``file::test``): the rest of
# test_connector.py tests LMCache's redis connectors.
SUITES = (
    REMOTE,
    REMOTE_BACKEND,
    f"{CONNECTOR}::test_fs_connector",
    STORAGE,
    L2_CONTRACT,
    L2_DELETE,
    E2E,
)
# Suites run one pytest process per test: LMCache's connector test keeps each failed
# test's 1 GiB allocator, its connector and the connector's load pool until the process
# ends (it closes them only when it passes), which eight tests in one process do not
# survive on a small machine.
ONE_PROCESS_PER_TEST = {f"{CONNECTOR}::test_fs_connector"}


def _remote_entry(name: str, indent: str = "    ") -> str:
    p = f"remote_storage_plugin.{name}"
    return (
        f'{indent}"{p}.module_path": {MODULE},\n'
        f'{indent}"{p}.class_name": "KVTierConnectorAdapter",\n'
        f'{indent}"{p}.url": kvtier_conformance.daemon_url(),\n'
    )


SWAPS = (
    # -- the remote connector: kvtier's connector adapter under the name "kvtier" --------
    Swap(REMOTE, "# First Party\n", "# First Party\nimport kvtier_conformance\n"),
    Swap(
        REMOTE,
        '    "remote_storage_plugin.mock_connector.module_path": (\n'
        '        "tests.v1.storage_backend.test_remote_storage_plugin"\n'
        "    ),\n"
        '    "remote_storage_plugin.mock_connector.class_name": "MockTestConnectorAdapter",\n',
        _remote_entry("kvtier"),
    ),
    Swap(
        REMOTE,
        'MOCK_CONNECTOR_REMOTE_STORAGE_PLUGINS = ["mock_connector"]',
        'MOCK_CONNECTOR_REMOTE_STORAGE_PLUGINS = ["kvtier"]',
    ),
    Swap(REMOTE, '"mockplugin://localhost:1234"', '"plugin://kvtier"', 0),
    Swap(
        REMOTE,
        '            "remote_storage_plugin.mock_connector_1.module_path": (\n'
        '                "tests.v1.storage_backend.test_remote_storage_plugin"\n'
        "            ),\n"
        '            "remote_storage_plugin.mock_connector_1.class_name": '
        '"MockTestConnectorAdapter",  # noqa: E501\n'
        '            "remote_storage_plugin.mock_connector_2.module_path": (\n'
        '                "tests.v1.storage_backend.test_remote_storage_plugin"\n'
        "            ),\n"
        '            "remote_storage_plugin.mock_connector_2.class_name": '
        '"MockTestConnectorAdapter",  # noqa: E501\n',
        _remote_entry("kvtier.a", " " * 12) + _remote_entry("kvtier.b", " " * 12),
    ),
    Swap(
        REMOTE,
        'remote_storage_plugins = ["mock_connector_1", "mock_connector_2"]',
        'remote_storage_plugins = ["kvtier.a", "kvtier.b"]',
    ),
    # -- LMCache's remote backend over the fs connector: over kvtier's instead ----------
    # Its plug-in names ("fs", "fs.primary", "fs.backup") become kvtier's ("kvtier",
    # "kvtier.a", "kvtier.b") wherever they appear: config, the name passed, the name read.
    Swap(
        REMOTE_BACKEND,
        "\n# First Party\nfrom lmcache.utils",
        "\n# First Party\nimport kvtier_conformance\nfrom lmcache.utils",
    ),
    Swap(
        REMOTE_BACKEND,
        '        remote_url=f"fs://host:0/{fs_path}",\n',
        '        remote_url="plugin://kvtier",\n'
        '        remote_storage_plugins=["kvtier"],\n'
        '        extra_config=kvtier_conformance.remote_extra("kvtier"),\n',
    ),
    Swap(
        REMOTE_BACKEND,
        '        remote_storage_plugins=["fs"],\n'
        '        remote_serde="naive",\n'
        '        lmcache_instance_id="test_instance",\n'
        "        extra_config={\n"
        '            "remote_storage_plugin.fs.base_path": fs_path,\n'
        "        },\n",
        '        remote_storage_plugins=["kvtier"],\n'
        '        remote_serde="naive",\n'
        '        lmcache_instance_id="test_instance",\n'
        '        extra_config=kvtier_conformance.remote_extra("kvtier"),\n',
    ),
    Swap(
        REMOTE_BACKEND,
        '        remote_storage_plugins=["fs.primary", "fs.backup"],\n'
        '        remote_serde="naive",\n'
        '        lmcache_instance_id="test_instance",\n'
        "        extra_config={\n"
        '            "remote_storage_plugin.fs.primary.base_path": fs_path1,\n'
        '            "remote_storage_plugin.fs.backup.base_path": fs_path2,\n'
        "        },\n",
        '        remote_storage_plugins=["kvtier.a", "kvtier.b"],\n'
        '        remote_serde="naive",\n'
        '        lmcache_instance_id="test_instance",\n'
        "        extra_config={\n"
        '            **kvtier_conformance.remote_extra("kvtier.a"),\n'
        '            **kvtier_conformance.remote_extra("kvtier.b"),\n'
        "        },\n",
    ),
    Swap(REMOTE_BACKEND, 'plugin_name="fs",', 'plugin_name="kvtier",'),
    Swap(REMOTE_BACKEND, 'backend.plugin_name == "fs"', 'backend.plugin_name == "kvtier"'),
    Swap(REMOTE_BACKEND, 'plugin_name="fs.primary",', 'plugin_name="kvtier.a",'),
    Swap(REMOTE_BACKEND, 'plugin_name="fs.backup",', 'plugin_name="kvtier.b",'),
    # -- LMCache's connector test (save_chunk_meta, partial chunks, MLA): kvtier's -------
    Swap(CONNECTOR, "# First Party\n", "# First Party\nimport kvtier_conformance\n"),
    Swap(CONNECTOR, 'url = f"fs://host:0/{temp_dir}/"', 'url = "plugin://kvtier"'),
    Swap(
        CONNECTOR,
        "        config = LMCacheEngineConfig.from_defaults(\n"
        '            extra_config={"save_chunk_meta": save_chunk_meta}\n'
        "        )\n",
        "        config = LMCacheEngineConfig.from_defaults(\n"
        '            remote_storage_plugins=["kvtier"],\n'
        "            extra_config={\n"
        '                "save_chunk_meta": save_chunk_meta,\n'
        '                **kvtier_conformance.remote_extra("kvtier"),\n'
        "            },\n"
        "        )\n",
    ),
    # -- the storage plug-in: KVTierStoragePlugin under the name "mock_backend" ----------
    Swap(STORAGE, "# First Party\n", "# First Party\nimport kvtier_conformance\n"),
    Swap(
        STORAGE,
        '    "storage_plugin.mock_backend.module_path": (\n'
        '        "tests.v1.storage_backend.test_storage_plugin"\n'
        "    ),\n"
        '    "storage_plugin.mock_backend.class_name": "MockStoragePlugin",\n',
        f'    "storage_plugin.mock_backend.module_path": {MODULE},\n'
        '    "storage_plugin.mock_backend.class_name": "KVTierStoragePlugin",\n'
        '    "storage_plugin.mock_backend.config_file": kvtier_conformance.plugin_toml(),\n',
    ),
    # -- the L2 adapter contract: KVTierL2Adapter where the suite builds its mock --------
    Swap(
        L2_CONTRACT,
        "from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import (\n"
        "    MockL2Adapter,\n"
        "    MockL2AdapterConfig,\n"
        ")\n",
        "from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig\n"
        "from kvtier_conformance import l2_adapter as MockL2Adapter\n",
    ),
    # -- the L2 delete suite: KVTierL2Adapter where it builds its FS adapter -------------
    Swap(L2_DELETE, "# First Party\n", "# First Party\nimport kvtier_conformance\n"),
    Swap(
        L2_DELETE,
        "adp = FSL2Adapter(FSL2AdapterConfig(base_path=str(tmp_path)))",
        "adp = kvtier_conformance.l2_adapter()",
    ),
    # -- lmcache server end to end: kvtier as the node-local L2 --------------------------
    Swap(HARNESS, "# First Party\n", "# First Party\nimport kvtier_conformance\n"),
    Swap(
        HARNESS,
        '    return L2Backend("mock", options={"max_size_gb": 0.0625, "mock_bandwidth_gb": 10})',
        '    return L2Backend("plugin", options={"module_path": "kvtier.connectors.lmcache",\n'
        '        "class_name": "KVTierL2Adapter",\n'
        '        "adapter_params": kvtier_conformance.l2_params(0.0625 * (1 << 30))})',
    ),
    # The backend's name in the server's events and its delete API: "plugin", not "mock".
    Swap(E2E, 'LOCAL_L2 = (Tier.L2, "mock", False)', 'LOCAL_L2 = (Tier.L2, "plugin", False)'),
    Swap(E2E, '(first, "l2", "mock"),', '(first, "l2", "plugin"),'),
)

# Failures that are LMCache-internal assumptions, and why kvtier does not imitate them.
CLASS_NAME = (
    "asserts the class name of LMCache's test double (MockTest*/MockStoragePlugin); "
    "kvtier's class has its own name, and taking a mock's name would only fool the check"
)
SPY = (
    "reads the test double's own recording fields (call_history, storage: a dict of "
    "memory objects), which no real backend has; kvtier's plug-in keeps chunks in a "
    "kvtier store, reached through the plug-in interface"
)
TIMING = (
    "asserts the mock's simulated bandwidth (a store of 40 KB must take > 0.1 s); kvtier "
    "does not slow down on purpose"
)
FS_URL = (
    "asserts the fs connector's URL (fs://host:0/<its directory>) as the backend's "
    "remote_url; kvtier's plug-in is named by plugin://kvtier"
)
FS_FILES = (
    "counts the fs connector's files in its directory (one <key>.data file, its size with "
    "or without LMCache's 28-byte header), after every check of the connector passed; "
    "kvtier keeps chunks in its daemon, not in the test's directory"
)


@dataclass(frozen=True)
class Known:
    """A failure explained: ``reason``, when the failure's report holds ``at`` (the
    assertion that failed; empty: any). A test named ``name`` matches, and so does each
    of its parameter sets (``name[...]``)."""

    reason: str
    at: str = ""


_LAUNCHER = f"{REMOTE}::TestConnectorPluginLauncher::test_remote_storage_plugin"
KNOWN: dict[str, Known] = {
    f"{_LAUNCHER}_adapter_is_loaded": Known(CLASS_NAME, "MockTest"),
    f"{_LAUNCHER}_creates_connector": Known(CLASS_NAME, "MockTest"),
    f"{_LAUNCHER}_multiple_plugins": Known(CLASS_NAME, "MockTest"),
    f"{STORAGE}::TestCreateDynamicBackends::test_storage_plugin_is_loaded": Known(
        CLASS_NAME, "MockStoragePlugin"
    ),
    f"{L2_CONTRACT}::TestBandwidthSimulation::test_store_completion_is_delayed_by_bandwidth": (
        Known(TIMING, "elapsed > 0.1")
    ),
    f"{REMOTE_BACKEND}::TestFSConnector::test_init": Known(FS_URL, "backend.remote_url =="),
    f"{CONNECTOR}::test_fs_connector": Known(FS_FILES, "assert len(files) == 1"),
}
# Every other test of the storage plug-in suite goes through the double's spy fields.
SPY_FILES = {STORAGE: Known(SPY, "object has no attribute")}


def known(name: str, report: str) -> str:
    """Why the failure of test ``name`` (its report: message and traceback) is an
    LMCache-internal assumption; empty when it is not a known one."""
    k = KNOWN.get(name) or KNOWN.get(name.split("[", 1)[0])
    k = k or SPY_FILES.get(name.split("::", 1)[0])
    return k.reason if k is not None and k.at in report else ""


@dataclass
class FileResult:
    path: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)


def sdist(path: str | None) -> Path | None:
    """LMCache's source distribution: given, cached, or downloaded with pip."""
    given = path or os.environ.get("KVTIER_LMCACHE_SDIST")
    if given:
        return Path(given) if Path(given).is_file() else None
    cached = CACHE / f"lmcache-{VERSION}.tar.gz"
    if cached.is_file():
        return cached
    CACHE.mkdir(parents=True, exist_ok=True)
    # pip prepares the metadata of what it downloads: without the native extensions
    # and against the installed torch, that takes seconds instead of a CUDA build.
    env = {**os.environ, "NO_NATIVE_EXT": "1"}
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    cmd += ["--no-build-isolation", f"lmcache=={VERSION}", "-d", str(CACHE)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0 or not cached.is_file():
        print(run.stdout[-2000:] + run.stderr[-2000:], file=sys.stderr)
        return None
    return cached


def extract(archive: Path, into: Path) -> Path:
    """LMCache's tests and pytest.ini, under ``into``; the root they run from."""
    prefix = f"lmcache-{VERSION}/"
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/") or m.name == prefix + "pytest.ini"
        ]
        tar.extractall(into, members=members, filter="data")
    return into / prefix


def adapt(root: Path) -> None:
    """Apply :data:`SWAPS` and write the helper. Raises when a swap does not match."""
    (root / "kvtier_conformance.py").write_text(HELPER)
    for s in SWAPS:
        f = root / s.path
        text = f.read_text()
        n = text.count(s.old)
        if n == 0 or (s.count and n != s.count):
            raise SystemExit(f"{s.path}: expected {s.count or '>= 1'} of {s.old!r}, found {n}")
        f.write_text(text.replace(s.old, s.new))


def _pytest(root: Path, adapted: bool) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(root), "RUN_MP_E2E": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "log_cli=false"]
    if adapted:
        cmd += ["-p", "kvtier_conformance"]
    return [*cmd, "--rootdir", str(root)], env


def run_suite(
    root: Path, suite: str, out: Path, extra: list[str], adapted: bool = True
) -> FileResult:
    """One suite: one pytest process, or one per test for :data:`ONE_PROCESS_PER_TEST`."""
    cmd, env = _pytest(root, adapted)
    ids = [suite]
    if suite in ONE_PROCESS_PER_TEST:
        listed = subprocess.run(
            [*cmd, "--collect-only", suite, *extra],  # with cmd's -q: one id a line
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        ids = [line for line in listed.stdout.splitlines() if line.startswith(suite)] or ids
    res = FileResult(suite)
    for i, node in enumerate(ids):
        xml = out / f"{suite.split('::', 1)[0].replace('/', '_')}.{i}.xml"
        run = [*cmd, f"--junitxml={xml}", node, *extra]
        subprocess.run(run, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
        if not xml.is_file():
            res.failures.append({"test": node, "message": "pytest wrote no report", "known": ""})
            res.failed += 1
            continue
        _count(res, suite.split("::", 1)[0], xml)
    return res


def _count(res: FileResult, path: str, xml: Path) -> None:
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{path}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        name = name.replace("::test_" + path.rsplit("/", 1)[-1][5:-3] + "::", "::")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if case.find("skipped") is not None:
            res.skipped += 1
        elif bad is not None:
            res.failed += 1
            report = (bad.get("message") or "") + "\n" + (bad.text or "")
            msg = (bad.get("message") or "").splitlines()
            res.failures.append(
                {"test": name, "message": msg[0][:300] if msg else "", "known": known(name, report)}
            )
        else:
            res.passed += 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", help="LMCache's source distribution (.tar.gz)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--control", action="store_true", help="also run LMCache's own backends")
    ap.add_argument("--suite", action="append", help="run only these files (repeatable)")
    args, extra = ap.parse_known_args(argv)
    archive = sdist(args.sdist)
    if archive is None:
        print(f"LMCache {VERSION}'s source distribution is not available", file=sys.stderr)
        return 2
    suites = [s for s in SUITES if not args.suite or any(x in s for x in args.suite)]
    doc: dict[str, object] = {"lmcache": VERSION, "sdist": str(archive)}
    unknown = 0
    with tempfile.TemporaryDirectory(prefix="kvtier-lmcache-conformance-") as tmp:
        runs = [("kvtier", True)] + ([("lmcache", False)] if args.control else [])
        for label, adapted in runs:
            root = extract(archive, Path(tmp) / label)
            if adapted:
                adapt(root)
            results = [run_suite(root, s, Path(tmp) / label, extra, adapted) for s in suites]
            doc[label] = [asdict(r) for r in results]
            what = "kvtier plug-ins" if adapted else "LMCache's own backends"
            print(f"\n{label}: {what}")
            print(f"{'file':<58} {'passed':>6} {'failed':>6} {'skipped':>7}")
            for r in results:
                print(f"{r.path[6:]:<58} {r.passed:>6} {r.failed:>6} {r.skipped:>7}")
                for f in r.failures:
                    tag = "LMCache-internal" if f["known"] else "FAILURE"
                    print(f"  {tag}: {f['test'].split('::', 1)[1]}: {f['message'][:160]}")
                    if f["known"]:
                        print(f"    why kvtier differs: {f['known']}")
                    elif adapted:
                        unknown += 1
            total = [sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped")]
            print(f"{'total':<58} {total[0]:>6} {total[1]:>6} {total[2]:>7}")
    doc["unexplained_failures"] = unknown
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
