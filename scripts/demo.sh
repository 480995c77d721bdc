#!/usr/bin/env bash
# The main job: installs what it needs, then writes a long prefix's KV pages through TuttiStorage
# (SGLang's own controller path), restarts the store, restores and verifies every byte, and
# compares restore bandwidth with a raw O_DIRECT read of the same disk and SGLang's `file` backend.
# Extra arguments go to `tutti-hicache demo` (e.g. --dir /nvme/tmp --pages 512 --geometry llama3-8b).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$REPO/scripts/setup_env.sh" --venv "$REPO/.venv" >&2
cd "$REPO"
exec "$REPO/.venv/bin/tutti-hicache" demo "$@"
