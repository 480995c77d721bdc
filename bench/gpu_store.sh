#!/usr/bin/env bash
# GPU machine, issue 2/3 figures: tests there, then bench store on disk and ram, then kernels.
set -u; cd "$(dirname "$0")/.."; . bench/gpu_setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_store.py \
  tests/test_storage_sglang.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
DISK=$(bench/media.sh disk); RAM=$(bench/media.sh ram 40)
for m in "disk:$DISK" "ram:$RAM"; do
  echo "== bench store on ${m%%:*} ($(findmnt -no SOURCE,FSTYPE --target "${m#*:}" | tr '\n' ' ')) =="
  python3 -m tutti_hicache.cli bench store --medium "${m#*:}" --geometry llama3-8b --pages 512 \
    --threads 16 --pin --json "$OUT/store_${m%%:*}.json" 2>&1 | grep -v Warning | tee "$OUT/store_${m%%:*}.txt"
done
[ -n "${KERNELS:-}" ] && { python3 bench/bench_kernels.py --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1; tail -30 "$OUT/kernels.txt"; }
bench/media.sh teardown
