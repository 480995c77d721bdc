"""The linker's counters (loads, offloads, the kernel warm-up), beside the store's, and
`tutti_stats_file` for them.

At a glance:
    stats = LinkerStats(store, stats_file)
    stats.add(loads=1, load_pages=n, ...)   [loader, offloader] count, then rewrite the file
                                            (at most once a second)
    stats.first_load(seconds)               the first load after start (kept once)
    stats.snapshot() -> {**store.stats(), "linker": {...}}   store.stats()["wear"]: the bytes
                                            the offloads put on each drive (wear.py)
    stats.close()                           the file's last write, at close

Thread-safety: the loader and the offloader both count; one lock around the counters.
"""

from __future__ import annotations

import threading

from ..statsfile import StatsFile


class LinkerStats:
    def __init__(self, store, stats_file: str, windows=None, host=None):
        self._store = store
        self._host = host  # the DRAM tier, whose counters join the linker's
        self._windows = windows
        self._lock = threading.Lock()
        self._counts = {"loads": 0, "load_pages": 0, "load_host_pages": 0, "load_ssd_pages": 0,
                        "load_copied_pages": 0,
                        "load_bytes": 0,
                        "load_seconds": 0.0,
                        "load_failures": 0, "first_load_seconds": None, "offloads": 0,
                        "offload_pages": 0, "offload_write_failures": 0, "offload_refusals": 0,
                        "offload_seconds": 0.0, "warmup_seconds": 0.0}
        self._file = StatsFile(stats_file)

    def add(self, **add) -> None:
        with self._lock:
            for k, v in add.items():
                self._counts[k] += v
        self.dump()

    def first_load(self, seconds: float) -> None:
        with self._lock:
            if self._counts["first_load_seconds"] is None:
                self._counts["first_load_seconds"] = seconds

    def snapshot(self) -> dict:
        """The store's counters plus the linker's: loads (pages, bytes, seconds from the first read
        to the last layer handed to the GPU, failures, the first load after start), offloads."""
        with self._lock:
            mine = dict(self._counts)
        if self._windows is not None:
            mine["write_windows"] = self._windows.snapshot()
        if self._host is not None:
            mine.update(self._host.stats())
        return {**self._store.stats(), "linker": mine}

    def dump(self, force: bool = False) -> None:
        """The file, at most once a second (the counters are gathered as it is written)."""
        self._file.dump(self.snapshot, force)

    def close(self) -> None:
        """The file's last write (later counts stay in memory)."""
        self._file.close(self.snapshot)
