#!/usr/bin/env bash
# Benchmark media (DESIGN.md section 6), as root on the GPU machine. Prints the directories to use.
#   bench/media.sh ram [GiB]          ext4 on a loop device (--direct-io=on) backed by /dev/shm
#   bench/media.sh array K [GiB]      K such loop devices, one directory each (tutti stripes over them)
#   bench/media.sh nvme RBPS [GiB]    the ram medium throttled by cgroup v2 io.max (read bytes/s);
#                                     run the benchmark with  bench/media.sh exec nvme CMD...
#   bench/media.sh disk               a directory on the machine's real disk
#   bench/media.sh teardown
# RAM-backed and throttled media are emulations of fast NVMe drives; reports say so.
set -euo pipefail
ROOT=/mnt/tutti-media
CG=/sys/fs/cgroup/tutti-nvme

make_loop() {  # name size_gib -> mount dir
  local name=$1 gib=$2 img=/dev/shm/tutti-$1.img dir=$ROOT/$1 dev
  mkdir -p "$dir"
  if ! mountpoint -q "$dir"; then
    truncate -s "${gib}G" "$img"
    dev=$(losetup --direct-io=on -f --show "$img")
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
    mount -o noatime "$dev" "$dir"
  fi
  echo "$dir"
}

case "${1:-}" in
  ram) make_loop ram "${2:-24}" ;;
  array)
    for i in $(seq 0 $((${2:?K}-1))); do make_loop "a$i" "${3:-8}"; done | paste -sd, ;;
  nvme)
    dir=$(make_loop ram "${3:-24}")
    dev=$(findmnt -no SOURCE "$dir"); majmin=$(lsblk -no MAJ:MIN "$dev" | tr -d ' ')
    mkdir -p "$CG"
    echo "+io" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    echo "$majmin rbps=${2:?RBPS}" > "$CG/io.max"
    echo "$dir" ;;
  exec)  # exec nvme CMD...: run CMD inside the throttled cgroup
    shift 2; echo $$ > "$CG/cgroup.procs"; exec "$@" ;;
  disk) mkdir -p /var/tmp/tutti-disk && echo /var/tmp/tutti-disk ;;
  teardown)
    for d in "$ROOT"/*; do
      [ -d "$d" ] || continue
      dev=$(findmnt -no SOURCE "$d" || true)
      umount "$d" 2>/dev/null || true
      [ -n "$dev" ] && losetup -d "$dev" 2>/dev/null || true
    done
    rm -f /dev/shm/tutti-*.img; rmdir "$CG" 2>/dev/null || true ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
