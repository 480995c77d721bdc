#!/usr/bin/env bash
# GPU machine: bench store (ram, disk) and the prefill benchmark (array-4, ram), with A/B of the
# engine and verification on array-4. One log, few JSON files (at most 8 files come back).
set -u; cd "$(dirname "$0")/.."; . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1
exec >> "$OUT/log.txt" 2>&1
RAM=$(bench/media.sh ram 20); ARR=$(bench/media.sh array 4 4); DISK=$(bench/media.sh disk)
for m in "ram:$RAM"; do
  echo "== bench store ${m%%:*}"
  python3 -m tutti_hicache.cli bench store --medium "${m#*:}" --geometry llama3-8b --pages 512 \
    --threads 16 --pin --json "$OUT/store_${m%%:*}.json" 2>&1 | grep -v Warning
done
P="python3 bench/bench_prefill.py"
echo "== prefill array-4"
$P --baselines --medium "array-4=$ARR" --contexts 32768,65536 --hits 0.5,0.9,0.95,0.99 \
  --crossover-context 65536 --json "$OUT/prefill_array4.json"
echo "== prefill array-4, posix engine, verify off (io A/B)"
$P --medium "array-4=$ARR" --contexts 65536 --hits 0.9 --engine posix --json "$OUT/prefill_array4_posix.json"
$P --medium "array-4=$ARR" --contexts 65536 --hits 0.9 --no-verify --json "$OUT/prefill_array4_noverify.json"
echo "== prefill ram"
$P --medium "ram=$RAM" --contexts 32768,65536 --hits 0.5,0.9,0.99 --json "$OUT/prefill_ram.json"
bench/media.sh teardown
