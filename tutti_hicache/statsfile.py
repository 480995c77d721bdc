"""The backends' observability files: `tutti_stats_file` (counters as JSON, rewritten atomically
at most once a second, the last change written when that second ends) and `tutti_timeline_file`
(JSON lines appended: the linker's loads, layerwise/timeline.py, and the host tier's calls,
storage.py).

At a glance:
    sf = StatsFile(path_template)       "{pid}" in the template is replaced by the process id
    sf.dump(source, force=False)        -> bool written now (else when the interval ends: the
                                        latest source); source: the counters, or a function
                                        returning them, called when the file is written
    sf.close(source)                    the last write; later dumps write nothing
    tf = TimelineFile(path_template)    the same template rule
    tf.write(record)                    appends json.dumps(record) + newline -> bool
    warn_once(failed, log, setting, path, error) -> True   the first failure is logged, once
Neither ever raises (observability must not break storage). Thread-safe: one lock per file.
A forked child starts afresh (its own pid in the path, its own lock: a parent's thread that held
the lock at the fork never releases it in the child, and the parent's pending snapshot is not the
child's); at a normal interpreter exit a snapshot still waiting for its interval is written.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref

logger = logging.getLogger("tutti_hicache.stats")
_FILES: "weakref.WeakSet" = weakref.WeakSet()  # this process's files: reset after a fork, flushed at exit


class StatsFile:
    """Counters as JSON, rewritten atomically at most once per min_interval_s. A dump inside the
    interval is not dropped: the latest source is written when the interval ends (one timer thread
    at a time), so the file catches up with the last change also when nothing changes afterwards.
    A source that is a function is called under the file's lock as the file is written, so the
    writes follow the order of their snapshots: a late dump never puts older counters over newer
    ones. What the file cannot keep: the changes of the last interval of a process killed outright
    (SIGKILL, or a signal with no handler), where no thread and no exit hook runs."""

    def __init__(self, template: str, min_interval_s: float = 1.0):
        self.template = template
        self.min_interval_s = min_interval_s
        self._failed = False
        self._start()
        _FILES.add(self)

    def _start(self) -> None:
        """The state of a new file; also a forked child's (see the module docstring)."""
        self.path = self.template.replace("{pid}", str(os.getpid())) if self.template else ""
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._pending = None  # the latest source a dump inside the interval left for the timer
        self._timer = None
        self._closed = False

    def dump(self, source, force: bool = False) -> bool:
        if not self.path:
            return False
        with self._lock:
            if self._closed:
                return False
            now = time.monotonic()
            if not force and now - self._last < self.min_interval_s:
                self._pending = source
                if self._timer is None:
                    timer = threading.Timer(self.min_interval_s - (now - self._last), self._catch_up)
                    timer.daemon = True
                    try:
                        timer.start()
                    except RuntimeError:  # no thread to be had: the next dump tries again
                        return False
                    self._timer = timer
                return False
            self._pending = None  # this write is newer than anything the timer holds
            return self._write(source, now)

    def close(self, source) -> bool:
        """The last write; a pending catch-up and any later dump write nothing."""
        if not self.path:
            return False
        with self._lock:
            if self._closed:
                return False
            self._closed, self._pending = True, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return self._write(source, time.monotonic())

    def _catch_up(self) -> None:
        with self._lock:
            self._timer = None
            self._write_pending()

    def _flush_at_exit(self) -> None:
        if self._lock.acquire(timeout=1.0):  # a writer stuck past a second: leave it
            try:
                self._write_pending()
            finally:
                self._lock.release()

    def _write_pending(self) -> None:
        """The snapshot a dump inside the interval left, if any (the lock held)."""
        source, self._pending = self._pending, None
        if source is not None and not self._closed and self.path:
            self._write(source, time.monotonic())

    def _write(self, source, now: float) -> bool:
        self._last = now
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            counters = source() if callable(source) else source
            with open(tmp, "w") as f:
                json.dump(counters, f)
            os.replace(tmp, self.path)
            return True
        except Exception as e:  # noqa: BLE001 - a closed store's counters, a bad value, the disk
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
        self.template = template
        self._failed = False
        self._start()
        _FILES.add(self)

    def _start(self) -> None:
        self.path = self.template.replace("{pid}", str(os.getpid())) if self.template else ""
        self._lock = threading.Lock()

    def _flush_at_exit(self) -> None:
        pass  # every line is written as it comes

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


def _after_fork_in_child() -> None:
    for f in list(_FILES):
        f._start()


def _at_exit() -> None:
    for f in list(_FILES):
        f._flush_at_exit()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
