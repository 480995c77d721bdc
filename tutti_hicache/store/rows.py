"""Row ownership: the segment rows a writer allocates and evicts in, shared fairly among writers.

At a glance:
    rows = Rows(namespace, files, writer)
    rows.owned                      frozenset of the rows held now: a snapshot, read without a lock
    rows.register()                 writers/<pid>.<n>.lock, flock'd while this store lives
    rows.adopt(row) -> bool         at open: hold an existing row if the fair share allows (and fit
                                    its files to the capacity)
    rows.try_lock(row) -> bool      hold a row (exclusive, non-blocking flocks on all its files)
    rows.claim_next(scan, wanted, ahead=False) -> bool
                                    grow: create + fallocate the next free row, hold it, fit it,
                                    then scan(row) (the caller's header scan, which grants its
                                    free slots); up to the fair share of the live writers
    rows.release_excess(disown, recount) -> [row]
                                    hand rows beyond the fair share back, newest first
    rows.fair_share(recount) -> int ceil(rows / live writers); the count is cached for 1 s
    rows.close()

A writer owns a row while it holds an exclusive, non-blocking flock on every file of the row;
the kernel drops the locks of a killed process, so the next writer adopts its rows. Rows held by
another process are retried at most every 5 s; a failed growth (ENOSPC, the free-space floor)
stops growth for 10 s.

Thread-safety: one lock of its own, held for every claim, release and writer count, so the
filesystem work (fallocate, flock, listdir, the header scan of a claimed row) runs here and
never under the store's index lock. Lock order: Rows' lock, then the index lock (scan, disown);
never the other way. `owned` is replaced, never mutated, so readers need no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from typing import Callable

from .repair.heal import quarantines
from .namespace import FileTable, Namespace, lock_paths, registry_entry

logger = logging.getLogger("tutti_hicache.store")
RETRY_HELD_S = 5.0  # a row another process holds is tried again after this long
RETRY_GROWTH_S = 10.0  # after a failed growth (ENOSPC, free-space floor)
SHARE_CACHE_S = 1.0  # the live-writer count is at most this old
REGISTER_TRIES = 100  # creates of this writer's registry file taken by others' counts, at most


class Rows:
    def __init__(self, ns: Namespace, files: FileTable, writer: bool):
        self._ns = ns
        self._files = files
        self.writer = writer
        self._lock = threading.Lock()
        self._fds: dict[int, list[int]] = {}  # row -> flock'd fds of its files
        self.owned: frozenset = frozenset()
        self._checked: dict[int, float] = {}  # row -> when a claim last tried it
        self._ahead_checked: dict[int, float] = {}  # the same, for the grower's claims
        self._growth_retry_at = 0.0
        self._share = 1
        self._share_at = -1e9
        self._registry: tuple = (None, None)  # (fd, path) of our writers/ lock file
        self._registry_warned = False
        self._live = 1  # the last count of live writers

    # -------------------------------------------------------------- writers
    def register(self) -> None:
        """One flock'd file per live writer (writers/<pid>.<n>.lock) so writers share rows fairly.
        Another writer's count (_live_writers) takes the lock of every file it finds and removes
        those it gets: between this one's create and flock it can take ours and unlink it, which
        would leave this writer locked on a file nobody sees. So: flock, then check that the path
        is still the file locked, else create it again."""
        d = os.path.join(self._ns.dirs[0], "writers")
        path = os.path.join(d, f"{os.getpid()}.{id(self)}.lock")
        for _ in range(REGISTER_TRIES):
            try:
                os.makedirs(d, mode=0o700, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:  # the registry only balances rows: never a reason not to start
                logger.warning("tutti: cannot register in the writer registry %s: %s (the fair "
                               "share of rows counts the writers it can see)", d, e)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, path):
                    self._registry = (fd, path)
                    return
            except OSError:  # another writer's count holds it for a moment
                pass
            os.close(fd)
            time.sleep(0.001)
        logger.warning("tutti: cannot register in the writer registry %s (its lock file kept "
                       "being taken); the fair share of rows counts the writers it can see", d)

    def _live_writers(self) -> int:
        """Writers holding their lock file now, this one always among them; stale files of dead
        processes (and entries no writer can hold: unreadable, a directory) are removed. A
        registry that cannot be listed keeps the last count."""
        d = os.path.join(self._ns.dirs[0], "writers")
        try:
            names = os.listdir(d) if os.path.isdir(d) else []
        except OSError as e:
            if not self._registry_warned:
                self._registry_warned = True
                logger.warning("tutti: cannot list the writer registry %s: %s (the fair share of "
                               "rows keeps its last count)", d, e)
            return self._live
        live = 1  # this writer, whether or not its own file is still there
        for name in names:
            path = os.path.join(d, name)
            if path == self._registry[1]:
                continue
            state, fd = registry_entry(path)
            if state == "live":
                live += 1
            elif state == "unopenable":  # no writer holds it: a leftover, removed
                with contextlib.suppress(OSError):
                    os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
            elif state == "taken":
                if _same_file(fd, path):  # a dead writer's
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                else:  # a writer registering now (it created the path anew since it was opened)
                    live += 1
                os.close(fd)
        self._live = live
        return live

    def fair_share(self, recount: bool = False) -> int:
        """Rows this writer may hold: an equal share of the capacity among live writers."""
        with self._lock:
            return self._fair_share(recount)

    def _fair_share(self, recount: bool = False) -> int:
        now = time.monotonic()
        if recount or now - self._share_at > SHARE_CACHE_S:
            fd, path = self._registry
            if fd is not None and not _same_file(fd, path):  # our file was removed: the others
                os.close(fd)  # no longer count this writer (and would take rows it needs)
                self._registry = (None, None)
                self.register()
            self._share = -(-self._ns.n_rows // self._live_writers())
            self._share_at = now
        return self._share

    # ----------------------------------------------------------------- rows
    def try_lock(self, row: int) -> bool:
        """Hold `row` (flocks on each of its files) unless another process does."""
        with self._lock:
            return self._try_lock(row)

    def _try_lock(self, row: int) -> bool:
        fds = lock_paths([self._ns.segment_path(d, row) for d in self._ns.row_dirs(row)])
        if fds is None:
            return False
        self._fds[row] = fds
        self.owned = frozenset(self._fds)
        return True

    def adopt(self, row: int) -> bool:
        """At open, for a row whose files are open: hold it if this writer is below its share,
        and size its files to the capacity. Returns True when held."""
        with self._lock:
            if not self.writer or len(self._fds) >= self._fair_share() or not self._try_lock(row):
                return False
        try:
            self._ns.fit_row(row)
        except OSError as e:
            logger.warning("tutti: cannot size segment row %d: %s", row, e)
        return True

    def claim_next(self, scan: Callable[[int], None], wanted: Callable[[], bool],
                   ahead: bool = False) -> bool:
        """Own one more row (create it if needed), up to the fair share of the live writers,
        and scan it. wanted() is asked once this object's lock is held: False (another thread
        grew the store meanwhile) returns True at once, so the caller reserves again. ahead:
        growth ahead of need (the grower thread): a row it finds held is retried by it only
        after RETRY_HELD_S, but a writer that needs a row still tries it at once; and it never
        grows while the namespace has quarantined (set-aside) files, since making room would
        delete them (heal.reclaim) before the re-homing thread has read their pages back."""
        checked = self._ahead_checked if ahead else self._checked
        with self._lock:
            if not wanted():
                return True
            if ahead and quarantines([os.path.dirname(d) for d in self._ns.dirs],
                                     os.path.basename(self._ns.dirs[0])):
                return False
            now = time.monotonic()
            if not self.writer or now < self._growth_retry_at:
                return False
            if self._fds and len(self._fds) >= self._fair_share():
                return False
            for row in range(self._ns.n_rows):
                last = max(checked.get(row, -1e9), self._checked.get(row, -1e9))
                if row in self._fds or now - last < RETRY_HELD_S:
                    continue
                checked[row] = now
                if self._claim(row):
                    scan(row)
                    return True
                if now < self._growth_retry_at:
                    return False
            return False

    def _claim(self, row: int) -> bool:
        try:
            if not self._files.open_row(row, create=True) or not self._try_lock(row):
                return False
            try:
                self._ns.fit_row(row)
            except OSError:  # held but not sized: given back (never scanned, its slots unusable,
                self._unlock(row)  # and no other process could take it)
                raise
        except OSError as e:
            logger.warning("tutti: cannot grow the store with row %d: %s (retry in 10 s)", row, e)
            self._growth_retry_at = time.monotonic() + RETRY_GROWTH_S
            return False
        return True

    def _unlock(self, row: int) -> None:
        for fd in self._fds.pop(row, ()):
            os.close(fd)
        self.owned = frozenset(self._fds)

    def release_excess(self, disown: Callable[[int], bool], recount: bool = False) -> list[int]:
        """Hand rows beyond the fair share back (newest first) when more writers have come.
        disown(row) makes the index give the row's slots up (False when one is pinned or being
        written: the row is kept). Returns the rows released."""
        released = []
        with self._lock:
            share = self._fair_share(recount)
            for row in sorted(self._fds, reverse=True):
                if len(self._fds) <= share:
                    break
                if disown(row):
                    fds = self._fds.pop(row)
                    self.owned = frozenset(self._fds)
                    for fd in fds:
                        os.close(fd)
                    self._checked[row] = time.monotonic()
                    released.append(row)
        return released

    def close(self) -> None:
        """Release every row and leave the writer registry."""
        with self._lock:
            for fds in self._fds.values():
                for fd in fds:
                    os.close(fd)
            self._fds.clear()
            self.owned = frozenset()
            fd, path = self._registry
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                os.close(fd)
                self._registry = (None, None)


def _same_file(fd: int, path: str) -> bool:
    """Whether path still names the file open as fd."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
