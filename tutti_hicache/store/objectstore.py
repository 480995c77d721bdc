"""The object store: one slot per KV page in preallocated segment files, striped over dirs.

At a glance:
    store = ObjectStore(cfg, geometry, identity, writer=True)
    store.prefix_len(keys) -> int                 leading keys present (memory only, no I/O)
    store.present(keys) -> bool[n]                each key present (memory only, no I/O)
    store.read_pages(keys, addrs, aligned) -> bool[n]
    store.write_pages(keys, addrs, aligned) -> bool[n]
    store.begin_pages(keys) -> w; store.land_pages(w, start, stop, addrs, aligned) per chunk;
    store.publish_pages([w, ...]) -> [bool[n], ...]       write_pages in steps (one header batch)
    store.pin(keys) / store.unpin(entries)        hold pages against eviction (layer-wise loads)
    store.plan_pages(entries), store.stream_layers(plan, chunks, dsts)   layer_reads.py
    store.clear(); store.close(); store.stats()      stats()["wear"]: bytes written per device
    store.rehome_wait(timeout) -> bool           pages of set-aside namespaces re-homed (rehome.py)
    store.locate(key) -> (segment path, slot offset)       where a present key's slot lives
    store.entries() -> {key: PageInfo}                      read-only snapshot of the index

`addrs` is a uint64 array [n_pages, objects_per_page] of host addresses, one per object in
on-disk order (SlotLayout); `aligned` says every address and object size is a multiple of 4 KiB
(zero copy), otherwise pages go through an aligned bounce buffer (slot_io.py).

On disk: <dir>/tutti-<fingerprint>/seg-<row>.dat, one "row" of segments = the same segment
number in every directory (namespace.py). Attach heals the namespace's own files instead of
refusing to start (heal.py): damaged metadata is rebuilt, a changed directory list is mapped or
set aside. A writer process owns the rows it holds an exclusive
flock on (rows.py; allocation and eviction only there); every process reads every row, and
re-scans the headers of rows that other processes changed when a lookup misses (scan.py).
Publication order per write batch (writes.py, slot_io.py): tombstone headers of reused slots
-> payloads -> headers -> the index.
A reader trusts a slot only through a valid header (see header.py) and, when verifying,
the payload's XXH3 checksum.

Thread-safety: every method may be called from any thread. One lock (`_lock`) guards the index
and the counters, for microseconds per call: no I/O and no filesystem call runs under it.
Growth (creating, flocking and scanning a row) runs under Rows' own lock, before the index lock
is taken again to reserve; scans learn under the index lock once per 16384 headers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

import numpy as np

from . import header
from .. import iodepth
from ..config import TuttiConfig
from ..engine import inflight_for, open_engine
from ..identity import with_geometry
from .index import SlotIndex
from .layer_reads import LayerReads, LayerStream, PagePlan
from .repair.heal import quarantines, reclaim, resolve
from ..layout import PageGeometry, SlotLayout
from .namespace import FileTable, Namespace, check_dirs, fit_to_filesystems, namespace_dirs
from .repair.rehome import Rehome
from .rows import Rows
from .scan import Scanner
from .scheduler import Gate, Policy
from .slot_io import SlotIO
from .writes import Writes

__all__ = ["ObjectStore", "PageInfo", "PagePlan", "LayerStream", "drop_entries", "log_damaged"]
logger = logging.getLogger("tutti_hicache.store")


class PageInfo(NamedTuple):
    """One indexed page as ObjectStore.entries() shows it."""
    slot: int
    seq: int
    checksum: int  # XXH3-64 of the page (over its per-layer checksums)
    owned: bool  # in a row this process owns (it may evict it)


@dataclass
class ReadCounts:
    read_pages: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    stale_foreign: int = 0  # another process's slot changed under us (re-scanned, a miss)


def drop_entries(index: SlotIndex, bad_entries, hold: bool = False) -> tuple[list, int, list]:
    """Forget entries whose bytes failed their checksum (call with the index lock held).
    Returns (damaged: [(slot, key)] of own slots, for log_damaged; stale: how many were other
    processes' slots, which the usual cause is that their owner reused them since our last
    re-scan; held: with hold, the own slots dropped now, kept out of every list until the caller
    has tombstoned their headers and let them go, index.let_go)."""
    damaged, stale, held = [], 0, []
    for e in bad_entries:
        key = index.by_slot.get(e.slot)
        if e.owned:
            damaged.append((e.slot, key))
        else:
            stale += 1
        if key is not None and index.entries.get(key) is e:
            own = e.owned
            index.drop(key, hold=hold)
            if hold and own:
                held.append(e.slot)
    return damaged, stale, held


def log_damaged(damaged: list) -> None:
    """One warning per own slot drop_entries dropped (logged outside the index lock)."""
    for slot, key in damaged:
        logger.warning("tutti: checksum mismatch in slot %d (key %s): dropped, served as a miss",
                       slot, key)


class ObjectStore:
    """The store of one identity's pages (module docstring). writer=False: read only (an MLA
    rank that is not the writer); engine: use this engine (the store closes it)."""

    def __init__(self, cfg: TuttiConfig, geometry: PageGeometry, identity: dict,
                 writer: bool = True, engine=None):
        check_dirs(cfg)
        self.cfg = cfg
        self.layout = SlotLayout(geometry)
        self.identity = with_geometry(identity, geometry)
        self.fingerprint = header.fingerprint(self.identity)
        self.writer = writer
        if geometry.units > header.MAX_UNITS:
            raise ValueError(f"tutti: {geometry.num_layers} layers exceed the {header.MAX_UNITS} "
                             "per-layer checksums a slot header holds")
        cfg = self.cfg = fit_to_filesystems(cfg, namespace_dirs(cfg.dirs, self.fingerprint),
                                            self.layout.slot_nbytes)
        self.capacity_slots = cfg.capacity_bytes // self.layout.slot_nbytes
        if self.capacity_slots < 1:
            raise ValueError(f"tutti_capacity_gb: {cfg.capacity_gb} GB holds no slot of "
                             f"{self.layout.slot_nbytes} bytes")
        healed = resolve(cfg, self.fingerprint, self.identity, self.layout)
        self.placement = healed.placement  # a recorded segment size wins over the config's
        self.quarantined = healed.quarantined  # namespace dirs this attach set aside
        self._ns = Namespace(cfg, self.fingerprint, self.placement, self.capacity_slots,
                             dirs=healed.dirs)
        self.ns_dirs, self.n_rows = self._ns.dirs, self._ns.n_rows
        depth, read_bytes, write_bytes = inflight_for(cfg)
        self.engine = engine or open_engine(cfg.engine, depth, cfg.threads, read_bytes,
                                            write_bytes)
        self.gate = Gate(Policy(default_window=cfg.write_window_ms / 1e3,
                                min_chunk=self.layout.payload_nbytes,
                                idle_chunk=write_bytes or iodepth.derive(cfg.dirs).write_bytes,
                                max_write_wait=cfg.write_floor_ms / 1e3,
                                max_backlog=cfg.write_backlog_mb << 20), enabled=cfg.scheduler)
        self._lock = threading.Lock()  # the index and the counters; never held over I/O
        self._index = SlotIndex()
        self._stats = ReadCounts()
        self._closed = False
        self._rehome: Optional[Rehome] = None
        self._files = FileTable(self.engine, self._ns, writable=writer)
        self._io = SlotIO(self.engine, self._files, self.layout, self.placement, cfg, self.gate,
                          self.fingerprint)
        self._rows = Rows(self._ns, self._files, writer)
        self._scan = Scanner(self._ns, self._files, self._rows, self.engine, self.layout,
                             self.fingerprint, self._index, self._lock, cfg.rescan_interval_s)
        self._layers = LayerReads(self._io, self._files, self.layout, self.placement, self.gate,
                                  cfg.verify)
        self._writes = Writes(self._index, self._lock, self._rows, self._scan, self._io,
                              geometry.page_nbytes)  # no part holds the store: freed at once
        self._wear = self._io.wear  # bytes handed to each drive (wear.py)
        self._wear.wrote_meta(healed.meta_bytes)
        self._wear.load()
        self._open()

    def _open(self) -> None:
        """Open the rows on disk, hold what this writer may, learn every header, start re-scans."""
        rows = self._ns.existing_rows()
        self._ns.remove_rows([r for r in rows if r >= self.n_rows], self.writer)
        rows = [r for r in rows if r < self.n_rows]
        if self.writer:
            self._rows.register()
        for r in rows:
            try:
                if self._files.open_row(r, create=False):
                    self._rows.adopt(r)
            except OSError as e:  # an unopenable segment: its slots are misses, attach goes on
                logger.warning("tutti: cannot open segment row %d: %s", r, e)
        self._scan.scan_rows(rows, grant=True)
        self._scan.start(self._release_excess if self.writer else None)
        set_aside = [q for q, _, _ in quarantines([os.path.dirname(d) for d in self.ns_dirs],
                                                  os.path.basename(self.ns_dirs[0]))]
        if self.writer and set_aside:  # their pages come back by key, in the background
            self._rehome = Rehome(set_aside, self.layout, self.fingerprint,
                                  self._writes.write_pages, self._io.checksums).start()
        # set-aside files beyond the capacity go; after the re-homing took its flocks, so that a
        # restart in the middle of one keeps the row of slack it needs (heal.reclaim)
        reclaim(self._ns.dirs, 0, self.capacity_slots * self.layout.slot_nbytes,
                slack=len(self._ns.dirs) * self.placement.segment_file_nbytes)
        if self._ns.n_rows:  # every row but maybe the last is as large as row 0
            self._writes.grow_ahead(len(self._ns.row_slots(0)))

    def rehome_wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the pages of set-aside namespaces are re-homed (True: done or none)."""
        return self._rehome is None or self._rehome.wait(timeout)

    # ------------------------------------------------------------------ lookups
    def prefix_len(self, keys: list[str]) -> int:
        """Number of leading keys present (from memory). A short answer asks for a re-scan."""
        with self._lock:
            n = self._index.prefix_len(keys)
        if n < len(keys):
            self._scan.request()
        return n

    def present(self, keys: list[str]) -> np.ndarray:
        """Per key, whether it is present (from memory). A miss asks for a re-scan."""
        with self._lock:
            flags = np.fromiter((k in self._index for k in keys), dtype=bool, count=len(keys))
        if not flags.all():
            self._scan.request()
        return flags

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def entries(self) -> Mapping[str, PageInfo]:
        """A read-only snapshot of the index: key -> PageInfo."""
        with self._lock:
            return MappingProxyType({k: PageInfo(e.slot, e.seq, e.checksum, e.owned)
                                     for k, e in self._index.entries.items()})

    def locate(self, key: str) -> tuple[str, int]:
        """(segment file path, byte offset of the slot) of a present key; KeyError if absent."""
        with self._lock:
            slot = self._index.entries[key].slot
        files, offsets = self._files.slot_files(np.array([slot]))
        return self._files.path(int(files[0])), int(offsets[0])

    def files(self) -> dict[int, str]:
        """Engine file handle -> path of every segment file the store has open."""
        return self._files.paths()

    # -------------------------------------------------------------------- reads
    def read_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Restore pages into host memory; per page True only when every byte is verified."""
        t0 = time.perf_counter()
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        entries = self.pin(keys)
        idx = np.flatnonzero([e is not None for e in entries])
        slots = np.array([entries[i].slot for i in idx], dtype=np.int64)
        try:
            if len(idx):
                must = np.array([self.cfg.verify or not entries[i].fresh for i in idx], dtype=bool)
                good, sums = self._io.read(slots, addrs[idx], aligned, bool(must.any()))
                ok[idx] = good & self._verify([entries[i] for i in idx], must, sums)
        finally:
            with self._lock:
                self._index.unpin(slots.tolist())
        self._account_read(ok, n, time.perf_counter() - t0)
        return ok

    def _verify(self, entries: list, must: np.ndarray, sums) -> np.ndarray:
        """False for pages whose checksum must match and does not (they are dropped)."""
        good = np.ones(len(entries), dtype=bool)
        if sums is None or not must.any():
            return good
        expect = np.array([e.checksum for e in entries], dtype=np.uint64)
        bad = must & (sums != expect)
        if bad.any():
            good[bad] = False
            self._drop_corrupt([e for e, b in zip(entries, bad) if b])
        return good

    def _drop_corrupt(self, bad_entries) -> None:
        """Drop pages that failed their checksum. An own page's header is tombstoned (its slot
        held out of the free list until then, as clear() does): left valid, the page would come
        back at every restart, and fail and be counted as damage again, until its slot is
        reused. Another process's page is left to its owner."""
        with self._lock:
            damaged, stale, held = drop_entries(self._index, bad_entries, hold=True)
            self._stats.checksum_failures += len(damaged)
            self._stats.stale_foreign += stale
        log_damaged(damaged)
        if held:
            try:
                self._io.tombstones(*self._files.slot_files(np.array(held, np.int64)))
            finally:
                with self._lock:
                    self._index.let_go(held)
        if stale:
            self._scan.request()

    # --------------------------------------------------------- layer reads
    def pin(self, keys: list[str]) -> list:
        """Pin present keys against eviction (linker: between load and the last layer read)."""
        with self._lock:
            return self._index.pin(keys)

    def unpin(self, entries: list) -> None:
        with self._lock:
            self._index.unpin([e.slot for e in entries if e is not None])

    def layer_object_stride(self) -> int:
        """Bytes between consecutive objects of a layer in a stream_layers destination."""
        return self._layers.object_stride()

    def plan_pages(self, entries: list) -> PagePlan:
        """Everything per page a layer-wise restore needs, built once per batch (vectorized)."""
        return self._layers.plan(entries)

    def stream_layers(self, plan: PagePlan, chunks: list, dsts: list):
        """`with store.stream_layers(plan, chunks, dsts) as stream:` reads chunks [(layer, rows)]
        of the plan's pages back to back, holding their directories for reads (the scheduler)
        until the with ends; stream.lend(s) lends them to writes for one window. See
        layer_reads.py for the stream's verbs and the destination layout."""
        return self._layers.stream(plan, chunks, dsts, self._drop_corrupt)

    # ------------------------------------------------------------------- writes
    def write_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Store pages not yet present; per page True when stored (or already there).
        A read-only store (writer=False) stores nothing. See writes.py."""
        if not self.writer:
            return np.zeros(len(keys), dtype=bool)
        ok = self._writes.write_pages(keys, addrs, aligned)
        self._wear.maybe_flush()
        return ok

    def begin_pages(self, keys: list[str]):
        """write_pages in steps, for a caller writing one batch in chunks (the linker's offload):
        begin_pages reserves a slot per new key and tombstones reused ones (nothing visible);
        land_pages writes the payloads of keys [start, stop) (chunks may land at once);
        publish_pages, once, writes every landed page's header in one batch. Every begun write
        must be published (that also gives back what did not land). See writes.py."""
        if not self.writer:
            return None
        return self._writes.begin(keys)

    def land_pages(self, pending, start: int, stop: int, addrs: np.ndarray, aligned: bool) -> None:
        """Payloads of keys [start, stop) of a begin_pages write, from addrs [stop - start, m]."""
        if pending is not None:
            self._writes.land(pending, start, stop, addrs, aligned)

    def publish_pages(self, writes: list) -> list:
        """Publish begun writes; per write, ok per key (None: a read-only store's)."""
        live = [x for x in writes if x is not None]
        oks = iter(self._writes.publish(live) if live else [])
        self._wear.maybe_flush()
        return [next(oks) if x is not None else None for x in writes]

    # ------------------------------------------------------------ maintenance
    def clear(self) -> int:
        """Forget every page this process owns and tombstone their headers on disk.

        Pages published by other processes sharing the directories are left to them.
        Returns the number of pages dropped."""
        with self._lock:
            own = [(k, e.slot) for k, e in self._index.entries.items() if e.owned]
            for k, _ in own:  # held: a write reusing one before its tombstone lands would lose
                self._index.drop(k, hold=True)  # its new header to that tombstone
            for k in [k for k, e in self._index.entries.items() if not e.owned]:
                self._index.forget_slot(self._index.entries[k].slot)
        slots = [s for _, s in own]
        try:
            if own:
                self._io.tombstones(*self._files.slot_files(np.array(slots, np.int64)))
        finally:
            with self._lock:
                self._index.let_go(slots)
        return len(own)

    def forget(self, keys: list[str]) -> int:
        """Drop keys from this process's index (as if lost); own slots become reusable. The
        on-disk headers stay. Returns how many keys were present."""
        with self._lock:
            return sum(self._index.drop(k) is not None for k in keys)

    def rescan(self) -> int:
        """Re-scan rows this process does not own whose files changed. Returns entries learned."""
        return self._scan.rescan()

    def owned_rows(self) -> frozenset:
        """Segment rows this process owns (allocates and evicts in) now."""
        return self._rows.owned

    def rebalance(self) -> None:
        """Count the live writers again and hand rows beyond the fair share back now (the
        re-scan thread does this after its re-scans, with a count at most 1 s old)."""
        self._release_excess(recount=True)

    def _release_excess(self, recount: bool = False) -> None:
        def disown(row: int) -> bool:  # the row's entries stay readable, now as foreign
            slots = self._ns.row_slots(row).tolist()
            with self._lock:
                return self._index.disown(slots)

        for row in self._rows.release_excess(disown, recount):
            logger.info("tutti: handed segment row %d to the other writers", row)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._rehome is not None:
            self._rehome.stop()  # the chunk in flight finishes; the next attach resumes
        self._writes.stop()  # a growth in flight finishes
        self._scan.stop()  # a re-scan in flight finishes before the engine goes
        self._wear.flush()
        self._io.close()
        self.engine.close()
        self._rows.close()

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats.__dict__)
            s.update(self._writes.counters())
            s.update(read_errors=self._io.read_errors, rescans=self._scan.rescans,
                     bad_headers=self._scan.bad_headers)
            s.update({f"sched_{k}": v for k, v in self.gate.stats.items()})
            s.update(pages=len(self._index), evictions=self._index.evictions,
                     capacity_slots=self.capacity_slots, slot_nbytes=self.layout.slot_nbytes,
                     rehomed_pages=self._rehome.pages if self._rehome else 0,
                     rehome_refused=self._rehome.refused if self._rehome else 0,
                     owned_rows=len(self._rows.owned))
        s["engine"] = self.engine.name
        s["wear"] = self.wear()
        s.update({f"engine_{k}": v for k, v in self.engine.counters().items()})
        return s

    def wear(self) -> dict:
        """Bytes written per device by kind, logical bytes, drive writes per day (wear.py)."""
        return self._wear.snapshot()

    def register_memory(self, regions: list[tuple[int, int]]) -> int:
        """Register host memory (the KV pool) with the engine for fixed-buffer I/O."""
        return self.engine.register_buffers(list(regions))

    # ------------------------------------------------------------ internals
    def _account_read(self, ok, n, seconds) -> None:
        with self._lock:
            s = self._stats
            hit = int(ok.sum())
            s.read_pages += n
            s.hits += hit
            s.misses += n - hit
            s.read_bytes += hit * self.layout.geometry.page_nbytes
            s.read_seconds += seconds
