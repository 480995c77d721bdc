#!/usr/bin/env bash
# GPU machine (SGLang 0.5.17 payload carried in .sgl): the end-to-end server
# comparison, one medium per call (keep each invocation under ~10 minutes of GPU time; a server start takes ~1).
#   bash bench/gpu_e2e.sh ram  tutti,file,none  [extra e2e_sglang.py args]
#   bash bench/gpu_e2e.sh disk tutti,file,tutti-plugin
# Results: $OUT/e2e_<medium>.json, $OUT/log.txt, $OUT/logs.tar.gz (server logs, tutti stats).
set -u; cd "$(dirname "$0")/.."; . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
MEDIUM=${1:?medium}; CONFIGS=${2:?configs}; shift 2
case "$MEDIUM" in
  ram) DIR=$(bench/media.sh ram 40) ;;
  disk) DIR=$(bench/media.sh disk) ;;
  *) echo "unknown medium $MEDIUM"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout -s INT 480 python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
  --medium "$MEDIUM=$DIR/e2e" --configs "$CONFIGS" --context 16384 --docs 6 --questions 3 \
  --deadline-s 460 --out-dir /tmp/e2e-logs --json "$OUT/e2e_$MEDIUM.json" "$@"
echo "e2e rc=$?"
tar -C /tmp -czf "$OUT/logs.tar.gz" e2e-logs
bench/media.sh teardown
