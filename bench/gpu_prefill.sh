#!/usr/bin/env bash
# GPU machine, issue 2 and 4 figures: bench store on ram again, then the layer-wise prefill
# benchmark on array-4, ram, disk and nvme-3 (the ram medium throttled to 3 GB/s).
set -u; cd "$(dirname "$0")/.."; . bench/gpu_setup.sh
RAM=$(bench/media.sh ram 20); ARR=$(bench/media.sh array 4 4); DISK=$(bench/media.sh disk)
if [ -z "${SKIP_STORE:-}" ]; then
  for m in "ram:$RAM" "disk:$DISK"; do
    python3 -m tutti_hicache.cli bench store --medium "${m#*:}" --geometry llama3-8b --pages 512 \
      --threads 16 --pin --json "$OUT/store_${m%%:*}.json" 2>&1 | grep -v Warning | tee "$OUT/store_${m%%:*}.txt"
  done
fi
P="python3 bench/bench_prefill.py"
$P --baselines --medium "array-4=$ARR" --crossover-context 32768 --json "$OUT/prefill_array4.json" 2>&1 | tee "$OUT/prefill_array4.txt"
$P --medium "ram=$RAM" --contexts 32768,65536 --hits 0.5,0.9,0.99 --json "$OUT/prefill_ram.json" 2>&1 | tee "$OUT/prefill_ram.txt"
$P --medium "disk=$DISK" --contexts 16384,32768 --hits 0.5,0.9 --json "$OUT/prefill_disk.json" 2>&1 | tee "$OUT/prefill_disk.txt"
NV=$(bench/media.sh nvme 3000000000 20)
bench/media.sh exec nvme $P --medium "nvme-3=$NV" --contexts 32768 --hits 0.5,0.9 --json "$OUT/prefill_nvme3.json" 2>&1 | tee "$OUT/prefill_nvme3.txt"
bench/media.sh teardown
