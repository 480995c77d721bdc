"""Header scans: what the slot headers on disk say, fed into the index; the re-scan thread.

At a glance:
    scanner = Scanner(ns, files, rows, engine, layout, fingerprint, index, lock, rescan_interval_s)
    scanner.scan_rows(rows, grant) -> entries learned   read every header of `rows` (batched
                                    engine reads, vectorized parsing), learn the valid ones
    scanner.rescan() -> entries learned                 re-scan rows other processes changed
    scanner.request()                                   ask the thread for a re-scan (rate limited)
    scanner.start(after_rescan) / scanner.stop()        the background thread "tutti-rescan"
    scanner.bad_header_slots, .bad_headers, .rescans, .max_seq   (read under the index lock)

grant: the caller has just taken these rows (open, claim): their headers are the truth and their
free slots become allocatable. Re-scans never grant: a row claimed while a re-scan reads it must
not have its free slots handed out twice; and rows this process owns are left alone, whatever a
re-scan read (its index is their truth; a header read before one of its own rewrites must not
bring an evicted key back over the slot being rewritten).

Thread-safety: the engine reads and the parsing run without any lock; learning takes the index
lock (`lock`, shared with the store) once per 16384 headers, and everything below it that the
store reads (counters, sets, max_seq) changes only under it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from . import header
from ..engine import extension
from .index import SlotIndex
from ..layout import HEADER_NBYTES, SlotLayout, strided
from .namespace import FileTable, Namespace
from .rows import Rows

logger = logging.getLogger("tutti_hicache.store")
SCAN_CHUNK = 16384  # headers per engine batch during scans (64 MiB of buffer)


class Scanner:
    def __init__(self, ns: Namespace, files: FileTable, rows: Rows, engine, layout: SlotLayout,
                 fingerprint: bytes, index: SlotIndex, lock, rescan_interval_s: float):
        self._ns, self._files, self._rows, self._engine = ns, files, rows, engine
        self._layout, self._fingerprint = layout, fingerprint
        self._index, self._lock = index, lock
        self._interval = rescan_interval_s
        self._dirty_slots: set[int] = set()  # own slots with a valid header, not yet granted
        self.bad_header_slots: set[int] = set()  # damaged (not empty) headers seen by scans
        self.bad_headers = 0  # damaged headers seen, counted at every scan
        self.rescans = 0
        self.max_seq = 0  # highest sequence number read from a valid header
        self._row_mtime: dict[int, list[int]] = {}
        self._last_rescan = 0.0
        self._wanted = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    # ----------------------------------------------------------------- scans
    def scan_rows(self, rows: list[int], grant: bool = False) -> int:
        """Read the headers of every slot in `rows` and learn them. Returns entries learned."""
        n_dirs = len(self._ns.dirs)
        pairs = [(d, r) for r in rows for d in range(n_dirs) if self._files.is_open(d, r)]
        slots = np.concatenate([self._ns.file_slots(d, r) for d, r in pairs] or
                               [np.zeros(0, np.int64)])
        learned = 0
        buf = extension().AlignedBuffer(min(len(slots), SCAN_CHUNK) * HEADER_NBYTES or HEADER_NBYTES)
        raw_all = np.frombuffer(buf, dtype=np.uint8).reshape(-1, HEADER_NBYTES)
        for start in range(0, len(slots), SCAN_CHUNK):
            chunk = slots[start:start + SCAN_CHUNK]
            learned += self._scan_chunk(chunk, buf, raw_all[:len(chunk)], grant)
        for r in rows:
            self._row_mtime[r] = self._ns.mtimes(r)
            if grant and r in self._rows.owned:
                self._grant_free(r)
        return learned

    def _scan_chunk(self, slots: np.ndarray, buf, raw: np.ndarray, taking: bool) -> int:
        """Learn the headers read at `slots` (taking: the caller is taking their rows)."""
        files, offsets = self._files.slot_files(slots)
        res = self._engine.submit("read", files, offsets,
                                  np.full(len(slots), HEADER_NBYTES, np.int64),
                                  strided(buf.address, len(slots), HEADER_NBYTES))
        raw[res != HEADER_NBYTES] = 0
        p = header.parse(raw, self._fingerprint, slots, int(self._layout.object_nbytes.sum()),
                         self._layout.geometry.units)
        learned = 0
        with self._lock:
            owned = self._owned_mask(slots)
            if not taking:
                p.valid &= ~owned
                p.empty |= owned
            damaged = ~p.valid & ~p.empty & (res == HEADER_NBYTES)
            self.bad_headers += int(damaged.sum())
            seen = slots if taking else slots[~owned]
            self.bad_header_slots.difference_update(seen.tolist())
            self.bad_header_slots.update(slots[damaged].tolist())
            index = self._index
            for i in np.flatnonzero(p.valid):
                learned += index.learn(int(slots[i]), p.keys[i], int(p.checksum[i]),
                                       int(p.seq[i]), bool(owned[i]), p.units[i])
                self.max_seq = max(self.max_seq, int(p.seq[i]))
            for i in np.flatnonzero(~p.valid & ~owned):
                index.forget_slot(int(slots[i]))
            self._dirty_slots.update(int(s) for s in slots[p.valid & owned])
        return learned

    def _owned_mask(self, slots: np.ndarray) -> np.ndarray:
        _, row, _ = self._ns.placement.locate(slots)
        owned = self._rows.owned
        return np.isin(row, np.fromiter(owned, dtype=np.int64, count=len(owned)))

    def _grant_free(self, row: int) -> None:
        slots = self._ns.row_slots(row).tolist()
        with self._lock:
            dirty = self._dirty_slots
            # not a slot whose own entry lost to another copy of its key during the scan: free
            # already (SlotIndex.learn gave it back)
            free = self._index.unaccounted(slots)
            self._index.grant([s for s in free if s not in dirty], dirty=False)
            self._index.grant([s for s in free if s in dirty], dirty=True)
            dirty.difference_update(slots)

    # --------------------------------------------------------------- rescans
    def request(self) -> None:
        if self._interval >= 0:
            self._wanted.set()

    def rescan(self) -> int:
        """Re-scan rows this process does not own whose files changed. Returns entries learned."""
        self._last_rescan = time.monotonic()
        changed = []
        recent = time.time_ns() - 2_000_000_000
        owned = self._rows.owned
        for row in range(self._ns.n_rows):
            if row in owned:
                continue
            now = self._ns.mtimes(row)
            if max(now) < 0:
                continue
            if now != self._row_mtime.get(row) or max(now) > recent:
                self._files.open_row(row, create=False)
                changed.append(row)
        with self._lock:
            self.rescans += 1
        return self.scan_rows(changed) if changed else 0

    def start(self, after_rescan: Optional[Callable[[], None]] = None) -> None:
        """Start the re-scan thread; after_rescan() runs on it after every re-scan."""
        self._thread = threading.Thread(target=self._loop, args=(after_rescan,), daemon=True,
                                        name="tutti-rescan")
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; a re-scan in flight finishes first (before the engine goes)."""
        self._closed = True
        self._wanted.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)

    def _loop(self, after_rescan) -> None:
        while True:
            self._wanted.wait()
            if self._closed:
                return
            wait = self._last_rescan + self._interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._wanted.clear()
            if self._closed:
                return
            try:
                self.rescan()
                if after_rescan is not None:
                    after_rescan()
            except Exception:  # a background thread must not die silently
                logger.exception("tutti: re-scan failed")
