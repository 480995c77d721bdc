#!/usr/bin/env bash
# GPU machine, one short call: TTFT under a continuous offload stream, scheduler off/on (issue 5,
# array-4), per-layer kernel bandwidth best of 3, eager and in a CUDA graph (issue 3), the e2e plugin smoke test (issue 7)
# with whatever time is left.
set -u; cd "$(dirname "$0")/.."; T0=$(date +%s); . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
left() { echo $(( ${BUDGET:-330} - ($(date +%s) - T0) )); }
ARR=$(bench/media.sh array 4 8)
echo "== prefill with an offload stream, array-4 ($(left) s left)"
timeout 120 python3 bench/bench_prefill.py --medium "array-4=$ARR" --contexts 65536 \
  --hits 0.9 --offload-stream 256 --json "$OUT/prefill_offload.json" 2>&1 | grep -v Warning | tail -6
bench/media.sh teardown; RAM=$(bench/media.sh ram 8)
echo "== bench kernels, per layer, best of 3 ($(left) s left)"
timeout 90 python3 bench/bench_kernels.py --layers-only --repeats 3 --graph --json "$OUT/kernels_layers.json" 2>&1 | tail -20
echo "== e2e plugin smoke ($(left) s left)"
timeout -s INT $(( $(left) - 15 )) python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
  --medium "ram=$RAM/e2e" --configs tutti-plugin --context 8192 --docs 2 --questions 2 \
  --out-dir /tmp/e2e-logs --json "$OUT/e2e_plugin.json" --start-timeout 150
tar -C /tmp -czf "$OUT/logs.tar.gz" e2e-logs
echo "== done ($(left) s left)"
bench/media.sh teardown
