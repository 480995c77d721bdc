#!/usr/bin/env bash
# GPU machine (SGLang 0.5.17 payload carried in .sgl): the end-to-end server comparison.
# ~1 minute per server start; 2 starts per configuration and medium.
set -u; cd "$(dirname "$0")/.."; . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
RAM=$(bench/media.sh ram 40); DISK=$(bench/media.sh disk)
python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
  --medium "disk=$DISK/e2e" --medium "ram=$RAM/e2e" --configs none,file,tutti \
  --context 16384 --docs 3 --questions 4 --out-dir "$OUT/e2e" --json "$OUT/e2e.json"
python3 bench/e2e_sglang.py --model /tmp/llama8 --medium "ram=$RAM/e2e-plugin" --configs tutti-plugin \
  --context 8192 --docs 1 --questions 2 --out-dir "$OUT/e2e" --json "$OUT/e2e_plugin.json"
bench/media.sh teardown
