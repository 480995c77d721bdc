"""The benchmark machine's host memory, watched while the servers run.

A benchmark that fills the machine's memory (a host pool, LMCache's pinned L1, the RAM-backed loop
devices' images in /dev/shm, page cache that cannot be dropped) can take the whole machine down
with it, and the call then comes back with nothing. Two defences, both on every process group the
harness starts (server.start_group):
  - each group's oom_score_adj is raised to the maximum, so the kernel's OOM killer takes a
    benchmark server before the harness or anything else on the machine;
  - a Guard thread reads /proc/meminfo several times a second and, when MemAvailable falls under
    the floor, kills the watched groups itself and records why: the memory figures, /dev/shm's
    share, the largest processes. The run then ends like any server death (every wait on the
    server ends), and its JSON says "host memory" instead of a lost call.
The lowest MemAvailable seen is kept per phase (take_low), so a run that came close says so.

    GUARD.start(floor_gb=None)      floor: max(2 GiB, 4% of MemTotal) unless given
    GUARD.watch(pgid) / forget(pgid)
    GUARD.take_low() -> GiB          the lowest MemAvailable since the last call (None: no sample)
    GUARD.trips                      [{"at", "reason", ...}] since the last reset()
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

GIB = 1 << 30


def meminfo(path: str = "/proc/meminfo") -> dict:
    """/proc/meminfo's fields in bytes ({} where it cannot be read)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def largest_processes(n: int = 5, proc: str = "/proc") -> list:
    """[(resident GiB, pid, command line cut to 80 characters)] of the n largest processes."""
    found = []
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(f"{proc}/{pid}/status") as f:
                rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if not cmd:  # a kernel thread or a zombie: no memory of its own to report
                continue
        except (OSError, ValueError, IndexError):
            continue
        found.append((round(rss / GIB, 2), int(pid), cmd[:80]))
    return sorted(found, reverse=True)[:n]


def raise_oom_score(pid: int) -> bool:
    """The process's oom_score_adj to 1000 (the OOM killer's first choice); False where refused.
    Children it starts later inherit it."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000\n")
        return True
    except OSError:
        return False


class Guard:
    """Kills the watched process groups when the host's available memory falls under a floor."""

    def __init__(self, meminfo_path: str = "/proc/meminfo", interval_s: float = 0.2):
        self.meminfo_path, self.interval_s = meminfo_path, interval_s
        self.floor: Optional[int] = None  # bytes; None until start()
        self.total = 0
        self.groups: set = set()
        self.trips: list = []
        self._low: Optional[int] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, floor_gb: Optional[float] = None) -> "Guard":
        info = meminfo(self.meminfo_path)
        self.total = info.get("MemTotal", 0)
        self.floor = int(floor_gb * GIB) if floor_gb is not None else max(2 * GIB, self.total // 25)
        if not self.running and "MemAvailable" in info:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="host-memory-guard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._thread = None

    def watch(self, pgid: int) -> None:
        with self._lock:
            self.groups.add(pgid)

    def forget(self, pgid: int) -> None:
        with self._lock:
            self.groups.discard(pgid)

    def reset(self) -> None:
        """A new configuration: no trips, no low point yet."""
        with self._lock:
            self.trips, self._low = [], None

    def take_low(self) -> Optional[float]:
        """The lowest MemAvailable (GiB) sampled since the last call; None without samples."""
        with self._lock:
            low, self._low = self._low, None
        return None if low is None else round(low / GIB, 2)

    def check(self) -> Optional[dict]:
        """One sample; when under the floor, the watched groups killed and the trip returned."""
        info = meminfo(self.meminfo_path)
        avail = info.get("MemAvailable")
        if avail is None:
            return None
        with self._lock:
            self._low = avail if self._low is None else min(self._low, avail)
            groups = sorted(self.groups)
        if self.floor is None or avail >= self.floor or not groups:
            return None
        # the snapshot first: the largest processes while the servers still hold their memory
        trip = {"at": time.strftime("%H:%M:%S"), "available_gb": round(avail / GIB, 2),
                "floor_gb": round(self.floor / GIB, 2), "total_gb": round(info.get("MemTotal", 0) / GIB, 2),
                "shmem_gb": round(info.get("Shmem", 0) / GIB, 2), "largest": largest_processes()}
        top = ", ".join(f"{cmd.split(' ')[0].rsplit('/', 1)[-1]} {gb:g} GiB (pid {pid})"
                        for gb, pid, cmd in trip["largest"][:3])
        trip["reason"] = (f"host memory: {trip['available_gb']:g} GiB available of {trip['total_gb']:g} "
                          f"(floor {trip['floor_gb']:g}); shared memory (tmpfs, /dev/shm) "
                          f"{trip['shmem_gb']:g} GiB; largest: {top}; the harness sent SIGKILL to "
                          f"{len(groups)} process group(s)")
        trip["killed_groups"] = []
        with self._lock:  # recorded before the kills: the harness may see a server die at once
            self.trips.append(trip)
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
                trip["killed_groups"].append(pgid)
            except OSError:
                pass
            self.forget(pgid)
        print(trip["reason"], flush=True)
        return trip

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the guard never takes the harness down
                print(f"host-memory guard: {e!r}", flush=True)


GUARD = Guard()
