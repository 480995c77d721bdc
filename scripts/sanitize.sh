#!/usr/bin/env bash
# The C++ extension under AddressSanitizer (+ UndefinedBehaviorSanitizer) and ThreadSanitizer:
# builds each variant into build/sanitize-VARIANT (the installed extension stays as it is), then
# runs the engine, read-stream, layer-wise and DRAM-tier tests against it. Any sanitizer report
# fails, except that a variant whose only report is its runtime failing to map its own memory
# (errno 12) runs again, up to 5 times in all.
#
# Usage: scripts/sanitize.sh [--venv DIR] [address] [thread] [-- PYTEST_ARGS...]
#   --venv DIR   a venv made by scripts/setup_env.sh (default: .venv in the repository root)
#   VARIANTS     address and/or thread (default: both)
#
# How: Python and torch are not instrumented, so the sanitizer runtime is preloaded (LD_PRELOAD)
# and the tests load the instrumented module through TUTTI_EXTENSION (tutti_hicache/engine.py),
# which each run checks by its SANITIZER attribute. Reports go to log files (a report aborts the
# process, and pytest's capture would swallow one written to stderr), printed here at the end.
# LeakSanitizer is off: CPython frees nothing at exit by design. scripts/tsan.supp is for races
# inside uninstrumented libraries only (CPython, torch; none needed so far), never our code.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$REPO/.venv"
VARIANTS=()
PYTEST_ARGS=()
TESTS=(tests/engine/test_sanitizers.py tests/engine/test_engine.py tests/engine/test_enter_failure.py
  tests/store/test_scheduler_io.py tests/store/test_layerwise.py tests/store/test_hosttier.py)

while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    address|thread) VARIANTS+=("$1"); shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done
[[ ${#VARIANTS[@]} -gt 0 ]] || VARIANTS=(address thread)
PY="$VENV/bin/python"
[[ -x $PY ]] || { echo "sanitize.sh: no venv at $VENV (run scripts/setup_env.sh)" >&2; exit 2; }
log() { printf '[sanitize %3ds] %s\n' "$SECONDS" "$*" >&2; }

# The shared runtime g++ links the module against: libasan.so / libtsan.so, as an absolute path.
runtime() {
  local lib
  lib=$(g++ -print-file-name="lib$1.so")
  [[ $lib == /* && -e $lib ]] || { echo "sanitize.sh: g++ has no lib$1.so" >&2; return 1; }
  readlink -f "$lib"
}

# Configures and builds build/sanitize-VARIANT; prints the module's path. (Called where `set -e`
# does not apply, hence the explicit returns.)
build() {
  local variant=$1 dir="$REPO/build/sanitize-$1" out
  tool() { command -v "$1" || echo "$VENV/bin/$1"; }
  log "build $variant -> ${dir#"$REPO"/}"
  out=$("$(tool cmake)" -S "$REPO" -B "$dir" -G Ninja -DCMAKE_MAKE_PROGRAM="$(tool ninja)" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTUTTI_SANITIZE="$variant" -DPython_EXECUTABLE="$PY" \
    -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" 2>&1) ||
    { echo "$out" >&2; return 1; }
  out=$(nice "$(tool ninja)" -C "$dir" -j "$(nproc)" _engine 2>&1) || { echo "$out" >&2; return 1; }
  compgen -G "$dir/_engine*.so" || { echo "sanitize.sh: no module in $dir" >&2; return 1; }
}

# Runs the tests under one variant; returns 1 on a report or a failing test.
run_variant() {
  local variant=$1 so logs lib norandom="" rc=0
  RUNTIME_ONLY=0
  so=$(build "$variant") || { log "$variant: build FAILED"; return 1; }
  logs=$(mktemp -d)
  case $variant in
    address)
      # libstdc++ too: ASan intercepts __cxa_throw, and finds it only if it is loaded at start.
      lib=$(runtime asan) && lib="$lib $(runtime stdc++)" || return 1
      export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1:log_path=$logs/asan"
      export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan" ;;
    thread)
      lib=$(runtime tsan) || return 1
      # GCC 12's TSan runtime assumes the kernel's classic address layout: without ASLR the
      # interpreter's and torch's mappings stay in it (with it, a remap of its shadow fails).
      norandom="setarch $(uname -m) -R"
      $norandom true 2>/dev/null || { log "WARNING: setarch -R refused here; TSan runs with ASLR"; norandom=""; }
      # Torch's OpenMP workers synchronise in uninstrumented code: one thread keeps them out.
      export OMP_NUM_THREADS=1
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:history_size=4:suppressions=$REPO/scripts/tsan.supp:log_path=$logs/tsan" ;;
  esac
  log "tests under $variant (LD_PRELOAD=$lib)"
  (cd "$REPO" && TUTTI_EXTENSION="$so" LD_PRELOAD="$lib" "$PY" -c \
    "from tutti_hicache.engine import extension; s = extension().SANITIZER
assert s == '$variant', f'loaded a {s} build, not $variant'") || rc=1
  if [[ $rc -eq 0 ]]; then
    (cd "$REPO" && TUTTI_EXTENSION="$so" LD_PRELOAD="$lib" $norandom "$VENV/bin/pytest" -q \
      -p no:cacheprovider "${TESTS[@]}" "${PYTEST_ARGS[@]}") || rc=1
  fi
  unset ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS OMP_NUM_THREADS
  if compgen -G "$logs/*" >/dev/null; then
    for f in "$logs"/*; do echo "==== $variant report: $(basename "$f")"; cat "$f"; done
    rc=1
    # the runtime failing to map its own shadow memory (errno 12: TSan, mid-run, in about a
    # third of the runs here) is not a finding about our code: every report is that line alone
    grep -qvh -e "Sanitizer failed to allocate .* (errno: 12)" -e '^[[:space:]]*$' "$logs"/* ||
      RUNTIME_ONLY=1
  fi
  rm -rf "$logs"
  log "$variant: $([[ $rc -eq 0 ]] && echo clean || echo FAILED)"
  return $rc
}

status=0
for v in "${VARIANTS[@]}"; do
  for attempt in 1 2 3 4 5; do  # a runtime that could not map its memory: up to 5 tries
    if run_variant "$v"; then break; fi
    if [[ $RUNTIME_ONLY == 1 && $attempt -lt 5 ]]; then
      log "$v: the sanitizer runtime could not map its memory (no report on our code); again"
    else
      status=1; break
    fi
  done
done
exit $status
