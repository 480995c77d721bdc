#!/usr/bin/env bash
# Benchmark media, as root on the GPU machine. Prints the directories to use.
#   bench/media.sh ram [GiB]          ext4 on a loop device (--direct-io=on) backed by /dev/shm
#   bench/media.sh array K [GiB]      K such loop devices, one directory each (tutti stripes over them)
#   bench/media.sh nvme RBPS [GiB]    the ram medium throttled by cgroup v2 io.max (read bytes/s);
#                                     run the benchmark with  bench/media.sh exec nvme CMD...
#   bench/media.sh disk               a directory on the machine's real disk
#   bench/media.sh striped K [GiB]    K loop devices, each split in two halves (device-mapper linear):
#                                     the first halves one directory each (as `array`), the second
#                                     halves one filesystem on a device-mapper stripe (or mdadm RAID-0)
#                                     over the same K devices, for backends that take one directory.
#                                     Prints "DIRS=d0,...", "ONE=dir" and "TOOL=dmsetup|mdadm|none";
#                                     without device-mapper ONE is one more device, of ONE_GIB
#   bench/media.sh teardown
# RAM-backed and throttled media are emulations of fast NVMe drives; reports say so.
set -euo pipefail
ROOT=${TUTTI_MEDIA_ROOT:-/mnt/tutti-media}
CG=/sys/fs/cgroup/tutti-nvme

udev_record() {  # dev: cuFile (lmcache-gds) asks udev for a volume's filesystem (ID_FS_USAGE) and refuses
  # to register a file when there is no answer; with no udevd here nobody writes that record, so write it
  local dev=$1 rec
  rec=/run/udev/data/b$(printf '%d:%d' "0x$(stat -L -c %t "$dev")" "0x$(stat -L -c %T "$dev")")
  [ -e "$rec" ] && return 0
  mkdir -p /run/udev/data
  printf 'I:%s\nE:ID_FS_TYPE=ext4\nE:ID_FS_USAGE=filesystem\nE:ID_FS_UUID=%s\n' \
    "$(($(date +%s%N) / 1000))" "$(blkid -s UUID -o value "$dev" 2>/dev/null || true)" > "$rec"
  echo "$rec" >> /dev/shm/tutti-udev-records
}

make_loop() {  # name size_gib -> mount dir
  local name=$1 gib=$2 img=/dev/shm/tutti-$1.img dir=$ROOT/$1 dev
  mkdir -p "$dir"
  if ! mountpoint -q "$dir"; then
    truncate -s "${gib}G" "$img"
    dev=$(losetup --direct-io=on -f --show "$img")
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
    mount -o noatime "$dev" "$dir"
    udev_record "$dev"
  fi
  echo "$dir"
}

shm_room() {  # make /dev/shm (tmpfs) large enough for the images
  local want=${1:?GiB} have
  have=$(df -BG --output=size /dev/shm | tail -1 | tr -dc 0-9)
  [ "$have" -ge "$want" ] || mount -o remount,size="${want}G" /dev/shm
}

mkfs_mount() {  # dev dir
  mkdir -p "$2"
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$1"
  mount -o noatime "$1" "$2"
  udev_record "$1"
}

dm_works() { command -v dmsetup >/dev/null && dmsetup version >/dev/null 2>&1; }

striped() {  # K GiB: one image per device; with device-mapper, each split in halves
  local k=$1 gib=$2 i loop half dirs="" parts="" tool=none dm=0
  dm_works && dm=1
  shm_room $(((dm + 1) * k * gib + ${ONE_GIB:-$gib}))
  for i in $(seq 0 $((k - 1))); do
    truncate -s "$(((dm + 1) * gib))G" "/dev/shm/tutti-d$i.img"
    loop=$(losetup --direct-io=on -f --show "/dev/shm/tutti-d$i.img")
    if [ $dm = 1 ]; then
      half=$(($(blockdev --getsz "$loop") / 2))
      dmsetup create "tutti-a$i" --table "0 $half linear $loop 0"
      dmsetup create "tutti-s$i" --table "0 $half linear $loop $half"
      mkfs_mount "/dev/mapper/tutti-a$i" "$ROOT/a$i"
      parts="$parts /dev/mapper/tutti-s$i 0"
    else
      mkfs_mount "$loop" "$ROOT/a$i"
    fi
    dirs="$dirs,$ROOT/a$i"
  done
  if [ $dm = 1 ]; then
    dmsetup create tutti-stripe --table "0 $((half / 1024 * 1024 * k)) striped $k 1024$parts"  # 512 KiB chunks
    mkfs_mount /dev/mapper/tutti-stripe "$ROOT/stripe"
    tool=dmsetup
  else  # no device-mapper in this kernel: one more device of the same kind (a single drive),
    # of ONE_GIB where a backend needs more room there (LMCache's GDS slab)
    echo "striped: device-mapper unavailable; ONE is a single loop device" >&2
    truncate -s "${ONE_GIB:-$gib}G" /dev/shm/tutti-d$k.img
    mkfs_mount "$(losetup --direct-io=on -f --show /dev/shm/tutti-d$k.img)" "$ROOT/stripe"
  fi
  echo "DIRS=${dirs#,}"
  echo "ONE=$ROOT/stripe"
  echo "TOOL=$tool"
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
  striped) striped "${2:?K}" "${3:-8}" ;;
  disk) mkdir -p /var/tmp/tutti-disk && echo /var/tmp/tutti-disk ;;
  teardown)
    for d in "$ROOT"/*; do
      [ -d "$d" ] || continue
      dev=$(findmnt -no SOURCE "$d" || true)
      umount "$d" 2>/dev/null || true
      case "$dev" in /dev/loop*) losetup -d "$dev" 2>/dev/null || true ;; esac
    done
    if dm_works; then
      dmsetup remove tutti-stripe 2>/dev/null || true
      for m in $(dmsetup ls 2>/dev/null | awk '/^tutti-/{print $1}'); do dmsetup remove "$m" || true; done
    fi
    for l in $(losetup -j /dev/shm/tutti-d0.img -O NAME -n 2>/dev/null; losetup -a | awk -F: '/tutti-d/{print $1}'); do
      losetup -d "$l" 2>/dev/null || true
    done
    [ -f /dev/shm/tutti-udev-records ] && xargs -r rm -f < /dev/shm/tutti-udev-records
    rm -f /dev/shm/tutti-*.img /dev/shm/tutti-udev-records; rmdir "$CG" 2>/dev/null || true ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
