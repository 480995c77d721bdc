#!/usr/bin/env bash
# Create or update a CPU-only virtual environment for tutti_hicache's tests.
#
# Usage: scripts/setup_env.sh [--sglang VERSION] [--venv DIR]
#   --sglang VERSION   SGLang release to install with --no-deps (default 0.5.23; 0.5.17 is also supported)
#   --venv DIR         virtual environment to create or update (default: .venv in the repository root)
# Environment:
#   PYTHON             interpreter for a new venv (default: python3.11, else python3)
#   TORCH_VERSION      CPU torch to pin (default 2.13.0); every pip call is constrained to it,
#                      otherwise pip replaces it with a newer CUDA build (several GB).
#   TORCH_INDEX_URL    extra index for the CPU torch wheel (e.g. https://download.pytorch.org/whl/cpu)
#                      on machines where `pip install torch==X` would pick a CUDA build.
#
# Idempotent: re-running installs only what is missing. torchvision is NOT installed (PyPI's wheels
# need CUDA torch); tests stub it (tutti_hicache/testing/).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SGLANG_VERSION=0.5.23
VENV="$REPO/.venv"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --sglang) SGLANG_VERSION=${2:?--sglang needs a version}; shift 2 ;;
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "setup_env.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

log() { printf '[setup_env %3ds] %s\n' "$SECONDS" "$*" >&2; }

# Small runtime dependencies of SGLang's storage, host-pool and controller modules on CPU.
# Versions come from the installed SGLang's own pins (e.g. transformers 5.12.1 / 5.19.0).
SGLANG_DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
  pyzmq tqdm IPython aiohttp triton transformers dill apache-tvm-ffi sentencepiece gguf
  compressed-tensors ninja xxhash openai partial_json_parser prometheus-client)
# SGLang's own pins are used for these, except OVERRIDES: sentencepiece 0.2.1 (0.5.23's pin) segfaults at
# interpreter exit once SGLang has imported it under pytest; 0.2.3 does not.
OVERRIDES="sentencepiece>=0.2.3"
# Older SGLang (seen: 0.5.17) also imports server_args from memory_pool, hence its parsers' packages.
OLD_SGLANG_DEPS=(xgrammar einops)
# The Mooncake client (CPU build) for the tiered backend's cluster tests, with SGLang 0.5.23 only
# (its MooncakeStore is the one tutti_hicache.tiered builds on).
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

# The extension itself needs only g++ and cmake: liburing and xxhash are vendored (cpp/third_party).
# libibverbs1: the Mooncake client (tests/cluster) links it even when it only speaks TCP.
install_apt_packages() {
  local want=(libssl-dev g++ pkg-config libibverbs1) missing=()
  command -v cmake >/dev/null || want+=(cmake)
  local py=$1
  "$py" -c 'import ensurepip, venv' 2>/dev/null || want+=(python3-venv)
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    log "WARNING: missing system packages (install them as root): ${missing[*]}"
    return 0
  fi
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

version_lt() { [[ $1 != "$2" && $(printf '%s\n' "$1" "$2" | sort -V | head -n1) == "$1" ]]; }

pick_python() {
  if [[ -n ${PYTHON:-} ]]; then echo "$PYTHON"; return; fi
  command -v python3.11 || command -v python3
}

# pip, quiet: warnings and progress hidden, errors shown, except the expected complaints that
# SGLang's own pins are unmet (it is installed with --no-deps). A failing pip stops the script.
vpip() {
  "$VENV/bin/python" -m pip install -qq --disable-pip-version-check "$@" 2>&1 |
    sed -e "/^ERROR: pip's dependency resolver does not currently take into account/d" \
        -e '/^sglang [^ ]* requires /d' >&2
}

# Print "name<spec>" for each wanted package, using the pin in SGLang's metadata when it has one.
pinned_deps() {
  OVERRIDES="$OVERRIDES" "$VENV/bin/python" - "$@" <<'EOF'
import os, re, sys
from importlib.metadata import requires
pins = {}
for req in requires("sglang") or []:
    if ";" in req:
        continue  # extras and platform-specific requirements
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", req)
    pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2).strip()
for spec in os.environ.get("OVERRIDES", "").split():
    m = re.match(r"([A-Za-z0-9_.-]+)(.*)", spec)
    pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
for name in sys.argv[1:]:
    print(name + pins.get(re.sub(r"[-_.]+", "-", name).lower(), ""))
EOF
}

main() {
  local py
  py=$(pick_python) || { echo "setup_env.sh: no python3 found" >&2; exit 1; }
  install_apt_packages "$py"

  if [[ ! -x $VENV/bin/python ]]; then
    log "creating venv $VENV with $("$py" --version 2>&1)"
    "$py" -m venv "$VENV"
  fi
  local constraints="$VENV/tutti-constraints.txt"
  echo "torch==$TORCH_VERSION" >"$constraints"

  log "torch==$TORCH_VERSION"
  vpip -c "$constraints" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
  log "sglang==$SGLANG_VERSION (--no-deps)"
  vpip -c "$constraints" --no-deps "sglang==$SGLANG_VERSION"
  local deps wanted=("${SGLANG_DEPS[@]}")
  version_lt "$SGLANG_VERSION" 0.5.23 && wanted+=("${OLD_SGLANG_DEPS[@]}")
  mapfile -t deps < <(pinned_deps "${wanted[@]}")
  log "SGLang CPU dependencies: ${deps[*]}"
  vpip -c "$constraints" "${deps[@]}"
  if ! version_lt "$SGLANG_VERSION" 0.5.23; then
    log "$MOONCAKE"
    vpip -c "$constraints" "$MOONCAKE"
  fi

  if [[ -f $REPO/pyproject.toml ]]; then
    # Editable: tests run from the repository root, whose tutti_hicache/ would otherwise shadow an
    # installed copy and its compiled extension.
    # The build requirements in the venv too: tests/engine/test_build.py configures a clean build with them.
    log "build requirements: scikit-build-core pybind11"
    vpip -c "$constraints" "scikit-build-core>=0.10" "pybind11>=2.12"
    log "project: -e $REPO[test]"
    vpip -c "$constraints" -e "$REPO[test]"
  else
    log "WARNING: $REPO/pyproject.toml not found; project not installed"
  fi
  # Import check through the harness: a bare `import sglang` needs the torchvision stub.
  (cd "$REPO" && "$VENV/bin/python" -c 'import torch
from tutti_hicache.testing.sglang import ensure_sglang
print("torch", torch.__version__, "sglang", ensure_sglang(), "imports OK")')
  log "done: activate with . $VENV/bin/activate"
}

main
