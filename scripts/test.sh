#!/usr/bin/env bash
# The test command: installs what it needs (apt when root, a CPU venv per SGLang version) and runs
# the whole suite against SGLang 0.5.23, then the storage-path suite against SGLang 0.5.17, then
# the engine, read-stream, layer-wise and DRAM-tier tests against ASan and TSan builds of the extension.
# No GPU needed: GPU tests skip with a reason; Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
STORAGE_TESTS=(tests/sglang/test_storage_sglang.py tests/sglang/test_harness_file_backend.py
  tests/sglang/test_plugin_and_patches.py tests/sglang/test_cli.py)

scripts/setup_env.sh --sglang 0.5.23 --venv "$REPO/.venv"
echo "== tests, SGLang 0.5.23 =="
"$REPO/.venv/bin/pytest" -q "$@"

scripts/setup_env.sh --sglang 0.5.17 --venv "$REPO/.venv-0.5.17"
echo "== storage path, SGLang 0.5.17 =="
"$REPO/.venv-0.5.17/bin/pytest" -q "${STORAGE_TESTS[@]}" "$@"

echo "== sanitizers: the engine, read-stream, layer-wise and DRAM-tier tests under ASan+UBSan and TSan =="
scripts/sanitize.sh --venv "$REPO/.venv"
