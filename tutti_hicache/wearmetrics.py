"""SSD wear in SGLang's Prometheus metrics, updated when SGLang polls TuttiStorage.get_stats (each
scheduler iteration with --enable-metrics; SGLang's StorageMetrics has no field for it).

At a glance:
    m = WearMetrics()          the process's metrics (prometheus_client, created on first use)
    m.update(snapshot, force=False) -> bool   add what store.wear() counted since the last update;
                               at most once a second (min_interval_s) unless forced; False when
                               not due or not exportable. One WearMetrics per store session

Exported (summed over the processes of a multi-process server, so per drive over its ranks):
    sglang:tutti_ssd_written_bytes_total{device, kind}   kind: payload, header, tombstone, meta
    sglang:tutti_kv_stored_bytes_total{device}           logical: KV bytes stored
    sglang:tutti_ssd_drive_writes_per_day{device}        at this session's rate (gauge, livesum)
One drive writes per day figure per drive: the bytes of every store directory on its filesystem,
labelled with the first of them (two directories on one drive share one figure, not half each).
Without prometheus_client nothing is exported (logged once). Thread-safe: one lock per instance.
"""

from __future__ import annotations

import logging
import threading
import time

from .store.wear import KINDS

logger = logging.getLogger("tutti_hicache.storage")
_shared: dict = {}  # the prometheus metrics: registered once per process
_shared_lock = threading.Lock()


def _metrics():
    """(written, stored, dwpd) prometheus metrics, or None without prometheus_client."""
    with _shared_lock:
        if "m" not in _shared:
            try:
                from prometheus_client import Counter, Gauge
            except ImportError as e:
                logger.warning("tutti: prometheus_client is missing (%s): wear not exported", e)
                _shared["m"] = None
            else:
                _shared["m"] = (
                    Counter("sglang:tutti_ssd_written_bytes", "Bytes tutti handed the drive "
                            "behind a store directory, by kind (payload, header, tombstone, meta).",
                            labelnames=["device", "kind"]),
                    Counter("sglang:tutti_kv_stored_bytes", "KV bytes tutti was asked to store "
                            "and published (logical; physical / logical = write amplification).",
                            labelnames=["device"]),
                    Gauge("sglang:tutti_ssd_drive_writes_per_day", "Drive writes per day at this "
                          "session's measured write rate.", labelnames=["device"],
                          multiprocess_mode="livesum"))
        return _shared["m"]


class WearMetrics:
    def __init__(self, min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._exported: dict = {}  # (device, column) -> bytes already added to the counters

    def update(self, snapshot: dict, force: bool = False) -> bool:
        """snapshot: one store's wear() since its attach. A store attached anew starts from 0:
        it needs a WearMetrics of its own (the counts of this one are the old store's)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.min_interval_s and not force:
                return False
            self._last = now
            m = _metrics()
            if m is None:
                return False
            written, stored, dwpd = m
            for dev in snapshot["devices"]:
                d = dev["dir"]
                for kind in KINDS:
                    self._add(written.labels(device=d, kind=kind), (d, kind), dev[f"{kind}_bytes"])
                self._add(stored.labels(device=d), (d, "logical"), dev["logical_bytes"])
            for drive in snapshot.get("drives") or [
                    {"device": dev["dir"], "drive_writes_per_day": dev["drive_writes_per_day"]}
                    for dev in snapshot["devices"]]:
                dwpd.labels(device=drive["device"]).set(drive["drive_writes_per_day"])
            return True

    def _add(self, counter, key: tuple, total: int) -> None:
        prev = self._exported.get(key, 0)
        new = total - prev if total >= prev else total  # counts only grow within one store
        self._exported[key] = total
        if new > 0:
            counter.inc(new)
