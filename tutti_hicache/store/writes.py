"""The write path of the store: a slot for every new page, then publication in order.

At a glance:
    writes = Writes(index, lock, rows, scanner, io, page_nbytes)
    writes.write_pages(keys, addrs, aligned) -> ok [n]   per page True when stored (or present)
    writes.begin(keys) -> Pending                       (1), (2), tombstones: nothing visible
    writes.land(pending, start, stop, addrs, aligned)   payloads of keys [start, stop)
    writes.publish([Pending, ...]) -> [ok, ...]         their headers in one batch, then (4)
    writes.counters() -> {write_pages, write_bytes, write_seconds, dedup_skips, write_failures}
    writes.grow_ahead(row_slots)                         start the grower thread (a writer's store)
    writes.stop()                                        stop it (a growth in flight finishes)

Per batch: (1) dedupe: a key present or being written is reported stored, not rewritten (SSD
wear); (2) reserve a slot per new key: a free one, else grow by one segment row, else evict the
least recently used own page; (3) SlotIO writes tombstones of reused slots (begin), payloads
(land), then headers (headers); (4) the index publishes the slots whose headers landed and takes the others back.
Any exception gives every reservation back (nothing is published). write_pages runs begin, land
and publish at once; a caller writing one offload in several chunks (the linker) calls begin
once (one tombstone batch), land per chunk, and publish once at the end (one header batch),
instead of a tombstone and a header batch per chunk, each queued behind the other chunks'
payloads in the devices' queues.

Growth ahead: a writer's store keeps at least one row's worth of free slots while it may still
grow (its fair share, the capacity): a grower thread claims the next row (create, fallocate, header
scan) when a reservation leaves fewer free slots than a row holds, and once at open; never while
quarantined files of the namespace wait to be re-homed (growing could delete them to make room,
before their pages are read back: only a write that needs the row may do that). A write
then waits for a row's growth only when it outruns the grower (a first batch larger than the
free space, or one arriving before the grower's first row); before, every write that used up the
free slots paid the create + fallocate + scan of the next row itself (on the machine's virtio
disk, 108 ms of a 1347 ms 2 GiB write, docs/benchmarks.md §10.1).

Thread-safety: several writer threads may call write_pages. The index lock (`lock`, the
store's) is held only for the index steps of (1), (2) and (4) and the sequence numbers; growth
runs under Rows' lock with the index lock released (rows.claim_next), so lookups never wait
for a fallocate, an flock or a header scan.
"""

from __future__ import annotations

import logging
import threading
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


@dataclass
class Pending:
    """A write on its way (Writes.begin, land, publish): ok per key (present ones already
    True), the indices of the keys being written (todo) with their reservations and their
    SlotIO.Landed, the seconds spent so far."""
    ok: np.ndarray
    todo: np.ndarray
    reservations: list
    landed: object
    seconds: float


class Writes:
    def __init__(self, index: SlotIndex, lock, rows: Rows, scan: Scanner, io: SlotIO,
                 page_nbytes: int):
        self._index, self._lock, self._rows, self._scan, self._io = index, lock, rows, scan, io
        self._page_nbytes = page_nbytes
        self._seq = time.time_ns()  # sequence numbers: above every one seen on disk
        self._counts = WriteCounts()  # under the index lock
        self._grower: threading.Thread | None = None
        self._grow = threading.Event()
        self._stopping = False
        self._low_water = 0  # free slots below which the grower claims a row (0: no grower)

    def grow_ahead(self, row_slots: int) -> None:
        """Start the grower thread (a writer's store, at open) and ask it for a first row;
        row_slots: the slots of one segment row, the free slots it keeps."""
        if not self._rows.writer or self._grower is not None or row_slots <= 0:
            return
        self._low_water = row_slots
        self._grower = threading.Thread(target=self._grow_loop, name="tutti-grow", daemon=True)
        self._grower.start()
        self._grow.set()

    def stop(self) -> None:
        """Stop the grower: a growth in flight finishes first (it holds Rows' lock)."""
        self._stopping = True
        self._grow.set()
        if self._grower is not None:
            self._grower.join()
            self._grower = None

    def _low(self) -> bool:
        with self._lock:
            return not self._stopping and len(self._index.free) < self._low_water

    def _grow_loop(self) -> None:
        while True:
            self._grow.wait()
            self._grow.clear()
            if self._stopping:
                return
            try:  # claim_next returns False at the fair share, the capacity or after ENOSPC
                while self._low() and self._rows.claim_next(self._claimed, self._low, ahead=True):
                    pass
            except Exception:  # never the writers' problem: they grow themselves if they must
                logger.exception("tutti: growing the store ahead failed")

    def counters(self) -> dict:
        """The write counters (call with the index lock held)."""
        return dict(self._counts.__dict__)

    def write_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        p = self.begin(keys)
        self.land(p, 0, len(keys), addrs, aligned)
        return self.publish([p])[0]

    def begin(self, keys: list[str]) -> "Pending":
        """Steps (1)-(2) and the tombstones of (3): a reserved slot per new key, nothing visible.
        land() then writes payloads (keys [start, stop) at a time), publish() must follow (it
        also gives back what did not land)."""
        t0 = time.perf_counter()
        ok = np.zeros(len(keys), dtype=bool)
        todo, reservations = self._reserve(keys, ok)
        landed = None
        if todo:
            try:
                n = len(reservations)
                slots = np.array([r.slot for r in reservations], dtype=np.int64)
                with self._lock:
                    self._seq = max(self._seq, self._scan.max_seq)
                    seqs = self._seq + 1 + np.arange(n, dtype=np.uint64)
                    self._seq += n
                landed = self._io.begin([r.key for r in reservations], slots,
                                        [r.dirty for r in reservations], seqs)
            except Exception:
                logger.exception("tutti: write of %d pages failed; not stored", len(todo))
                self._abort(reservations)
                todo, reservations = [], []
        return Pending(ok, np.array(todo, dtype=np.int64), reservations, landed,
                       time.perf_counter() - t0)

    def land(self, p: "Pending", start: int, stop: int, addrs: np.ndarray, aligned: bool) -> None:
        """Payloads of p's keys [start, stop) that are being written, from addrs [stop - start,
        m] (the keys' own rows). Calls on disjoint ranges may run at once. A failure leaves
        those pages unlanded (publish gives their slots back)."""
        if not p.reservations:
            return
        t0 = time.perf_counter()
        sel = np.flatnonzero((p.todo >= start) & (p.todo < stop))
        if len(sel):
            try:
                self._io.land(p.landed, sel, addrs[p.todo[sel] - start], aligned)
            except Exception:
                logger.exception("tutti: payloads of %d pages failed; not stored", len(sel))
        with self._lock:
            p.seconds += time.perf_counter() - t0

    def publish(self, pending: list) -> list:
        """Headers of every landed page of `pending` in one batch, then the index publishes them
        and takes the other reservations back. Returns ok per page of each (in order)."""
        t0 = time.perf_counter()
        live = [p for p in pending if p.reservations]
        try:
            goods = self._io.headers([p.landed for p in live]) if live else []
        except Exception:
            logger.exception("tutti: headers of %d pages failed; not stored",
                             sum(len(p.reservations) for p in live))
            goods = [np.zeros(len(p.reservations), dtype=bool) for p in live]
        with self._lock:
            for p, good in zip(live, goods):
                x = p.landed
                for i, (r, g) in enumerate(zip(p.reservations, good)):
                    if g:
                        self._index.publish(r, int(x.sums[i]), int(x.seqs[i]), x.units[i].tobytes())
                    else:
                        self._index.abort(r)
                p.ok[p.todo] = good
        share = (time.perf_counter() - t0) / max(1, len(pending))
        for p in pending:
            self._count(p, p.seconds + share)
        return [p.ok for p in pending]

    def _count(self, p: "Pending", seconds: float) -> None:
        stored = int(p.ok[p.todo].sum()) if len(p.todo) else 0
        refused = len(p.ok) - len(p.todo) - int(p.ok.sum() - stored)  # no slot, unusable key
        with self._lock:
            c = self._counts
            c.write_pages += stored
            c.write_failures += len(p.todo) + refused - stored
            c.write_bytes += stored * self._page_nbytes
            c.write_seconds += seconds

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
        try:
            pending = self._reserve_some(pending, ok, got, evict=False)
            while pending and self._rows.claim_next(self._claimed, self._no_free_slot):
                pending = self._reserve_some(pending, ok, got, evict=False)
            if pending:
                self._reserve_some(pending, ok, got, evict=True)
        except Exception:  # growing failed (a row's scan: memory, a closed engine, the registry):
            # the batch fails; its reservations go back, or their keys would read as being
            # written forever (later stores deduplicated, never findable) and their slots lost
            logger.exception("tutti: reserving slots for %d pages failed; not stored", len(keys))
            self._abort(list(got.values()))
            return [], []
        if self._low_water and self._low():
            self._grow.set()
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

    def _abort(self, res: list) -> None:
        with self._lock:
            for r in res:
                if r.key in self._index.reserved:
                    self._index.abort(r)
