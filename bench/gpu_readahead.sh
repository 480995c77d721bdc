#!/usr/bin/env bash
# GPU machine, one call (~4 minutes): the layer-wise restore on array-4 with the read stream,
# read_ahead 1 (each layer's reads drain before the next layer's go out) vs 3 (the default: the
# next layers' requests queued behind this one's), alternating at every point, beside the baselines
# (recompute / compute-only / DRAM tier) of the same run; then TTFT at 64K, h=0.9 under a
# continuous offload stream, scheduler off/on (issue 5).
set -u; cd "$(dirname "$0")/.."; T0=$(date +%s); . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
ARR=$(bench/media.sh array 4 8)
echo "== prefill read-ahead A/B + offload stream, array-4 ($(( $(date +%s) - T0 )) s)"
timeout ${PREFILL_TIMEOUT:-500} python3 bench/bench_prefill.py --baselines --medium "array-4=$ARR" \
  --contexts 32768,65536 --hits ${HITS:-0.5,0.9,0.95,0.99} --crossover-context 65536 \
  --read-ahead ${READ_AHEAD:-1,3} --offload-stream 256 \
  --json "$OUT/prefill_readahead.json" 2>&1 | grep -v Warning | grep -v "^ *{" | tail -60
bench/media.sh teardown
echo "== done ($(( $(date +%s) - T0 )) s)"
