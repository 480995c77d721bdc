"""The write path of the store: a slot for every new page, then publication in order.

At a glance:
    writes = Writes(index, lock, rows, scanner, io, page_nbytes)
    writes.write_pages(keys, addrs, aligned) -> ok [n]   per page True when stored (or present)
    writes.counters() -> {write_pages, write_bytes, write_seconds, dedup_skips, write_failures}

Per batch: (1) dedupe: a key present or being written is reported stored, not rewritten (SSD
wear); (2) reserve a slot per new key: a free one, else grow by one segment row, else evict the
least recently used own page; (3) SlotIO.publish writes tombstones of reused slots, payloads,
then headers; (4) the index publishes the slots whose headers landed and takes the others back.
Any exception gives every reservation back (nothing is published).

Thread-safety: several writer threads may call write_pages. The index lock (`lock`, the
store's) is held only for the index steps of (1), (2) and (4) and the sequence numbers; growth
runs under Rows' lock with the index lock released (rows.claim_next), so lookups never wait
for a fallocate, an flock or a header scan.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from . import header
from .index import SlotIndex
from .rows import Rows
from .scan import Scanner
from .slot_io import SlotIO

logger = logging.getLogger("tutti_hicache.store")


@dataclass
class WriteCounts:
    write_pages: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    dedup_skips: int = 0
    write_failures: int = 0


class Writes:
    def __init__(self, index: SlotIndex, lock, rows: Rows, scan: Scanner, io: SlotIO,
                 page_nbytes: int):
        self._index, self._lock, self._rows, self._scan, self._io = index, lock, rows, scan, io
        self._page_nbytes = page_nbytes
        self._seq = time.time_ns()  # sequence numbers: above every one seen on disk
        self._counts = WriteCounts()  # under the index lock

    def counters(self) -> dict:
        """The write counters (call with the index lock held)."""
        return dict(self._counts.__dict__)

    def write_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        t0 = time.perf_counter()
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        todo, reservations = self._reserve(keys, ok)
        if todo:
            idx = np.array(todo, dtype=np.int64)
            ok[idx] = self._write_reserved(reservations, addrs[idx], aligned)
        stored = int(ok[todo].sum()) if todo else 0
        refused = n - len(todo) - int(ok.sum() - stored)  # no slot, unusable key
        with self._lock:
            c = self._counts
            c.write_pages += stored
            c.write_failures += len(todo) + refused - stored
            c.write_bytes += stored * self._page_nbytes
            c.write_seconds += time.perf_counter() - t0
        return ok

    def _reserve(self, keys: list[str], ok: np.ndarray):
        """A slot per new key: a free one, else grow by one row (outside the index lock), else
        evict the least recently used. Keys present or being written are reported stored."""
        pending = []
        for i, k in enumerate(keys):
            if header.encode_key(k) is None:
                logger.warning("tutti: unusable key %r (not a non-empty str of <= %d bytes)",
                               k, header.MAX_KEY_BYTES)
            else:
                pending.append((i, k))
        got: dict = {}
        pending = self._reserve_some(pending, ok, got, evict=False)
        while pending and self._rows.claim_next(self._claimed, self._no_free_slot):
            pending = self._reserve_some(pending, ok, got, evict=False)
        if pending:
            self._reserve_some(pending, ok, got, evict=True)
        todo = sorted(got)
        return todo, [got[i] for i in todo]

    def _reserve_some(self, pending: list, ok: np.ndarray, got: dict, evict: bool) -> list:
        """Reserve for (index, key) pairs under the index lock; returns those left without."""
        left = []
        with self._lock:
            for i, k in pending:
                if k in self._index or k in self._index.reserved:
                    ok[i] = True
                    self._index.prefix_len([k])
                    self._counts.dedup_skips += 1
                    continue
                r = self._index.reserve(k, evict=evict)
                if r is None:
                    left.append((i, k))
                else:
                    got[i] = r
        return left

    def _no_free_slot(self) -> bool:
        with self._lock:
            return not self._index.free

    def _claimed(self, row: int) -> None:
        self._scan.scan_rows([row], grant=True)  # its free slots become allocatable

    def _write_reserved(self, res: list, addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Write reserved slots; any exception gives every reservation back (nothing published)."""
        try:
            return self._publish(res, addrs, aligned)
        except Exception:
            logger.exception("tutti: write of %d pages failed; not stored", len(res))
            with self._lock:
                for r in res:
                    if r.key in self._index.reserved:
                        self._index.abort(r)
            return np.zeros(len(res), dtype=bool)

    def _publish(self, res: list, addrs: np.ndarray, aligned: bool) -> np.ndarray:
        n = len(res)
        slots = np.array([r.slot for r in res], dtype=np.int64)
        with self._lock:
            self._seq = max(self._seq, self._scan.max_seq)
            seqs = self._seq + 1 + np.arange(n, dtype=np.uint64)
            self._seq += n
        good, sums, units = self._io.publish([r.key for r in res], slots, [r.dirty for r in res],
                                             addrs, aligned, seqs)
        with self._lock:
            for i, (r, g) in enumerate(zip(res, good)):
                if g:
                    self._index.publish(r, int(sums[i]), int(seqs[i]), units[i].tobytes())
                else:
                    self._index.abort(r)
        return good
