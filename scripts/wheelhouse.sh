#!/usr/bin/env bash
# Offline install of kvtier and a matching CUDA vLLM on a GPU host without package access.
# Recipe and measured sizes: docs/operations.md, "Air-gapped GPU host".
#
#   scripts/wheelhouse.sh build DIR [--vllm 0.26.0] [--python 3.12] [--have FILE] [--slim]
#       On a machine with package access: every wheel the GPU host lacks, for CPython
#       --python on manylinux x86_64, into DIR. torch, triton and the nvidia-* libraries
#       are never fetched: the host's CUDA torch must be the one vLLM pins (0.26: torch
#       2.11). --have FILE: names (or `pip list --format=freeze` lines) of packages the
#       host already has; they are not fetched. --slim: vLLM's wheel without what a Hopper
#       GPU serving dense models never loads (FlashAttention-2, the MoE kernels, the Rust
#       frontend, third_party sources; the FlashAttention-3 library stays), and without
#       vLLM's optional kernel packages (flashinfer, tilelang, cutlass-dsl, ...).
#   scripts/wheelhouse.sh pack DIR PREFIX [--part-mib 55]
#       DIR as one zstd archive (long window) in parts PREFIX.part-aa, -ab, ... of at most
#       --part-mib MiB each, and the zstandard wheel beside them (hosts without `zstd`).
#   scripts/wheelhouse.sh install SRC [--target SITE] [--kvtier PATH]
#       On the GPU host: SRC is a wheelhouse directory or the first part of a packed one.
#       pip installs every wheel with --no-index --no-deps (into SITE: then put SITE on
#       PYTHONPATH), and kvtier from DIR/kvtier-src.tar.gz or --kvtier PATH (a source tree).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
die() { echo "wheelhouse: $*" >&2; exit 2; }

# vLLM requirements never fetched: the host's CUDA torch stack (pinned by vLLM, matched by
# the host image), and media packages no text model imports.
ALWAYS_SKIP='torch torchaudio torchvision torchcodec triton pynvvideocodec'
# vLLM's optional GPU kernel packages: imported only by the models or backends that use them.
# flashinfer-python and apache-tvm-ffi stay: vLLM 0.26's sampler imports flashinfer and
# xgrammar imports tvm_ffi on every engine start.
SLIM_SKIP='tilelang nvidia-cudnn-frontend fastsafetensors
nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels kernels numba nvtx'
# Members of vLLM's wheel a Hopper GPU serving dense models never loads (the rest of
# third_party stays: vLLM finds the GPU through its vendored pynvml, MLA through flashmla).
SLIM_DROP=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so'
  'vllm/third_party/fmha_sm100/*'
  'vllm/third_party/deep_gemm/*' 'vllm/vllm-rs' 'vllm/entrypoints/serve/instrumentator/static/*')
# GPU-side I/O for the nvme tier (kvtier[gds]); cupy and cuda-toolkit come with the image.
KVIKIO='kvikio-cu13 libkvikio-cu13 rapids-logger'

platform_args() {
  local py=$1
  local a=(--only-binary=:all: --python-version "$py" --implementation cp)
  for n in 17 24 26 27 28 31 34 35; do a+=(--platform "manylinux_2_${n}_x86_64"); done
  a+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  echo "${a[@]}"
}

norm() { tr 'A-Z_.' 'a-z--' | sed 's/--*/-/g'; }

build() {
  local dir=$1; shift
  local vllm=0.26.0 py=3.12 have= slim=0
  while [ $# -gt 0 ]; do
    case $1 in
      --vllm) vllm=$2; shift 2;; --python) py=$2; shift 2;; --have) have=$2; shift 2;;
      --slim) slim=1; shift;; *) die "build: unknown option $1";;
    esac
  done
  mkdir -p "$dir/.fetch"
  local plat; plat=$(platform_args "$py")
  # shellcheck disable=SC2086  # plat is a word list
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps $plat -d "$dir/.fetch" "vllm==$vllm"
  local whl; whl=$(ls "$dir"/.fetch/vllm-"$vllm"-*.whl)
  local skip=$ALWAYS_SKIP
  [ "$slim" = 1 ] && skip="$skip $SLIM_SKIP"
  local haveset=""
  [ -n "$have" ] && haveset=$(sed 's/[=<> ].*//' "$have" | norm | tr '\n' ' ')
  # vLLM's own requirements, less the skipped ones, resolved for the target (metadata
  # only: --dry-run --report reads PEP 658 metadata, it downloads no wheel).
  unzip -p "$whl" '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | while read -r req; do
        name=$(echo "$req" | sed 's/[ ;<>=!~\[].*//' | norm)
        case " $skip " in *" $name "*) continue;; esac
        echo "$req"
      done > "$dir/.fetch/requirements.txt"
  # shellcheck disable=SC2086
  PIP_CONSTRAINT= python3 -m pip install -q --dry-run --ignore-installed --target "$dir/.fetch/t" \
    $plat --report "$dir/.fetch/report.json" -r "$dir/.fetch/requirements.txt"
  python3 - "$dir/.fetch/report.json" "$skip $haveset" > "$dir/.fetch/needed.txt" <<'EOF'
import json, re, sys
skip = set(sys.argv[2].split())
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
for item in json.load(open(sys.argv[1]))["install"]:
    name = norm(item["metadata"]["name"])
    # The host's CUDA stack (nvidia-*, torch) is never fetched, whoever asks for it.
    if name in skip or name.startswith("nvidia-") or name == "torch":
        continue
    print(f"{name}=={item['metadata']['version']}")
EOF
  for k in $KVIKIO tomli-w; do
    case " $haveset " in *" $k "*) ;; *) echo "$k" >> "$dir/.fetch/needed.txt";; esac
  done
  # shellcheck disable=SC2086
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps $plat -d "$dir" -r "$dir/.fetch/needed.txt"
  # Every wheel stored uncompressed (pip installs it alike): the packed archive's zstd
  # then compresses the whole wheelhouse at once, 15-20% smaller than deflated wheels.
  mkdir -p "$dir/.fetch/stored"
  for w in "$dir"/*.whl; do python3 "$here/slim_wheel.py" "$w" "$dir/.fetch/stored" >/dev/null; done
  mv -f "$dir"/.fetch/stored/*.whl "$dir/"
  if [ "$slim" = 1 ]; then
    python3 "$here/slim_wheel.py" "$whl" "$dir" "${SLIM_DROP[@]}"
  else
    python3 "$here/slim_wheel.py" "$whl" "$dir"
  fi
  # kvtier itself as a source archive: its C speedups are optional, so the host builds
  # them where it has a compiler and uses the pure-Python fallback where it does not.
  git -C "$root" archive --format=tar.gz --prefix=kvtier/ -o "$dir/kvtier-src.tar.gz" HEAD
  rm -rf "$dir/.fetch"
  echo "wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
}

pack() {
  local dir=$1 prefix=$2; shift 2
  local part=55
  [ "${1:-}" = --part-mib ] && part=$2
  command -v zstd >/dev/null || die "pack needs zstd"
  mkdir -p "$(dirname "$prefix")"
  tar -C "$dir" -cf - . | zstd -12 --long=27 -T0 -q | split -b "${part}M" - "$prefix.part-"
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps $(platform_args 3.12) \
    -d "$(dirname "$prefix")" zstandard
  ls -l "$prefix".part-* >&2
}

unpack() {  # first part -> directory with the wheels
  local first=$1 out=$2 prefix=${1%.part-aa}
  mkdir -p "$out"
  if command -v zstd >/dev/null; then
    cat "$prefix".part-* | zstd -d --long=27 -q | tar -C "$out" -xf -
  else
    # No zstd on the host: the zstandard wheel packed beside the parts.
    local zs; zs=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --target "$zs" "$(dirname "$first")"/zstandard-*.whl
    cat "$prefix".part-* | PYTHONPATH=$zs python3 -c '
import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1 << 27).copy_stream(sys.stdin.buffer, sys.stdout.buffer)' \
      | tar -C "$out" -xf -
  fi
}

install() {
  local src=$1; shift
  local target= kvt=
  while [ $# -gt 0 ]; do
    case $1 in
      --target) target=$2; shift 2;; --kvtier) kvt=$2; shift 2;;
      *) die "install: unknown option $1";;
    esac
  done
  local dir=$src
  if [ -f "$src" ]; then dir=$(mktemp -d); unpack "$src" "$dir"; fi
  local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
  [ -n "$target" ] && pip+=(--upgrade --target "$target")
  "${pip[@]}" "$dir"/*.whl
  if [ -z "$kvt" ] && [ -f "$dir/kvtier-src.tar.gz" ]; then
    kvt=$(mktemp -d)
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$dir/kvtier-src.tar.gz" "$kvt"
    kvt=$kvt/kvtier
  fi
  if [ -n "$kvt" ]; then "${pip[@]}" --no-build-isolation "$kvt"; fi
  echo "wheelhouse: installed $(ls "$dir"/*.whl | wc -l) wheels${kvt:+ and kvtier from $kvt}"
}

cmd=${1:-}; shift || true
case $cmd in
  build) [ $# -ge 1 ] || die "usage: build DIR [...]"; build "$@";;
  pack) [ $# -ge 2 ] || die "usage: pack DIR PREFIX [--part-mib N]"; pack "$@";;
  install) [ $# -ge 1 ] || die "usage: install SRC [--target SITE] [--kvtier PATH]"; install "$@";;
  *) sed -n '2,22p' "$0"; exit 2;;
esac
