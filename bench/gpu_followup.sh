#!/usr/bin/env bash
# GPU machine, one short call (~6 minutes): what is still to be measured there.
#  - TTFT at 64K, h=0.9 under a continuous offload stream, scheduler off/on (issue 5, array-4);
#  - per-layer kernel bandwidth, best of 3, eager and inside a CUDA graph (issue 3);
#  - how long `tutti-hicache profile` takes for the Llama-3-8B geometry (issue 5).
set -u; cd "$(dirname "$0")/.."; T0=$(date +%s); . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
left() { echo $(( ${BUDGET:-330} - ($(date +%s) - T0) )); }
ARR=$(bench/media.sh array 4 8)
echo "== prefill with an offload stream, array-4 ($(left) s left)"
timeout 150 python3 bench/bench_prefill.py --medium "array-4=$ARR" --contexts 65536 \
  --hits 0.9 --offload-stream 256 --json "$OUT/prefill_offload.json" 2>&1 | grep -v Warning | tail -6
bench/media.sh teardown
echo "== bench kernels, per layer, best of 3 ($(left) s left)"
timeout 120 python3 bench/bench_kernels.py --layers-only --repeats 3 --graph --json "$OUT/kernels_layers.json" 2>&1 | tail -20
echo "== profile ($(left) s left)"
timeout $(( $(left) - 10 )) python3 -m tutti_hicache.cli profile --out "$OUT/slack.json" 2>&1 | tail -5
echo "== done ($(left) s left)"
