#!/usr/bin/env bash
# The GPU machine's benchmark runner, one family per call (as root: the media are loop devices).
#   bash bench/gpu.sh store   MEDIA [tutti-hicache bench store args]   MEDIA: disk, ram, nvme-N, comma-separated
#   bash bench/gpu.sh prefill MEDIUM [bench_prefill.py args]           MEDIUM: disk, ram, array-K or nvme-N
#   bash bench/gpu.sh write   MEDIA [bench_write.py args]              MEDIA: disk, ram, array-K, nvme-N, comma-separated
#   bash bench/gpu.sh kernels [bench_kernels.py args]
#   bash bench/gpu.sh profile [tutti-hicache profile args]
#   bash bench/gpu.sh e2e     CONFIGS SECONDS [e2e_sglang.py args]     on array-8 (E2E_MEDIUM=disk: the disk)
#   bash bench/gpu.sh faults  CONFIGS SECONDS [faults_sglang.py args]  faults in a real server, array-8
#   bash bench/gpu.sh mooncake [MEDIUM] [bench_cluster.py args]        remote (Mooncake) vs local hit
#                                                                      vs recompute (default ram)
# Every family sources bench/gpu_setup.sh (build and install; its output in $OUT/log.txt), builds the
# media it needs with bench/media.sh, writes its JSON to $OUT and tears the media down. Arguments after
# the family's own are passed through unchanged. JSON: store_MEDIUM.json, prefill_MEDIUM.json,
# write_MEDIUM.json, kernels.json, profile.json, cluster_MEDIUM.json (each with _$TAG appended when
# TAG is set), e2e-${TAG:-run}.json, faults.json.
# Environment: RAM_GIB (20: ram and nvme-N), ARRAY_GIB (8 per device: array-K), TIMEOUT (seconds
# for each benchmark command, 0 = none; e2e takes SECONDS instead).
set -u; cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/tutti-out}; mkdir -p "$OUT"

setup() {  # build and install tutti_hicache; show the log only when that fails
  . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
  grep -E '^(tutti engine:|posix only|sglang )' "$OUT/log.txt"
  reap
}

reap() {  # what an earlier call left on a warm machine: the servers of a harness killed at a time
  # limit (they run in sessions of their own, with their GPU memory and pinned host pools), then
  # its media (loop devices, mounts, images in /dev/shm)
  python3 -P -m tutti_hicache.benchmarks.server --reap
  bench/media.sh teardown > /dev/null 2>&1
}

media_dirs() {  # NAME -> the medium's directories, comma-separated
  case "$1" in
    disk) bench/media.sh disk ;;
    ram) bench/media.sh ram "${RAM_GIB:-20}" ;;
    array-[0-9]*) bench/media.sh array "${1#array-}" "${ARRAY_GIB:-8}" ;;
    nvme-[0-9]*)  # N GB/s of reads
      bench/media.sh nvme "$(awk -v n="${1#nvme-}" 'BEGIN { printf "%.0f", n * 1e9 }')" "${RAM_GIB:-20}" ;;
    *) echo "unknown medium '$1' (disk, ram, array-K, nvme-N)" >&2; return 2 ;;
  esac
}

bench_run() {  # MEDIUM CMD...: CMD (inside the throttled cgroup for nvme-N), its output also in log.txt
  local m=$1 rc; shift
  case "$m" in nvme-*) set -- bench/media.sh exec nvme "$@" ;; esac
  echo "== $*" | tee -a "$OUT/log.txt"
  timeout "${TIMEOUT:-0}" "$@" 2>&1 | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  echo "== rc=$rc after ${SECONDS}s" | tee -a "$OUT/log.txt"
  return "$rc"
}

family_store() {  # L3 -> host restore: tutti vs raw O_DIRECT vs SGLang's file, one medium at a time
  local media=${1:?media, e.g. ram,disk} m dir rc=0; shift
  setup
  for m in ${media//,/ }; do
    case "$m" in array-*) echo "store: bench store takes one directory, $m has several" >&2; rc=2; continue ;; esac
    dir=$(media_dirs "$m") || { rc=1; continue; }
    echo "== medium $m: $dir ($(findmnt -no SOURCE,FSTYPE --target "$dir" | xargs))"
    bench_run "$m" python3 -P -m tutti_hicache.cli bench store --medium "$dir" "$@" \
      --json "$OUT/store_$m${TAG:+_$TAG}.json" || rc=$?
  done
  bench/media.sh teardown
  return $rc
}

family_prefill() {  # layer-wise restore behind a forward pass (TTFT, bubble) on one medium
  local m=${1:?medium: disk, ram, array-K or nvme-N} dirs rc=0; shift
  setup
  dirs=$(media_dirs "$m") || { bench/media.sh teardown; return 1; }
  echo "== medium $m: $dirs"
  bench_run "$m" python3 bench/bench_prefill.py --medium "$m=$dirs" "$@" \
    --json "$OUT/prefill_$m${TAG:+_$TAG}.json" || rc=$?
  bench/media.sh teardown
  return $rc
}

family_write() {  # writes vs raw O_DIRECT writes (fallocated and overwritten), one medium at a time
  local media=${1:?media, e.g. disk,ram,array-8} m dirs rc=0; shift
  setup
  for m in ${media//,/ }; do
    dirs=$(media_dirs "$m") || { rc=1; continue; }
    echo "== medium $m: $dirs"
    bench_run "$m" python3 bench/bench_write.py --medium "$m=$dirs" --pages 256 --threads 16 "$@" \
      --json "$OUT/write_$m${TAG:+_$TAG}.json" || rc=$?
    bench/media.sh teardown
  done
  return $rc
}

family_kernels() {  # scatter/gather bandwidth vs a D2D copy, and interference with compute (no media)
  setup
  bench_run - python3 bench/bench_kernels.py "$@" --json "$OUT/kernels${TAG:+_$TAG}.json"
}

family_profile() {  # per-layer compute windows -> the scheduler's slack table (no media)
  setup
  bench_run - python3 -P -m tutti_hicache.cli profile "$@" --out "$OUT/profile${TAG:+_$TAG}.json"
}

family_e2e() {
  # The end-to-end server comparison on `array-8` (8 RAM-backed loop devices; tutti over their 8
  # directories, file/nixl over one filesystem on a device-mapper stripe of the same devices), or
  # with E2E_MEDIUM=disk on the machine's own disk (every backend in a directory of it).
  #   bash bench/gpu.sh e2e CONFIGS SECONDS [extra e2e_sglang.py args]
  # e.g. bash bench/gpu.sh e2e tutti-linker,recompute 470
  # The model has seeded random weights (--weights seeded, ~5.5 GB at 8 layers, written once to
  # /tmp/llama8), so outputs are compared with recompute's for real; `--weights dummy` among the
  # extra args brings back SGLang's dummy weights. A configuration NAME+misplace (tutti-host and the
  # linkers) is the output check's negative control: it must be reported as mismatching.
  # Results in $OUT: e2e-$TAG.json, log.txt, logs.tar.gz (server logs, tutti stats).
  . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
  exec 3>&1 >> "$OUT/log.txt" 2>&1  # fd 3: the caller's stdout, for the summary at the end
  reap | tee /dev/fd/3
  CONFIGS=${1:?configs}; BUDGET=${2:?seconds}; shift 2
  echo "stripe tools: $(for t in dmsetup mdadm mkfs.btrfs lvm; do command -v $t || echo "no-$t"; done | xargs)" \
    "modules: $(ls /sys/module | grep -E '^(dm_mod|md_mod|raid0|btrfs)$' | xargs)"
  local medium=${E2E_MEDIUM:-array-8} d
  if [ "$medium" = disk ]; then  # the machine's own disk: every backend in one directory of it
    d=$(bench/media.sh disk); rm -rf "$d/e2e"; mkdir -p "$d/e2e/tutti" "$d/e2e/one"
    DIRS=$d/e2e/tutti ONE=$d/e2e/one TOOL=disk NIXL="" NOTE="the same disk"
  else
    # Without device-mapper ONE is a ninth device: ONE_GIB (40) holds what the backends that take
    # one directory write there (file, lmcache-ssd's L2: 4.3 GB per 32K document; lmcache-gds's slab)
    export ONE_GIB=${ONE_GIB:-40}
    eval "$(bench/media.sh striped 8 8)"
    NIXL=""; NOTE="dm-stripe over the 8 devices"
    [ "$TOOL" = none ] && NIXL="--nixl-dirs $DIRS" NOTE="one device of the same kind (no device-mapper)"
  fi
  echo "media: $medium DIRS=$DIRS ONE=$ONE TOOL=$TOOL"; df -h /dev/shm "$ONE" | tail -2
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  timeout -s INT $((BUDGET + 30)) python3 bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \
    --weights seeded \
    --medium "$medium" --tutti-dirs "$DIRS" --one-dir "$ONE" --configs "$CONFIGS" --deadline-s "$BUDGET" \
    --out-dir /tmp/e2e-logs --json "$OUT/e2e-${TAG:-run}.json" --one-dir-note "$NOTE" $NIXL "$@"
  echo "e2e rc=$? after ${SECONDS}s"
  tar -C /tmp -czf "$OUT/logs.tar.gz" e2e-logs
  bench/media.sh teardown
  tail -c 9000 "$OUT/log.txt" >&3
}

family_faults() {  # faults inside a real SGLang server (bench/faults_sglang.py) on array-8
  . bench/gpu_setup.sh > "$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; exit 1; }
  reap
  local configs=${1:?configs} budget=${2:?seconds}; shift 2
  eval "$(bench/media.sh striped 8 "${ARRAY_GIB:-4}")"
  timeout -s INT "$budget" python3 bench/faults_sglang.py --write-model --model /tmp/llama8 --layers 8 \
    --tutti-dirs "$DIRS" --configs "$configs" --out-dir /tmp/faults-logs \
    --json "$OUT/faults${TAG:+_$TAG}.json" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -40
  tar -C /tmp -czf "$OUT/faults-logs.tar.gz" faults-logs
  bench/media.sh teardown
}

family_mooncake() {  # the tiered backend's cluster tier: two node processes + a master on loopback TCP
  local m=ram dir rc=0
  case "${1:-}" in disk|ram|nvme-*) m=$1; shift ;; esac
  setup
  if ! python3 -c 'import mooncake.store' 2>"$OUT/mooncake-import.txt"; then
    echo "mooncake.store does not import (carry .mooncake/mooncake.tar.xz):"; cat "$OUT/mooncake-import.txt"
    ldd /tmp/site/mooncake/store.so 2>/dev/null | grep 'not found'; return 1
  fi
  dir=$(media_dirs "$m") || { bench/media.sh teardown; return 1; }
  mkdir -p "$dir/a" "$dir/b"
  echo "== medium $m: $dir"
  bench_run "$m" python3 bench/bench_cluster.py --dirs "$dir/a,$dir/b" --log-dir "$OUT" "$@" \
    --json "$OUT/cluster_$m${TAG:+_$TAG}.json" || rc=$?
  bench/media.sh teardown
  return $rc
}

family=${1:-}; [ $# -gt 0 ] && shift
case "$family" in
  store|prefill|write|kernels|profile|e2e|faults|mooncake) "family_$family" "$@" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
