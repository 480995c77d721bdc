#!/usr/bin/env bash
# GPU machine: the end-to-end server comparison on `array-8` (8 RAM-backed loop devices; tutti over
# their 8 directories, file/nixl over one filesystem on a device-mapper stripe of the same devices).
#   bash bench/gpu_e2e.sh CONFIGS SECONDS [extra e2e_sglang.py args]
# e.g. bash bench/gpu_e2e.sh tutti-linker,recompute 470
# Results in $OUT: e2e-$TAG.json, log.txt, logs.tar.gz (server logs, tutti stats).
set -u; cd "$(dirname "$0")/.."
. bench/gpu_setup.sh > "$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
exec 3>&1 >> "$OUT/log.txt" 2>&1  # fd 3: the caller's stdout, for the summary at the end
CONFIGS=${1:?configs}; BUDGET=${2:?seconds}; shift 2
echo "stripe tools: $(for t in dmsetup mdadm mkfs.btrfs lvm; do command -v $t || echo "no-$t"; done | xargs)" \
  "modules: $(ls /sys/module | grep -E '^(dm_mod|md_mod|raid0|btrfs)$' | xargs)"
eval "$(bench/media.sh striped 8 8)"
echo "media: DIRS=$DIRS ONE=$ONE TOOL=$TOOL"; df -h /dev/shm | tail -1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
NIXL=""; NOTE="dm-stripe over the 8 devices"
[ "$TOOL" = none ] && NIXL="--nixl-dirs $DIRS" NOTE="one device of the same kind (no device-mapper)"
timeout -s INT $((BUDGET + 30)) python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
  --medium array-8 --tutti-dirs "$DIRS" --one-dir "$ONE" --configs "$CONFIGS" --deadline-s "$BUDGET" \
  --out-dir /tmp/e2e-logs --json "$OUT/e2e-${TAG:-run}.json" --one-dir-note "$NOTE" $NIXL "$@"
echo "e2e rc=$? after ${SECONDS}s"
tar -C /tmp -czf "$OUT/logs.tar.gz" e2e-logs
bench/media.sh teardown
tail -c 9000 "$OUT/log.txt" >&3
