"""Re-homing: the pages of a quarantined namespace written again into the live store, by key.

At a glance:
    r = Rehome(quarantines, layout, fingerprint, write, checksums)
    r.start()                 the background thread "tutti-rehome" (attach does not wait for it)
    r.wait(timeout) -> bool   True once every quarantine was processed (or stop() was called)
    r.stop()                  finish the chunk in flight, leave the rest (the next attach resumes)
    r.pages, r.dropped        pages re-written; slots skipped (no valid header, bad checksum)
    r.refused                 valid pages the store would not take after RETRIES tries

A namespace set aside by heal.resolve (a directory added or removed, another slot size in its
metadata) cannot be read in place: its placement no longer locates the pages. Its pages are
still self-describing: every slot header carries the key, the fingerprint and the checksum, and
slots sit at multiples of the slot size in every segment file whatever the old placement was.
So each quarantined segment file is read 64 slots (at most 64 MiB) at a time (plain preads,
page cache dropped after), each header is checked as a scan checks it (but trusting its own slot
number), each payload against the header's page checksum, and only pages that pass go through the
store's ordinary write path (dedupe, reserve, publication order): a re-homed page holds exactly
the bytes that were written under its key, or is not re-homed. A file is deleted once read, a
quarantine once empty, so the disk holds about one capacity plus a segment row meanwhile
(heal.reclaim deletes quarantined files from the newest end when the store must grow first).
Thread-safety: only the thread touches its state; the store's write path is thread-safe.
One process re-homes a quarantine at a time: it holds an flock on the quarantine directory, from
start() (before the attach returns, so a write growing the store meanwhile sees it being re-homed
and heal.reclaim keeps its slack) until the quarantine is processed or the thread stops.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
from typing import Callable, Optional

import numpy as np

from .. import header
from ...engine import extension
from ...layout import HEADER_NBYTES, SlotLayout

logger = logging.getLogger("tutti_hicache.store")
CHUNK = 64  # slots per read, at most
CHUNK_BYTES = 64 << 20  # and at most this many bytes (a Llama-3-8B slot is 8 MiB)
RETRIES = (0.05, 0.2, 1.0)  # seconds before each new try of the pages a write refused


class Rehome:
    def __init__(self, quarantines: list[str], layout: SlotLayout, fingerprint: bytes,
                 write: Callable, checksums: Callable):
        self._queue = list(quarantines)
        self._layout, self._fingerprint = layout, fingerprint
        self._write, self._checksums = write, checksums
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.pages = 0
        self.dropped = 0
        self.refused = 0
        self._held: dict[str, int] = {}  # quarantine -> its flock'd fd (start .. processed)

    def start(self) -> "Rehome":
        """Hold the flock of every quarantine this process will re-home, then start the thread.
        The flocks are taken here, before start returns, so that from the attach on a write that
        grows the store sees them being re-homed (heal.reclaim then keeps a row of slack instead
        of deleting their unread files). A quarantine another process holds is left to it."""
        for q in self._queue:
            fd = self._lock(q)
            if fd is not None:
                self._held[q] = fd
        self._queue = [q for q in self._queue if q in self._held]
        self._thread = threading.Thread(target=self._run, daemon=True, name="tutti-rehome")
        self._thread.start()
        return self

    @staticmethod
    def _lock(q: str) -> Optional[int]:
        try:
            fd = os.open(q, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None  # reclaimed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # another process re-homes it
        return fd

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            for q in self._queue:
                if self._stop.is_set():
                    break
                self._quarantine(q)
            if self.pages or self.dropped:
                logger.info("tutti: re-homed %d pages from set-aside namespaces (%d slots "
                            "without a valid page, %d refused by the store)", self.pages,
                            self.dropped, self.refused)
        except Exception:  # a background thread must not die silently
            logger.exception("tutti: re-homing failed; the rest is reclaimed as the store grows")
        finally:
            for fd in self._held.values():  # those not reached (stop): the next attach resumes
                os.close(fd)
            self._held.clear()
            self._done.set()

    def _quarantine(self, q: str) -> None:
        fd = self._held.pop(q)
        try:
            for name in sorted(os.listdir(q)):
                if self._stop.is_set():
                    return
                if name.startswith("seg-") and name.endswith(".dat"):
                    path = os.path.join(q, name)
                    if not self._segment(path):  # stopped part-way: the next attach resumes it
                        return
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            shutil.rmtree(q, ignore_errors=True)
        finally:
            os.close(fd)

    def _segment(self, path: str) -> bool:
        """Re-home the pages of one set-aside segment file; False when stopped before its end
        (the file must stay), True once read to its end or unreadable."""
        slot = self._layout.slot_nbytes
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return True
        buf = extension().AlignedBuffer(max(1, min(CHUNK, CHUNK_BYTES // slot)) * slot)
        arr = np.frombuffer(buf, dtype=np.uint8)
        try:
            off = 0
            while not self._stop.is_set():
                try:
                    got = os.preadv(fd, [memoryview(arr)], off)
                except OSError as e:
                    logger.warning("tutti: cannot re-home %s: %s", path, e)
                    return True
                n = got // slot
                if n == 0:
                    return True
                if not self._chunk(buf, arr, n):
                    return False  # stopped while the store refused pages: the file stays
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, off, n * slot, os.POSIX_FADV_DONTNEED)
                off += n * slot
            return False
        finally:
            os.close(fd)

    def _chunk(self, buf, arr: np.ndarray, n: int) -> bool:
        """Re-write the valid pages of n slots read into buf; False when stopped while the
        store still refused some (their file must stay for the next attach)."""
        lay, slot = self._layout, self._layout.slot_nbytes
        raw = np.ascontiguousarray(arr[:n * slot].reshape(n, slot)[:, :HEADER_NBYTES])
        own_slot = raw.reshape(-1).view(header.DTYPE)["slot"].copy()
        p = header.parse(raw, self._fingerprint, own_slot, int(lay.object_nbytes.sum()),
                         lay.geometry.units)
        idx = np.flatnonzero(p.valid)
        self.dropped += int((~p.valid & ~p.empty).sum())
        if not len(idx):
            return True
        starts = np.uint64(buf.address) + idx.astype(np.uint64) * np.uint64(slot) + \
            np.uint64(HEADER_NBYTES)
        addrs = lay.staged_objects(starts)
        sums, _ = self._checksums(addrs)
        good = sums == p.checksum[idx]
        self.dropped += int((~good).sum())
        best: dict = {}  # one slot per key: the newest copy
        for j in np.flatnonzero(good):
            k = p.keys[idx[j]]
            if k not in best or p.seq[idx[j]] > p.seq[idx[best[k]]]:
                best[k] = j
        keys = list(best)
        rows = np.array(list(best.values()), dtype=np.int64)
        # A write refuses a page when no slot can be reserved for it now (every candidate pinned
        # by reads or held by writes in flight) or its I/O failed: tried again after a pause,
        # since the file holding the only copy is deleted once read.
        for pause in (0.0,) + RETRIES:
            if not keys:
                return True
            if pause and self._stop.wait(pause):
                return False
            ok = np.asarray(self._write(keys, addrs[rows], not lay.padded), dtype=bool)
            self.pages += int(np.count_nonzero(ok))
            keys = [k for k, o in zip(keys, ok) if not o]
            rows = rows[~ok]
        if keys:
            self.refused += len(keys)
            logger.warning("tutti: re-homing lost %d pages the store refused %d times (no slot "
                           "free of reads and writes in flight, or a failed write)", len(keys),
                           len(RETRIES) + 1)
        return True
