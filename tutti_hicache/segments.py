"""Segment files of a store: namespaces, row ownership (flock), growth, header scans.

At a glance (a mixin of ObjectStore; every method runs with the store's attributes):
    _make_namespaces()      <dir>/tutti-<fingerprint>/ (0700) with identity.json (0600)
    _rebuild()              open existing rows, lock what we can, scan headers -> index
    _claim_next_row()       grow: create + fallocate the next free row, lock it, scan it
    _request_rescan()       ask the background thread to re-scan rows other processes changed

A row is segment number r in every directory; a writer owns a row while it holds an
exclusive, non-blocking flock on all of the row's files. Files are sized so that the sum
over all files never exceeds the slots that fit in tutti_capacity_gb.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time

import numpy as np

from . import header
from .engine import extension
from .layout import HEADER_NBYTES, strided

logger = logging.getLogger("tutti_hicache.store")
_SCAN_CHUNK = 16384  # headers per engine batch during scans (64 MiB of buffer)


class SegmentFiles:
    # ---------------------------------------------------------------- layout
    def _seg_path(self, d: int, row: int) -> str:
        return os.path.join(self.ns_dirs[d], f"seg-{row:06d}.dat")

    def _file_slots(self, d: int, row: int) -> np.ndarray:
        """Slots of segment (d, row) that fit in the capacity, in file order."""
        s = self.placement.segment_slots(d, row)
        return s[s < self.capacity_slots]

    def _make_namespaces(self) -> None:
        """Create namespace dirs with identity.json and placement.json; refuse a changed placement."""
        if self.maintenance:
            return
        placement = {"n_dirs": len(self.ns_dirs), "slot_nbytes": self.layout.slot_nbytes,
                     "slots_per_segment": self.placement.slots_per_segment, "dir_index": 0}
        for d, ns in enumerate(self.ns_dirs):
            os.makedirs(ns, mode=0o700, exist_ok=True)
            _write_once(os.path.join(ns, "identity.json"), self.identity)
            want = dict(placement, dir_index=d)
            have = _write_once(os.path.join(ns, "placement.json"), want)
            if have != want:
                raise ValueError(
                    f"tutti_dirs/tutti_segment_gb: the store in {ns} was written with "
                    f"{have}, now {want}; restore the previous tutti_dirs order and "
                    f"tutti_segment_gb, or remove {ns} to start empty")

    # ------------------------------------------------------------------ rows
    def _existing_rows(self) -> list[int]:
        rows = set()
        for ns in self.ns_dirs:
            for name in os.listdir(ns):
                if name.startswith("seg-") and name.endswith(".dat") and name[4:-4].isdigit():
                    rows.add(int(name[4:-4]))
        return sorted(rows)

    def _open_row_files(self, row: int, create: bool) -> bool:
        """Open the row's files that exist (with create: make and fallocate missing ones).

        Returns True when every file of the row is open."""
        complete = True
        for d in self._row_dirs(row):
            if self._file_table[d, row] >= 0:
                continue
            path = self._seg_path(d, row)
            if create and not os.path.exists(path):
                self._create_segment(path, len(self._file_slots(d, row)))
            if not os.path.exists(path):
                complete = False
                continue
            f = self.engine.open_file(path, self.writer, True)
            self._file_table[d, row] = f
            self._engine_paths[f] = path
        return complete

    def _create_segment(self, path: str, n_slots: int) -> None:
        nbytes = n_slots * self.layout.slot_nbytes
        st = os.statvfs(os.path.dirname(path))
        floor = int(self.cfg.free_space_floor_gb * (1 << 30))
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"only {free >> 20} MiB free for a {nbytes >> 20} MiB segment", path)
        if free - nbytes < floor:
            raise OSError(errno.ENOSPC, "free space would fall below tutti_free_space_floor_gb", path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)

    def _row_dirs(self, row: int) -> list[int]:
        """Directories holding at least one slot of `row` (the capacity can end mid-row)."""
        return [d for d in range(len(self.ns_dirs)) if len(self._file_slots(d, row))]

    def _try_lock_row(self, row: int) -> bool:
        fds = _lock_paths([self._seg_path(d, row) for d in self._row_dirs(row)])
        if fds is None:
            return False
        self._lock_fds[row] = fds
        return True

    def _fit_row(self, row: int) -> None:
        """Size an owned row's files to exactly the slots that fit in the capacity."""
        if self.maintenance:
            return
        for d in self._row_dirs(row):
            path = self._seg_path(d, row)
            want = len(self._file_slots(d, row)) * self.layout.slot_nbytes
            have = os.path.getsize(path)
            if have > want:
                os.truncate(path, want)
            elif have < want:
                fd = os.open(path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, want)
                finally:
                    os.close(fd)

    def _claim_row(self, row: int) -> bool:
        try:
            if not self._open_row_files(row, create=True) or not self._try_lock_row(row):
                return False
            self._fit_row(row)
        except OSError as e:
            logger.warning("tutti: cannot grow the store with row %d: %s (retry in 10 s)", row, e)
            self._growth_retry_at = time.monotonic() + 10.0
            return False
        self._scan_rows([row], grant=True)
        return True

    # ---------------------------------------------------------------- writers
    def _register_writer(self) -> None:
        """One flock'd file per live writer (writers/<pid>.<n>.lock) so writers share rows fairly."""
        d = os.path.join(self.ns_dirs[0], "writers")
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{os.getpid()}.{id(self)}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._writer_lock = (fd, path)

    def _live_writers(self) -> int:
        """Writers holding their lock file now (stale files of dead processes are removed)."""
        d = os.path.join(self.ns_dirs[0], "writers")
        mine = getattr(self, "_writer_lock", (None, None))[1]
        live = 0
        for name in os.listdir(d) if os.path.isdir(d) else ():
            path = os.path.join(d, name)
            if path == mine:
                live += 1
                continue
            fds = _lock_paths([path])
            if fds is None:
                live += 1
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                os.close(fds[0])
        return max(1, live)

    def _fair_share(self) -> int:
        """Rows this writer may hold: an equal share of the capacity among live writers."""
        now = time.monotonic()
        if now - getattr(self, "_share_at", -1e9) > 1.0:
            self._share = -(-self.n_rows // self._live_writers())
            self._share_at = now
        return self._share

    def _release_excess_rows(self) -> None:
        """Hand rows beyond the fair share back (newest first) when more writers have come."""
        share = self._fair_share()
        with self._lock:
            for row in sorted(self._lock_fds, reverse=True):
                if len(self._lock_fds) <= share:
                    return
                slots = np.concatenate([self._file_slots(d, row) for d in range(len(self.ns_dirs))])
                if self.index.disown(slots.tolist()):
                    for fd in self._lock_fds.pop(row):
                        os.close(fd)
                    self._claim_checked[row] = time.monotonic()
                    logger.info("tutti: handed segment row %d to the other writers", row)

    def _claim_next_row(self) -> bool:
        """Own one more row (create it if needed), up to the fair share of the live writers.
        Called with the store lock held. Rows another process holds are retried every 5 s."""
        now = time.monotonic()
        if not self.writer or self.maintenance or now < getattr(self, "_growth_retry_at", 0.0):
            return False
        if self._lock_fds and len(self._lock_fds) >= self._fair_share():
            return False
        for row in range(self.n_rows):
            if row in self._lock_fds or now - self._claim_checked.get(row, -1e9) < 5.0:
                continue
            self._claim_checked[row] = now
            if self._claim_row(row):
                return True
            if now < getattr(self, "_growth_retry_at", 0.0):
                return False
        return False

    # ----------------------------------------------------------------- scans
    def _rebuild(self) -> None:
        self._engine_paths = {}
        rows = self._existing_rows()
        self._shrink([r for r in rows if r >= self.n_rows])
        rows = [r for r in rows if r < self.n_rows]
        if self.writer and not self.maintenance:
            self._register_writer()
        for r in rows:
            full = self.writer and not self.maintenance and len(self._lock_fds) >= self._fair_share()
            if self._open_row_files(r, create=False) and self.writer and not full \
                    and self._try_lock_row(r):
                try:
                    self._fit_row(r)
                except OSError as e:
                    logger.warning("tutti: cannot size segment row %d: %s", r, e)
        self._scan_rows(rows, grant=True)
        self._rescan_thread = threading.Thread(target=self._rescan_loop, daemon=True,
                                               name="tutti-rescan")
        self._rescan_thread.start()

    def _shrink(self, rows: list[int]) -> None:
        """Remove rows beyond the capacity (it shrank since they were written), if unused."""
        if self.maintenance:
            return
        for r in rows:
            paths = [p for p in (self._seg_path(d, r) for d in range(len(self.ns_dirs)))
                     if os.path.exists(p)]
            fds = _lock_paths(paths) if self.writer else None
            if fds is None:
                logger.warning("tutti: segment row %d lies beyond tutti_capacity_gb and is in "
                               "use by another process (or this one is read-only): ignored", r)
                continue
            for p in paths:
                os.unlink(p)
            for fd in fds:
                os.close(fd)
            logger.warning("tutti: capacity shrank: removed segment row %d", r)

    def _scan_rows(self, rows: list[int], grant: bool = False) -> int:
        """Read the headers of every slot in `rows` and learn them. Returns entries learned.

        grant: the caller just took these rows (open, claim): their free slots become
        allocatable. Re-scans never grant: a row claimed while a re-scan reads it must not have
        its free slots handed out twice."""
        pairs = [(d, r) for r in rows for d in range(len(self.ns_dirs))
                 if self._file_table[d, r] >= 0]
        slots = np.concatenate([self._file_slots(d, r) for d, r in pairs] or [np.zeros(0, np.int64)])
        learned = 0
        buf = extension().AlignedBuffer(min(len(slots), _SCAN_CHUNK) * HEADER_NBYTES or HEADER_NBYTES)
        raw_all = np.frombuffer(buf, dtype=np.uint8).reshape(-1, HEADER_NBYTES)
        for start in range(0, len(slots), _SCAN_CHUNK):
            chunk = slots[start:start + _SCAN_CHUNK]
            learned += self._scan_chunk(chunk, buf, raw_all[:len(chunk)], grant)
        for r in rows:
            self._note_mtime(r)
            if grant and r in self._lock_fds:
                self._grant_free(r)
        return learned

    def _scan_chunk(self, slots: np.ndarray, buf, raw: np.ndarray, taking: bool) -> int:
        """Learn the headers read at `slots`. taking: the caller is taking these rows (open,
        claim) and their headers are the truth. Otherwise (a re-scan) rows this process owns are
        left alone, whatever was read: its index is their truth, and a header read before one of
        its own rewrites must not bring an evicted key back over the slot being rewritten."""
        files, offsets = self._slot_files(slots)
        res = self.engine.submit("read", files, offsets, np.full(len(slots), HEADER_NBYTES, np.int64),
                                 strided(buf.address, len(slots), HEADER_NBYTES))
        raw[res != HEADER_NBYTES] = 0
        p = header.parse(raw, self.fingerprint, slots, int(self.layout.object_nbytes.sum()),
                         self.layout.geometry.units)
        learned = 0
        with self._lock:
            owned = self._owned_mask(slots)
            if not taking:
                p.valid &= ~owned
                p.empty |= owned
            damaged = ~p.valid & ~p.empty & (res == HEADER_NBYTES)
            extra = self._stats.extra
            extra["bad_headers"] = extra.get("bad_headers", 0) + int(damaged.sum())
            seen = slots if taking else slots[~owned]
            self._bad_header_slots.difference_update(seen.tolist())
            self._bad_header_slots.update(slots[damaged].tolist())
            for i in np.flatnonzero(p.valid):
                learned += self.index.learn(int(slots[i]), p.keys[i], int(p.checksum[i]),
                                            int(p.seq[i]), bool(owned[i]), p.units[i])
                self._seq = max(self._seq, int(p.seq[i]))
            for i in np.flatnonzero(~p.valid & ~owned):
                self.index.forget_slot(int(slots[i]))
            self._dirty_slots.update(int(s) for s in slots[p.valid & owned])
        return learned

    def _owned_mask(self, slots: np.ndarray) -> np.ndarray:
        _, row, _ = self.placement.locate(slots)
        return np.isin(row, np.fromiter(self._lock_fds, dtype=np.int64, count=len(self._lock_fds)))

    def _grant_free(self, row: int) -> None:
        with self._lock:
            slots = np.sort(np.concatenate([self._file_slots(d, row)
                                            for d in range(len(self.ns_dirs))]))
            used = self.index.by_slot
            free = [int(s) for s in slots if int(s) not in used]
            self.index.grant([s for s in free if s not in self._dirty_slots], dirty=False)
            self.index.grant([s for s in free if s in self._dirty_slots], dirty=True)
            self._dirty_slots.difference_update(slots.tolist())

    # ---------------------------------------------------------------- rescans
    def _note_mtime(self, row: int) -> None:
        self._row_mtime[row] = [self._mtime(d, row) for d in range(len(self.ns_dirs))]

    def _mtime(self, d: int, row: int) -> int:
        try:
            return os.stat(self._seg_path(d, row)).st_mtime_ns
        except FileNotFoundError:
            return -1

    def _request_rescan(self) -> None:
        if self.cfg.rescan_interval_s >= 0:
            self._rescan_wanted.set()

    def rescan(self) -> int:
        """Re-scan rows this process does not own whose files changed. Returns entries learned."""
        self._last_rescan = time.monotonic()
        changed = []
        recent = time.time_ns() - 2_000_000_000
        for row in range(self.n_rows):
            if row in self._lock_fds:
                continue
            now = [self._mtime(d, row) for d in range(len(self.ns_dirs))]
            if max(now) < 0:
                continue
            if now != self._row_mtime.get(row) or max(now) > recent:
                self._open_row_files(row, create=False)
                changed.append(row)
        with self._lock:
            self._stats.rescans += 1
        return self._scan_rows(changed) if changed else 0

    def _rescan_loop(self) -> None:
        while True:
            self._rescan_wanted.wait()
            if self._closed:
                return
            wait = self._last_rescan + self.cfg.rescan_interval_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._rescan_wanted.clear()
            if self._closed:
                return
            try:
                self.rescan()
                if self.writer and not self.maintenance:
                    self._release_excess_rows()
            except Exception:  # a background thread must not die silently
                logger.exception("tutti: re-scan failed")


def _lock_paths(paths: list[str]):
    """Exclusive non-blocking flocks on every path, or None (nothing held) if any fails."""
    fds = []
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _write_once(path: str, obj: dict) -> dict:
    """Write obj as JSON (0600) unless the file exists; return what the file holds."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, sort_keys=True, indent=1)
        os.replace(tmp, path)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"tutti_dirs: {path} is damaged ({e}); remove its namespace directory "
                         "to start it empty") from None
