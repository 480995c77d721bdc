#!/usr/bin/env bash
# GPU machine, one call (~9 minutes): the plugin smoke test of the e2e run (issue 7), the kernel
# tests and kernel bandwidth after the block-size change (issue 3), TTFT under a continuous
# offload stream with the scheduler off/on (issue 5), bench store on ram with the AVX2 checksum
# build (issue 2). Each step runs only while enough of the call's time is left.
set -u; cd "$(dirname "$0")/.."; T0=$(date +%s); . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
RAM=$(bench/media.sh ram 24)
echo "== e2e plugin smoke ($(left) s left)"
timeout -s INT 200 python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
  --medium "ram=$RAM/e2e" --configs tutti-plugin --context 8192 --docs 2 --questions 2 \
  --out-dir /tmp/e2e-logs --json "$OUT/e2e_plugin.json"
tar -C /tmp -czf "$OUT/logs.tar.gz" e2e-logs
echo "== kernel tests on the GPU ($(left) s left)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_green.py 2>&1 | tail -3
echo "== bench kernels ($(left) s left)"
[ "$(left)" -gt 200 ] && timeout 150 python3 bench/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tail -32
echo "== prefill with an offload stream, array-4 ($(left) s left)"
if [ "$(left)" -gt 110 ]; then
  ARR=$(bench/media.sh array 4 4)
  timeout $(( $(left) - 50 )) python3 bench/bench_prefill.py --medium "array-4=$ARR" --contexts 65536 \
    --hits 0.9 --offload-stream 256 --json "$OUT/prefill_offload.json" 2>&1 | grep -v Warning | tail -6
fi
echo "== bench store ram ($(left) s left)"
[ "$(left)" -gt 40 ] && timeout $(( $(left) - 5 )) python3 -m tutti_hicache.cli bench store --medium "$RAM" \
  --geometry llama3-8b --pages 512 --threads 16 --pin --json "$OUT/store_ram.json" 2>&1 | grep -v Warning
echo "== done ($(left) s left)"
bench/media.sh teardown
