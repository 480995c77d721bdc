"""Bytes in flight from the devices under the store directories, not a constant.

At a glance:
    device_queue(path, sysfs="/sys") -> DeviceQueue | None   the block queue behind a directory
    derive(dirs, sysfs="/sys", cores=None) -> Depth           bytes in flight per direction
    Depth.read_bytes, .write_bytes, .devices, .cores, .reason

Why: a batch of 128 Llama-3-8B pages is 1 GiB; with `tutti_queue_depth` 1024 all of it is in
flight at once. What a device queue cannot hold waits in io_uring's worker threads, which on a
host with few cores compete with the checksums and (on RAM-backed media) the copies themselves:
measured 75-82% of the raw medium at depth 1024 against 87-104% at 32-64 on a 2-core host. More
than the queue holds never makes a device faster, so the engine caps each ring's bytes in flight
(EngineOptions::read_inflight_bytes / write_inflight_bytes) at what the queues hold.

The derivation, per distinct device under the directories (two directories on one device count
once):
  queue bytes = nr_requests x largest request, the largest request being
                max_sectors_kb KiB, and at most max_segments pages of 4 KiB (user memory is not
                physically contiguous, so a request holds one page per segment);
  a device-mapper device (linear, striped) holds what its slaves' queues hold, summed;
  a partition is its disk's queue; a loop device has a queue of its own;
  no block device (tmpfs, a network or FUSE filesystem: st_dev major 0) -> no queue bounds it: the
  copies run on the CPU, so only the core bound below applies (measured on tmpfs here: 64 MiB in
  flight restored at 0.60-0.73 GB/s, 256 MiB at 1.0-1.2).
The sum over devices is then capped at cores x CORE_BYTES (os.sched_getaffinity: the cores this
process may use), and floored at MIN_BYTES. Reads and writes get the same bytes: they share the
device queue, and the scheduler never runs both on one device at once. An explicit
`tutti_queue_depth` (> 0) turns the derivation off (the ring depth alone bounds what is in
flight, as before).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

PAGE = 4096
CORE_BYTES = 128 << 20  # bytes in flight one core keeps busy (2-core host: best at 256 MiB)
MIN_BYTES = 16 << 20  # at least two 8 MiB pages


@dataclass(frozen=True)
class DeviceQueue:
    name: str  # sysfs name: vda, nvme0n1, loop3, dm-1 (its slaves summed)
    nr_requests: int
    request_bytes: int  # the largest request the queue takes

    @property
    def bytes(self) -> int:
        return self.nr_requests * self.request_bytes


@dataclass(frozen=True)
class Depth:
    read_bytes: int
    write_bytes: int
    cores: int
    devices: tuple = ()  # DeviceQueue per distinct device, None for a directory without one
    reason: str = ""
    detail: dict = field(default_factory=dict)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _block_dir(path: str, sysfs: str) -> Optional[str]:
    """The sysfs directory of the disk (not partition) holding `path`, or None (no block device)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # a store directory not made yet: the one it will be in
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:  # anonymous device: tmpfs, overlay, btrfs subvolume, NFS, FUSE
        return None
    link = os.path.join(sysfs, "dev", "block", f"{major}:{minor}")
    if not os.path.exists(link):
        return None
    d = os.path.realpath(link)
    if os.path.exists(os.path.join(d, "partition")):  # a partition: its disk has the queue
        d = os.path.dirname(d)
    return d


def _queue_of(d: str, sysfs: str, depth: int = 0) -> Optional[DeviceQueue]:
    name = os.path.basename(d)
    slaves = os.path.join(d, "slaves")
    if os.path.isdir(os.path.join(d, "dm")) and os.path.isdir(slaves) and depth < 8:
        parts = [_queue_of(os.path.realpath(os.path.join(slaves, s)), sysfs, depth + 1)
                 for s in sorted(os.listdir(slaves))]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        total = sum(p.bytes for p in parts)
        req = max(p.request_bytes for p in parts)
        return DeviceQueue(name, max(1, total // req), req)
    q = os.path.join(d, "queue")
    nr = _read_int(os.path.join(q, "nr_requests"))
    kb = _read_int(os.path.join(q, "max_sectors_kb"))
    if not nr or not kb:
        return None
    req = kb << 10
    segs = _read_int(os.path.join(q, "max_segments"))
    if segs:
        req = min(req, segs * PAGE)
    return DeviceQueue(name, nr, req)


def device_queue(path: str, sysfs: str = "/sys") -> Optional[DeviceQueue]:
    """The block queue behind directory `path` (None: no block device, or sysfs unreadable)."""
    d = _block_dir(path, sysfs)
    return _queue_of(d, sysfs) if d else None


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def derive(dirs, sysfs: str = "/sys", cores: Optional[int] = None) -> Depth:
    """Bytes in flight per ring for a store over `dirs` (module docstring)."""
    cores = cores or available_cores()
    seen: dict = {}
    queueless = 0
    for p in dirs:
        d = _block_dir(p, sysfs)
        q = _queue_of(d, sysfs) if d else None
        if q is None:
            queueless += 1
        else:
            seen.setdefault(d, q)
    queues = sum(q.bytes for q in seen.values())
    core_cap = cores * CORE_BYTES
    total = queues + queueless * core_cap  # no queue: the cores alone bound it
    capped = max(MIN_BYTES, min(total, core_cap))
    why = (f"{len(seen)} device queue(s) {queues >> 20} MiB"
           + (f", {queueless} dir(s) without one (cores only)" if queueless else "")
           + f"; {cores} core(s) x {CORE_BYTES >> 20} MiB")
    return Depth(capped, capped, cores, tuple(seen.values()) + (None,) * queueless, why,
                 {"queue_bytes": queues, "queueless_dirs": queueless, "uncapped_bytes": total})
