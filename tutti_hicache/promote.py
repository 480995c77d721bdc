"""Promotion of remote (cluster tier) hits into the local SSD tier, off the read path.

At a glance (TieredStorage uses it; threads in brackets):
    p = Promoter(store, budget_bytes, object_nbytes, threads)
    p.submit(keys, addrs) -> queued     [io-aux] copy the pages' objects (C++ memcpy_batch) out
                                        of SGLang's host pool into the promotion ring and queue
                                        their write; per page: queued (the caller writes the
                                        others itself: the ring was full)
    [tutti-promote] store.write_pages from the ring, oldest first; on_done(written, failed)
    p.drain(); p.close()                every queued write finished (close: then the thread ends)
    p.pending -> int, p.ring_bytes      pages queued, the ring's size

Why a copy: once batch_get_v1 returns, the host pool's pages are SGLang's to evict and reuse, so
a write that ran later from their addresses could store another page's bytes under this key.
The copy (about 10 GB/s per thread) is a fraction of the write it takes off the read path. The
ring is one page-aligned buffer of `budget_bytes`, allocated at the first promotion and reused
(first-touch page faults once); jobs take contiguous regions and, written in order by one
thread, give them back in order. Pages that do not fit are not taken (TieredStorage writes those inside the call, as without the ring). Keys already queued are
not taken twice.
Thread-safety: submit() may run on several SGLang threads; the ring and the queued keys are
under one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Optional

import numpy as np

from .engine import extension
from .layerwise.worker import Worker
from .layout import align_up, strided

logger = logging.getLogger("tutti_hicache.tiered")


class _Ring:
    """FIFO regions of [0, cap): alloc at the tail, free at the head."""

    def __init__(self, cap: int):
        self.cap = cap
        self._live: deque = deque()  # (start, size), oldest first

    def alloc(self, size: int) -> Optional[int]:
        if size <= 0 or size > self.cap:
            return None
        if not self._live:
            start = 0
        else:
            head = self._live[0][0]
            tail = self._live[-1][0] + self._live[-1][1]
            if tail > head:  # not wrapped: [head, tail) in use
                start = tail if tail + size <= self.cap else (0 if size <= head else None)
            else:  # wrapped: [head, cap) and [0, tail) in use
                start = tail if tail + size <= head else None
        if start is not None:
            self._live.append((start, size))
        return start

    def free_oldest(self) -> None:
        self._live.popleft()

    def free_bytes(self) -> int:
        """Bytes of the largest region alloc() could hand out now."""
        if not self._live:
            return self.cap
        head = self._live[0][0]
        tail = self._live[-1][0] + self._live[-1][1]
        if tail > head:
            return max(self.cap - tail, head)
        return head - tail


class _Job:
    def __init__(self, keys: list, dst: np.ndarray):
        self.keys, self.dst = keys, dst
        self.ready = threading.Event()  # the copy into the ring ended (copied: it succeeded)
        self.copied = False


class Promoter:
    def __init__(self, store, budget_bytes: int, object_nbytes, threads: int = 4,
                 on_done: Optional[Callable[[int, int], None]] = None):
        self._store = store
        nb = np.asarray(object_nbytes, dtype=np.int64)
        self._nbytes = nb
        strides = np.array([align_up(int(n)) for n in nb], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(strides)[:-1]]).astype(np.uint64)
        self._page_bytes = int(strides.sum())  # one page's objects, each 4 KiB aligned
        self._aligned = bool((nb == strides).all())  # zero-copy writes from the ring
        self.ring_bytes = budget_bytes // self._page_bytes * self._page_bytes
        self._threads = max(1, threads)
        self._on_done = on_done
        self._lock = threading.Lock()
        self._ring = _Ring(self.ring_bytes)
        self._buf = None  # the ring's memory, allocated at the first promotion
        self._queued: set = set()
        self.pending = 0
        self._worker = Worker("tutti-promote", self._write)

    def submit(self, keys: list, addrs: np.ndarray) -> np.ndarray:
        """Copy pages (their object addresses [n, m] in the host pool) into the ring and queue
        their write; returns per page whether it is queued now (taken, or queued before)."""
        handled = np.zeros(len(keys), dtype=bool)
        with self._lock:  # the region and the job's place in the queue: one order
            fresh = [i for i, k in enumerate(keys) if k not in self._queued]
            handled[:] = True
            handled[fresh] = False
            n = min(len(fresh), self._ring.free_bytes() // self._page_bytes)
            start = self._ring.alloc(n * self._page_bytes) if n else None
            if start is None:
                return handled
            take = fresh[:n]
            if self._buf is None:
                self._buf = extension().AlignedBuffer(self.ring_bytes)
            pages = strided(self._buf.address + start, n, self._page_bytes)
            job = _Job([keys[i] for i in take], pages[:, None] + self._offsets[None, :])
            self._queued.update(job.keys)
            self.pending += n
            self._worker.put(job)  # it waits for job.ready: the copy below
        try:
            src = np.asarray(addrs, dtype=np.uint64)[take]
            extension().memcpy_batch(job.dst.ravel(), src.ravel(), np.tile(self._nbytes, n),
                                     self._threads)
            job.copied = True
        finally:
            job.ready.set()
        handled[take] = True
        return handled

    def _write(self, job: "_Job") -> None:
        written = 0
        job.ready.wait()
        try:
            if job.copied:
                written = int(self._store.write_pages(job.keys, job.dst, self._aligned).sum())
        except Exception:
            logger.exception("tutti: promoting %d remote pages failed", len(job.keys))
        finally:
            with self._lock:  # jobs run in allocation order: this one holds the oldest region
                self._ring.free_oldest()
                self._queued.difference_update(job.keys)
                self.pending -= len(job.keys)
            if self._on_done is not None:
                self._on_done(written, len(job.keys) - written)

    def drain(self) -> None:
        self._worker.drain()

    def close(self) -> None:
        self._worker.stop()


__all__ = ["Promoter"]
