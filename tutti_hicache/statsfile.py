"""The backends' observability files: `tutti_stats_file` (counters as JSON, rewritten atomically
at most once a second, the last change always written within that second) and `tutti_timeline_file` (JSON lines appended: the linker's loads,
layerwise/timeline.py, and the host tier's calls, storage.py).

At a glance:
    sf = StatsFile(path_template)       "{pid}" in the template is replaced by the process id
    sf.dump(counters, force=False)      -> bool written now (else within the interval: the
                                        latest snapshot); never raises (observability must not
                                        break storage): the first failure is logged once
    tf = TimelineFile(path_template)    the same template rule
    tf.write(record)                    appends json.dumps(record) + newline -> bool; never raises
    warn_once(failed, log, setting, path, error) -> True   that logging
Thread-safe: one lock around each file's writes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

logger = logging.getLogger("tutti_hicache.stats")


class StatsFile:
    """Counters as JSON, rewritten atomically at most once per min_interval_s. A dump inside the
    interval is not dropped: the latest such snapshot is written when the interval ends (one
    timer thread at a time), so the file always catches up with the last change, also when
    nothing changes afterwards and the process is stopped without a close."""

    def __init__(self, template: str, min_interval_s: float = 1.0):
        self.path = template.replace("{pid}", str(os.getpid())) if template else ""
        self.min_interval_s = min_interval_s
        self._last = float("-inf")
        self._failed = False
        self._lock = threading.Lock()
        self._pending = None  # the latest snapshot a dump inside the interval left for the timer
        self._timer = None
        self._timer_pid = 0

    def dump(self, counters: dict, force: bool = False) -> bool:
        if not self.path:
            return False
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last < self.min_interval_s:
                self._pending = counters
                if self._timer is None or self._timer_pid != os.getpid():  # none, or a forked
                    # parent's, whose thread this process does not have
                    timer = threading.Timer(self.min_interval_s - (now - self._last), self._catch_up)
                    timer.daemon = True
                    try:
                        timer.start()
                    except RuntimeError:  # no thread to be had: the next dump tries again
                        return False
                    self._timer, self._timer_pid = timer, os.getpid()
                return False
            self._pending = None  # this write is newer than anything the timer holds
            return self._write(counters, now)

    def _catch_up(self) -> None:
        with self._lock:
            self._timer = None
            counters, self._pending = self._pending, None
            if counters is not None:
                self._write(counters, time.monotonic())

    def _write(self, counters: dict, now: float) -> bool:
        self._last = now
        try:
            with open(self.path + ".tmp", "w") as f:
                json.dump(counters, f)
            os.replace(self.path + ".tmp", self.path)
            return True
        except (OSError, TypeError, ValueError) as e:
            self._failed = warn_once(self._failed, logger, "tutti_stats_file", self.path, e)
            return False


def warn_once(failed: bool, log: logging.Logger, setting: str, path: str, error: Exception) -> bool:
    """Log an observability file's first write failure (later ones are not repeated); returns
    True, the new `failed` flag. Such files never break storage."""
    if not failed:
        log.warning("tutti: cannot write %s %s: %s", setting, path, error)
    return True


class TimelineFile:
    def __init__(self, template: str):
        self.path = template.replace("{pid}", str(os.getpid())) if template else ""
        self._failed = False
        self._lock = threading.Lock()

    def write(self, record: dict) -> bool:
        if not self.path:
            return False
        try:
            line = json.dumps(record) + "\n"
            with self._lock, open(self.path, "a") as f:
                f.write(line)
            return True
        except (OSError, TypeError, ValueError) as e:
            self._failed = warn_once(self._failed, logger, "tutti_timeline_file", self.path, e)
            return False
