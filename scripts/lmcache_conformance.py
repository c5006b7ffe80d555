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
"""kvtier's side of the conformance run (written by scripts/lmcache_conformance.py)."""
import atexit, itertools, os, socket, subprocess, sys, tempfile, time
import httpx

TENANTS = 256
_daemon = None
_tokens = itertools.count()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_url():
    """A kvtier daemon for this pytest process (started once, stopped at exit)."""
    global _daemon
    if _daemon is None:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        for i in range(TENANTS):
            env[f"KVTIER_SERVICE__TOKENS__T{i}"] = f"conformance-token-{i}"
        log = open(os.path.join(tempfile.gettempdir(), f"kvtier-conformance-{port}.log"), "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
             # Memory only, slots of 1 MiB (LMCache's test values are KiB), nothing kept.
            "--set", "service.max_value_bytes=1MiB", "--set", "tiers.0.capacity_bytes=512MiB",
            "--set", "tiers.0.prefault=false", "--set", "tiers.0.pin=off",
            "--set", "store.io_threads=2", "--set", "service.data_dir="],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        atexit.register(lambda: (proc.terminate(), proc.wait(30)))
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
        _daemon = url
    return _daemon


def next_token():
    """A tenant of its own: each adapter starts empty, as LMCache's fixtures do."""
    return f"conformance-token-{next(_tokens) % TENANTS}"


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
STORAGE = "tests/v1/storage_backend/test_storage_plugin.py"
L2_CONTRACT = "tests/v1/distributed/test_mock_l2_adapter.py"
L2_DELETE = "tests/v1/distributed/test_fs_l2_adapter_delete.py"
E2E = "tests/v1/mp_coordinator/test_mp_server_e2e.py"
HARNESS = "tests/v1/mp_coordinator/mp_server_harness.py"
SUITES = (REMOTE, STORAGE, L2_CONTRACT, L2_DELETE, E2E)


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
_LAUNCHER = f"{REMOTE}::TestConnectorPluginLauncher::test_remote_storage_plugin"
KNOWN: dict[str, str] = {
    f"{_LAUNCHER}_adapter_is_loaded": CLASS_NAME,
    f"{_LAUNCHER}_creates_connector": CLASS_NAME,
    f"{_LAUNCHER}_multiple_plugins": CLASS_NAME,
    f"{STORAGE}::TestCreateDynamicBackends::test_storage_plugin_is_loaded": CLASS_NAME,
    f"{L2_CONTRACT}::TestBandwidthSimulation::test_store_completion_is_delayed_by_bandwidth": (
        TIMING
    ),
}
# Every other test of the storage plug-in suite goes through the double's spy fields.
SPY_FILES = {STORAGE: SPY}


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


def run_suite(root: Path, suite: str, out: Path, extra: list[str]) -> FileResult:
    xml = out / (suite.replace("/", "_") + ".xml")
    env = {**os.environ, "PYTHONPATH": str(root), "RUN_MP_E2E": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "log_cli=false"]
    cmd += ["--rootdir", str(root), f"--junitxml={xml}", suite, *extra]
    subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    res = FileResult(suite)
    if not xml.is_file():
        res.failures.append({"test": suite, "message": "pytest wrote no report", "known": ""})
        res.failed = 1
        return res
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{suite}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        name = name.replace("::test_" + suite.rsplit("/", 1)[-1][5:-3] + "::", "::")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if case.find("skipped") is not None:
            res.skipped += 1
        elif bad is not None:
            res.failed += 1
            known = KNOWN.get(name) or SPY_FILES.get(suite, "")
            msg = (bad.get("message") or "").splitlines()
            res.failures.append(
                {"test": name, "message": msg[0][:300] if msg else "", "known": known}
            )
        else:
            res.passed += 1
    return res


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
            results = [run_suite(root, s, Path(tmp), extra) for s in suites]
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
