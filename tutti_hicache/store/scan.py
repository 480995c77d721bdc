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
free slots become allocatable. An entry learned earlier from the row's previous writer whose
header is gone (cleared, evicted, reused) is forgotten and its slot becomes free: rows this
process owns are never re-scanned, so it would otherwise stay, a page reported present over an
empty slot that no free list holds. The own entries learned enter the LRU by their headers'
sequence numbers, oldest first (order_lru), not in slot order. Re-scans never grant: a row claimed
while a re-scan reads it must not have its free slots handed out twice; and rows this process
owns are left alone, whatever a re-scan read (its index is their truth; a header read before one
of its own rewrites must not bring an evicted key back over the slot being rewritten).

Cut segment files: the scan of an attach counts (in bad_headers) and names in one warning per
file the slots whose headers a segment file no longer holds: a read that came back short or
failed, or a slot beyond the file's end as found when the store was built (a writer's attach
extends an adopted row's files to their size before it scans them, so the scan itself reads
zeros there). Only in files that still hold a page: a file without one may be a segment another
writer is creating right now (size 0 until its fallocate returns), and a page never written is no
page lost. Re-scans take short reads for empty slots, silently, for the same reason.

Thread-safety: the engine reads and the parsing run without any lock; learning takes the index
lock (`lock`, shared with the store) once per 16384 headers, and everything below it that the
store reads (counters, sets, max_seq) changes only under it.
"""

from __future__ import annotations

import logging
import os
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
        self._found_nbytes = self._file_sizes()  # [dir, row]: segment sizes before attach fits them

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
        own: tuple[list, list] = ([], [])  # own entries learned: keys, sequence numbers
        cut = np.zeros((n_dirs, self._ns.n_rows), dtype=np.int64)  # per file: slots cut off
        held = np.zeros((n_dirs, self._ns.n_rows), dtype=bool)  # per file: a valid header read
        for start in range(0, len(slots), SCAN_CHUNK):
            chunk = slots[start:start + SCAN_CHUNK]
            learned += self._scan_chunk(chunk, buf, raw_all[:len(chunk)], grant, own, cut, held)
        if grant:
            self._report_cut(rows, cut, held)
        if own[0]:  # into the LRU oldest first: one argsort, the moves in C
            order = np.argsort(np.array(own[1], dtype=np.uint64), kind="stable")
            with self._lock:
                self._index.order_lru(np.array(own[0], dtype=object)[order])
        for r in rows:
            self._row_mtime[r] = self._ns.mtimes(r)
            if grant and r in self._rows.owned:
                self._grant_free(r)
        return learned

    def _scan_chunk(self, slots: np.ndarray, buf, raw: np.ndarray, taking: bool,
                    own: tuple, cut: np.ndarray, held: np.ndarray) -> int:
        """Learn the headers read at `slots` (taking: the caller is taking their rows). Appends
        the own entries learned to own (keys, seqs); with taking, counts per file in cut the
        slots whose header the file did not hold and marks in held the files with a page."""
        files, offsets = self._files.slot_files(slots)
        res = self._engine.submit("read", files, offsets,
                                  np.full(len(slots), HEADER_NBYTES, np.int64),
                                  strided(buf.address, len(slots), HEADER_NBYTES))
        unread = res != HEADER_NBYTES
        if taking:  # also beyond the file's end as found before attach extended it
            d, row, off = self._ns.placement.locate(slots)
            found = self._found_nbytes[d, row]
            unread |= (found >= 0) & (off + HEADER_NBYTES > found)
        raw[unread] = 0
        p = header.parse(raw, self._fingerprint, slots, int(self._layout.object_nbytes.sum()),
                         self._layout.geometry.units)
        if taking:
            np.add.at(cut, (d[unread], row[unread]), 1)
            held[d[p.valid], row[p.valid]] = True
        learned = 0
        with self._lock:
            owned = self._owned_mask(slots)
            if not taking:
                p.valid &= ~owned
                p.empty |= owned
            damaged = ~p.valid & ~p.empty & ~unread
            self.bad_headers += int(damaged.sum())
            seen = slots if taking else slots[~owned]
            self.bad_header_slots.difference_update(seen.tolist())
            self.bad_header_slots.update(slots[damaged].tolist())
            index = self._index
            for i in np.flatnonzero(p.valid):
                kept = index.learn(int(slots[i]), p.keys[i], int(p.checksum[i]),
                                   int(p.seq[i]), bool(owned[i]), p.units[i])
                learned += kept
                if kept and owned[i]:
                    own[0].append(p.keys[i])
                    own[1].append(int(p.seq[i]))
                self.max_seq = max(self.max_seq, int(p.seq[i]))
            # no page at these slots any more: a row not ours changed; or a row being taken
            # holds no longer what its previous writer had there when we learned it
            for i in np.flatnonzero(~p.valid & (~owned | taking)):
                index.forget_slot(int(slots[i]), foreign_only=bool(owned[i]))
            self._dirty_slots.update(int(s) for s in slots[p.valid & owned])
        return learned

    def _file_sizes(self) -> np.ndarray:
        """st_size of each segment file [dir, row] as found now (-1: none). Taken when the store
        is built, before its attach sizes the rows it adopts (namespace.fit_row)."""
        sizes = np.full((len(self._ns.dirs), self._ns.n_rows), -1, dtype=np.int64)
        for r in (r for r in self._ns.existing_rows() if r < self._ns.n_rows):
            for d in range(len(self._ns.dirs)):
                try:
                    sizes[d, r] = os.stat(self._ns.segment_path(d, r)).st_size
                except OSError:
                    pass
        return sizes

    def _report_cut(self, rows: list[int], cut: np.ndarray, held: np.ndarray) -> None:
        """Count and name (one warning per file) the slots of taken rows' files that held a page
        but whose headers could not be read in full; the sizes found before attach are spent."""
        lost = (cut > 0) & held
        with self._lock:
            self.bad_headers += int(cut[lost].sum())
        for d, r in zip(*np.nonzero(lost)):
            d, r = int(d), int(r)
            n_slots, found = len(self._ns.file_slots(d, r)), int(self._found_nbytes[d, r])
            why = (f"it held {found} bytes at attach: cut short, or sized for a smaller "
                   f"tutti_capacity_gb" if 0 <= found < n_slots * self._layout.slot_nbytes
                   else "the reads failed or came back short")
            logger.warning("tutti: segment file %s: the headers of %d of its %d slots could not "
                           "be read (%s): the pages there, if it had any, are lost",
                           self._ns.segment_path(d, r), int(cut[d, r]), n_slots, why)
        self._found_nbytes[:, rows] = -1

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
