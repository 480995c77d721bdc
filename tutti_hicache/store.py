"""The object store: one slot per KV page in preallocated segment files, striped over dirs.

At a glance:
    store = ObjectStore(cfg, geometry, identity, writer=True)
    store.prefix_len(keys) -> int                 leading keys present (memory only, no I/O)
    store.read_pages(keys, addrs, aligned) -> bool[n]
    store.write_pages(keys, addrs, aligned) -> bool[n]
    store.clear(); store.close(); store.stats()
    store.locate(key) -> (segment path, slot offset)       where a present key's slot lives
    store.entries() -> {key: PageInfo}                      read-only snapshot of the index

`addrs` is a uint64 array [n_pages, objects_per_page] of host addresses, one per object in
on-disk order (SlotLayout). `aligned` says every address and object size is a multiple of
4 KiB, so objects move straight between disk and memory (O_DIRECT, zero copy); otherwise
whole slots go through an aligned bounce buffer and C++ copies the pieces.

On disk: <dir>/tutti-<fingerprint>/seg-<row>.dat, one "row" of segments = the same segment
number in every directory. A writer process owns the rows it holds an exclusive flock on
(allocation and eviction only there); every process reads every row, and re-scans the
headers of rows that other processes changed when a lookup misses (rate limited).
Publication order per write batch: tombstone headers of reused slots -> payloads -> headers.
A reader trusts a slot only through a valid header (see header.py) and, when verifying,
the payload's XXH3 checksum. Thread-safe: one lock around the index; I/O outside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple

import numpy as np

from . import header
from .config import TuttiConfig
from .namespace import check_dirs
from .engine import engine_for, extension
from .index import SlotIndex
from .layout import HEADER_NBYTES, PageGeometry, Placement, SlotLayout, strided
from .scheduler import Gate, Policy
from .segments import SegmentFiles

logger = logging.getLogger("tutti_hicache.store")


@dataclass
class PagePlan:
    """Per-page arrays of a layer-wise restore (see ObjectStore.plan_pages)."""
    entries: list
    slots: np.ndarray
    files: np.ndarray
    offsets: np.ndarray
    must: np.ndarray
    units: np.ndarray


class LayerStream:
    """A running ObjectStore.stream_layers read: allow(n) admits chunks [0, n), wait(i) -> ok
    per page of chunk i (verified once), settle(n) waits until chunks [0, n) have landed
    without consuming them, close() stops and joins (nothing lands in memory afterwards)."""

    def __init__(self, store, plan, chunks, dsts, stream, verify: bool):
        self._store, self._plan, self._chunks, self._dsts = store, plan, chunks, dsts
        self._stream, self._verify = stream, verify

    def allow(self, n: int) -> None:
        self._stream.allow(n)

    def settle(self, n: int) -> None:
        for i in range(n):
            self._stream.wait(i)

    def wait(self, i: int) -> np.ndarray:
        res, sums = self._stream.wait(i)
        layer, rows = self._chunks[i]
        return self._store._layer_ok(self._plan, layer, rows, self._dsts[i], res,
                                     sums if self._verify else None)

    def close(self) -> None:
        self._stream.cancel()
        try:
            self._stream.join()
        except Exception as e:  # OSError or a closed engine: already raised by wait()
            logger.debug("tutti: read stream ended with %s", e)


class PageInfo(NamedTuple):
    """One indexed page as ObjectStore.entries() shows it."""
    slot: int
    seq: int
    checksum: int  # XXH3-64 of the page (over its per-layer checksums)
    owned: bool  # in a row this process owns (it may evict it)


@dataclass
class StoreStats:
    read_pages: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    stale_foreign: int = 0  # another process's slot changed under us (re-scanned, a miss)
    read_errors: int = 0
    write_pages: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    dedup_skips: int = 0
    write_failures: int = 0
    rescans: int = 0
    extra: dict = field(default_factory=dict)


class ObjectStore(SegmentFiles):
    def __init__(self, cfg: TuttiConfig, geometry: PageGeometry, identity: dict,
                 writer: bool = True, engine=None, maintenance: bool = False):
        """maintenance (fsck/inspect): open an existing namespace as found, with the capacity its
        segment files span; never create, grow, resize or remove anything."""
        self.maintenance = maintenance
        if not maintenance:
            check_dirs(cfg)
        self.cfg = cfg
        self.layout = SlotLayout(geometry)
        g = geometry  # the page geometry is always part of the identity, whatever the caller passed
        self.identity = {**identity, "geometry": [g.kind, g.num_layers, g.page_size,
                                                  g.k_token_bytes, g.v_token_bytes, g.order]}
        self.fingerprint = header.fingerprint(self.identity)
        self.writer = writer
        self.placement = Placement(len(cfg.dirs), self.layout.slot_nbytes, cfg.segment_bytes)
        if geometry.units > header.MAX_UNITS:
            raise ValueError(f"tutti: {geometry.num_layers} layers exceed the {header.MAX_UNITS} "
                             "per-layer checksums a slot header holds")
        self.ns_dirs = [os.path.join(d, "tutti-" + self.fingerprint.hex()) for d in cfg.dirs]
        if maintenance:
            rows = self._existing_rows()
            self.capacity_slots = (max(rows, default=0) + 1) * self.placement.slots_per_segment \
                * len(cfg.dirs)
        else:
            self.capacity_slots = cfg.capacity_bytes // self.layout.slot_nbytes
        if self.capacity_slots < 1:
            raise ValueError(f"tutti_capacity_gb: {cfg.capacity_gb} GB holds no slot of "
                             f"{self.layout.slot_nbytes} bytes")
        self.n_rows = self.placement.segments_for(self.capacity_slots)
        self.engine = engine or engine_for(cfg)
        self.index = SlotIndex()
        self._lock = threading.RLock()
        self._io_lock = {"r": threading.Lock(), "w": threading.Lock()}
        self._staging = {}
        self._zero = extension().AlignedBuffer(HEADER_NBYTES)
        self._file_table = np.full((len(cfg.dirs), self.n_rows), -1, dtype=np.int64)
        self._lock_fds: dict[int, list[int]] = {}
        self._row_mtime: dict[int, list[int]] = {}
        self._seq = time.time_ns()
        self._stats = StoreStats()
        self._last_rescan = 0.0
        self._rescan_wanted = threading.Event()
        self._dirty_slots: set[int] = set()
        self._bad_header_slots: set[int] = set()  # damaged (not empty) headers seen by scans
        self._claim_checked: dict[int, float] = {}
        self._closed = False
        page_io = self.layout.payload_nbytes
        self.gate = Gate(Policy(default_window=cfg.write_window_ms / 1e3, min_chunk=page_io,
                                max_write_wait=cfg.write_floor_ms / 1e3,
                                max_backlog=cfg.write_backlog_mb << 20), enabled=cfg.scheduler)
        self._make_namespaces()
        self._rebuild()

    # ------------------------------------------------------------------ lookups
    def prefix_len(self, keys: list[str]) -> int:
        """Number of leading keys present (from memory). A short answer asks for a re-scan."""
        with self._lock:
            n = self.index.prefix_len(keys)
        if n < len(keys):
            self._request_rescan()
        return n

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def entries(self) -> Mapping[str, PageInfo]:
        """A read-only snapshot of the index: key -> PageInfo."""
        with self._lock:
            return MappingProxyType({k: PageInfo(e.slot, e.seq, e.checksum, e.owned)
                                     for k, e in self.index.entries.items()})

    def locate(self, key: str) -> tuple[str, int]:
        """(segment file path, byte offset of the slot) of a present key; KeyError if absent."""
        with self._lock:
            slot = self.index.entries[key].slot
        files, offsets = self._slot_files(np.array([slot]))
        return self._engine_paths[int(files[0])], int(offsets[0])

    def files(self) -> dict[int, str]:
        """Engine file handle -> path of every segment file the store has open."""
        return dict(self._engine_paths)

    def forget(self, keys: list[str]) -> int:
        """Drop keys from this process's index (as if lost); own slots become reusable. The
        on-disk headers stay. Returns how many keys were present."""
        with self._lock:
            return sum(self.index.drop(k) is not None for k in keys)

    def owned_rows(self) -> frozenset:
        """Segment rows this process owns (allocates and evicts in) now."""
        return frozenset(self._lock_fds)

    def rebalance(self) -> None:
        """Count the live writers again and hand rows beyond the fair share back now (the
        re-scan thread does this after its re-scans, with a count at most 1 s old)."""
        self._share_at = -1e9
        self._release_excess_rows()

    # -------------------------------------------------------------------- reads
    def read_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Restore pages into host memory; per page True only when every byte is verified."""
        t0 = time.perf_counter()
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        with self._lock:
            entries = self.index.pin(keys)
        idx = np.flatnonzero([e is not None for e in entries])
        slots = np.array([entries[i].slot for i in idx], dtype=np.int64)
        try:
            if len(idx):
                must = np.array([self.cfg.verify or not entries[i].fresh for i in idx], dtype=bool)
                good, sums = self._read_slots(slots, addrs[idx], aligned, bool(must.any()))
                ok[idx] = good & self._verify([entries[i] for i in idx], must, sums, addrs[idx])
        finally:
            with self._lock:
                self.index.unpin(slots.tolist())
        self._account_read(ok, n, time.perf_counter() - t0)
        return ok

    def _read_slots(self, slots, addrs, aligned: bool, checksum: bool):
        """Read slots into addrs [n, m]. Returns (ok per page, checksums per page or None).

        On the zero-copy path each page's checksum is computed as soon as its reads land,
        while the rest of the batch is still in flight."""
        files, offsets = self._slot_files(slots)
        lay = self.layout
        n, m = addrs.shape
        if aligned:
            args = (np.repeat(files, m), (offsets[:, None] + lay.object_offsets[None, :]).ravel(),
                    np.tile(lay.object_nbytes, n), addrs.ravel())
            with self.gate.reading(self._devices(slots)):
                if checksum:
                    res, units = self.engine.submit("read", *args, self._unit_starts(n))
                    sums = self._page_sums(units)
                else:
                    res, sums = self.engine.submit("read", *args), None
            self._count_errors(res, "read")
            return (res.reshape(n, m) == lay.object_nbytes[None, :]).all(axis=1), sums
        with self._io_lock["r"]:
            stage = self._stage("r", n)
            base = strided(stage.address, n, lay.payload_nbytes)
            with self.gate.reading(self._devices(slots)):
                res = self.engine.submit("read", files, offsets + HEADER_NBYTES,
                                       np.full(n, lay.payload_nbytes, np.int64), base)
            good = res == lay.payload_nbytes
            self._count_errors(res, "read")
            src = lay.staged_objects(base)
            sums = self._checksums(src)[0] if checksum else None
            sel = np.flatnonzero(good)
            extension().memcpy_batch(addrs[sel].ravel(), src[sel].ravel(),
                                     np.tile(lay.object_nbytes, len(sel)), self.cfg.threads)
            return good, sums

    def _verify(self, entries: list, must: np.ndarray, sums, addrs: np.ndarray) -> np.ndarray:
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

    # --------------------------------------------------------- layer reads
    def pin(self, keys: list[str]) -> list:
        """Pin present keys against eviction (linker: between load and the last layer read)."""
        with self._lock:
            return self.index.pin(keys)

    def unpin(self, entries: list) -> None:
        with self._lock:
            self.index.unpin([e.slot for e in entries if e is not None])

    def layer_object_stride(self) -> int:
        """Bytes between consecutive objects of a layer in a stream_layers destination."""
        from .layout import align_up
        return align_up(int(self.layout.object_nbytes[0]))

    def plan_pages(self, entries: list) -> "PagePlan":
        """Everything per page a layer-wise restore needs, built once per batch (vectorized)."""
        slots = np.array([e.slot for e in entries], dtype=np.int64)
        files, offsets = self._slot_files(slots)
        u = self.layout.geometry.units
        units = np.frombuffer(b"".join(e.units or bytes(8 * u) for e in entries), "<u8")
        must = np.array([self.cfg.verify or not e.fresh for e in entries], dtype=bool)
        return PagePlan(list(entries), slots, files, offsets, must, units.reshape(len(entries), u))

    def stream_layers(self, plan: "PagePlan", chunks: list, dsts: list) -> "LayerStream":
        """Read chunks [(layer, rows)] of the plan's pages back to back at the devices: chunk i's
        page j lands its layer's objects (K then V; MLA one) at dsts[i][j] + o * layer_object_stride()
        (uint64 per page, 4 KiB-aligned); a chunk's requests go out once LayerStream.allow admits
        it, queued behind the chunks before it. The caller holds the directories (`gate.reading`)
        for the stream's life. LayerStream.wait(i) -> ok per page: whole, and verified against
        the page's per-layer checksum where verification applies (computed as each page lands
        when objects are unpadded); corrupt pages are dropped from the index."""
        reqs = [self._layer_requests(plan, layer, d, rows) for (layer, rows), d in zip(chunks, dsts)]
        arrays = [np.concatenate([r[0][j] for r in reqs]) for j in range(4)]
        starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([len(r[0][0]) for r in reqs])
        verify = bool(reqs) and reqs[0][1] and bool(plan.must.any())
        groups = np.arange(starts[-1] + 1, dtype=np.int64) if verify else None  # one per page
        return LayerStream(self, plan, chunks, [r[0][3] for r in reqs],
                           self.engine.read_stream(*arrays, starts, groups), verify)

    def _layer_requests(self, plan: "PagePlan", layer: int, dst, rows):
        """(file, offset, nbytes, addr) of one request per page (its layer's objects are
        contiguous on disk), and whether the objects are unpadded (checksums as pages land)."""
        objs = self.layout.geometry.layer_objects(layer)
        k, stride = len(objs), self.layer_object_stride()
        files, offsets = plan.files[rows], plan.offsets[rows]
        n = len(files)
        args = (files, offsets + self.layout.object_offsets[objs[0]],
                np.full(n, k * stride, np.int64), np.asarray(dst, dtype=np.uint64))
        return args, stride == int(self.layout.object_nbytes[objs[0]])

    def _layer_ok(self, plan: "PagePlan", layer: int, rows, dst: np.ndarray, res: np.ndarray,
                  sums) -> np.ndarray:
        """ok per page of a layer read: whole, and its checksum matches where it must (sums
        None: computed here). Corrupt pages are dropped from the index."""
        objs = self.layout.geometry.layer_objects(layer)
        k, stride = len(objs), self.layer_object_stride()
        must, n = plan.must[rows], len(res)
        self._count_errors(res, "read")
        ok = res == k * stride
        if must.any():
            if sums is None:
                pieces = strided(dst, k, stride)
                sums = extension().checksum_groups(
                    pieces.ravel(), np.tile(self.layout.object_nbytes[list(objs)], n),
                    np.arange(0, n * k + 1, k, dtype=np.int64), self.cfg.threads)
            bad = must & ok & (sums != plan.units[rows, layer])
            if bad.any():
                self._drop_corrupt([e for e, b in zip(plan.entries[rows], bad) if b])
                ok &= ~bad
        return ok

    def _drop_corrupt(self, bad_entries) -> None:
        """Forget entries whose bytes failed their checksum. For a slot another process owns,
        the usual cause is that it reused the slot since our last re-scan (counted as stale and
        re-scanned); for our own slots it is damage (counted and logged)."""
        damaged = stale = 0
        with self._lock:
            for e in bad_entries:
                key = self.index.by_slot.get(e.slot)
                if e.owned:
                    damaged += 1
                    logger.warning("tutti: checksum mismatch in slot %d (key %s): dropped, "
                                   "served as a miss", e.slot, key)
                else:
                    stale += 1
                if key is not None and self.index.entries.get(key) is e:
                    self.index.drop(key)
            self._stats.checksum_failures += damaged
            self._stats.stale_foreign += stale
        if stale:
            self._request_rescan()

    def _unit_starts(self, n_pages: int) -> np.ndarray:
        """group_start over n pages' objects, one group per checksum unit (layer)."""
        m = len(self.layout.object_nbytes)
        return np.arange(0, n_pages * m + 1, self.layout.geometry.objects_per_unit, dtype=np.int64)

    def _page_sums(self, units: np.ndarray) -> np.ndarray:
        """Page checksum = XXH3-64 over the page's unit checksums (uint64 LE)."""
        u = np.ascontiguousarray(units, dtype="<u8").reshape(-1, self.layout.geometry.units)
        n = u.shape[0]
        return extension().checksum_groups(strided(u.ctypes.data, n, u.strides[0]), np.full(n, u.strides[0], np.int64),
                                           np.arange(n + 1, dtype=np.int64))

    def _checksums(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page checksums [n], unit checksums [n, units]) of pages in memory at addrs [n, m]."""
        n, m = addrs.shape
        units = extension().checksum_groups(
            addrs.ravel(), np.tile(self.layout.object_nbytes, n), self._unit_starts(n),
            self.cfg.threads).reshape(n, self.layout.geometry.units)
        return self._page_sums(units), units

    # ------------------------------------------------------------------- writes
    def write_pages(self, keys: list[str], addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Store pages not yet present; per page True when stored (or already there)."""
        t0 = time.perf_counter()
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        if not self.writer:
            return ok
        todo, reservations = self._reserve(keys, ok)
        if todo:
            idx = np.array(todo, dtype=np.int64)
            written = self._write_reserved(reservations, addrs[idx], aligned)
            ok[idx] = written
        stored = int(ok[todo].sum()) if todo else 0
        refused = n - len(todo) - int(ok.sum() - stored)  # no slot, unusable key
        self._account_write(len(todo) + refused, stored, time.perf_counter() - t0)
        return ok

    def _reserve(self, keys: list[str], ok: np.ndarray):
        todo, res = [], []
        with self._lock:
            for i, k in enumerate(keys):
                if header.encode_key(k) is None:
                    logger.warning("tutti: unusable key %r (not a non-empty str of <= %d bytes)",
                                   k, header.MAX_KEY_BYTES)
                    continue
                if k in self.index or k in self.index.reserved:
                    ok[i] = True
                    self.index.prefix_len([k])
                    self._stats.dedup_skips += 1
                    continue
                r = self._reserve_one(k)
                if r is not None:
                    todo.append(i)
                    res.append(r)
        return todo, res

    def _reserve_one(self, key: str):
        r = self.index.reserve(key, evict=False)
        while r is None and self._claim_next_row():
            r = self.index.reserve(key, evict=False)
        return r or self.index.reserve(key, evict=True)

    def _write_reserved(self, res: list, addrs: np.ndarray, aligned: bool) -> np.ndarray:
        """Write reserved slots; any exception gives every reservation back (nothing published)."""
        try:
            return self._write_reserved_io(res, addrs, aligned)
        except Exception:
            logger.exception("tutti: write of %d pages failed; not stored", len(res))
            with self._lock:
                for r in res:
                    if r.key in self.index.reserved:
                        self.index.abort(r)
            return np.zeros(len(res), dtype=bool)

    def _write_reserved_io(self, res: list, addrs: np.ndarray, aligned: bool) -> np.ndarray:
        n = len(res)
        slots = np.array([r.slot for r in res], dtype=np.int64)
        files, offsets = self._slot_files(slots)
        sums = np.zeros(n, dtype=np.uint64)
        units = np.zeros((n, self.layout.geometry.units), dtype=np.uint64)
        with self._lock:
            seqs = self._seq + 1 + np.arange(n, dtype=np.uint64)
            self._seq += n

        def payload(a: int, b: int) -> np.ndarray:
            # checksums inside the write window too, so their CPU time does not compete with reads
            sums[a:b], units[a:b] = self._checksums(addrs[a:b])
            return self._write_payloads(files[a:b], offsets[a:b], addrs[a:b], aligned)

        devs = self._devices(slots)
        good = self._gated(devs, n, HEADER_NBYTES,
                           lambda a, b: self._tombstone(res[a:b], files[a:b], offsets[a:b]))
        good &= self._gated(devs, n, self.layout.payload_nbytes, payload)
        self._sync(files[good])
        ok_so_far = good.copy()
        good &= self._gated(devs, n, HEADER_NBYTES, lambda a, b: self._write_headers(
            res[a:b], slots[a:b], files[a:b], offsets[a:b], sums[a:b], units[a:b], seqs[a:b],
            ok_so_far[a:b]))
        self._sync(files[good])
        units = units.astype("<u8")
        with self._lock:
            for i, (r, g) in enumerate(zip(res, good)):
                if g:
                    self.index.publish(r, int(sums[i]), int(seqs[i]), units[i].tobytes())
                else:
                    self.index.abort(r)
        return good

    def _gated(self, devices, n_pages: int, unit: int, write) -> np.ndarray:
        """Run write(a, b) -> ok[b-a] over pages [0, n_pages) in scheduler-sized chunks; all False
        when the write backlog refuses it."""
        ok = np.zeros(n_pages, dtype=bool)

        def run(offset: int, length: int) -> None:
            a, b = offset // unit, (offset + length) // unit
            ok[a:b] = write(a, b)

        if not self.gate.write(devices, n_pages * unit, run, unit=unit):
            logger.warning("tutti: write backlog full (tutti_write_backlog_mb): %d pages refused",
                           n_pages)
        return ok

    def _devices(self, slots: np.ndarray) -> frozenset:
        return self.placement.devices(slots)

    def _tombstone(self, res, files, offsets) -> np.ndarray:
        good = np.ones(len(res), dtype=bool)
        dirty = np.flatnonzero([r.dirty for r in res])
        if len(dirty):
            good[dirty] = self._write_tombstones(files[dirty], offsets[dirty])
        return good

    def _write_tombstones(self, files: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """All-zero headers at these slots (they read as free). Returns ok per slot."""
        out = self.engine.submit("write", files, offsets,
                                 np.full(len(files), HEADER_NBYTES, np.int64),
                                 np.full(len(files), self._zero.address, np.uint64))
        self._count_errors(out, "write")
        return out == HEADER_NBYTES

    def _write_payloads(self, files, offsets, addrs, aligned) -> np.ndarray:
        lay = self.layout
        n, m = addrs.shape
        if aligned:
            res = self.engine.submit("write", np.repeat(files, m),
                                    (offsets[:, None] + lay.object_offsets[None, :]).ravel(),
                                    np.tile(lay.object_nbytes, n), addrs.ravel())
            self._count_errors(res, "write")
            return (res.reshape(n, m) == lay.object_nbytes[None, :]).all(axis=1)
        with self._io_lock["w"]:
            stage = self._stage("w", n)
            base = strided(stage.address, n, lay.payload_nbytes)
            dst = lay.staged_objects(base)
            extension().memcpy_batch(dst.ravel(), addrs.ravel(), np.tile(lay.object_nbytes, n),
                                     self.cfg.threads)
            res = self.engine.submit("write", files, offsets + HEADER_NBYTES,
                                    np.full(n, lay.payload_nbytes, np.int64), base)
            self._count_errors(res, "write")
            return res == lay.payload_nbytes

    def _write_headers(self, res, slots, files, offsets, sums, units, seqs, good) -> np.ndarray:
        sel = np.flatnonzero(good)
        out = np.zeros(len(res), dtype=bool)
        if not len(sel):
            return out
        buf = extension().AlignedBuffer(len(sel) * HEADER_NBYTES)
        raw = np.frombuffer(buf, dtype=np.uint8).reshape(len(sel), HEADER_NBYTES)
        header.pack(raw, [header.encode_key(res[i].key) for i in sel], slots[sel], seqs[sel],
                    sums[sel], units[sel], self.fingerprint, int(self.layout.object_nbytes.sum()),
                    time.time_ns())
        w = self.engine.submit("write", files[sel], offsets[sel], np.full(len(sel), HEADER_NBYTES, np.int64),
                               strided(buf.address, len(sel), HEADER_NBYTES))
        self._count_errors(w, "write")
        out[sel] = w == HEADER_NBYTES
        return out

    def _sync(self, files: np.ndarray) -> None:
        if self.cfg.durability != "sync":
            return
        for f in np.unique(files):
            path = self._engine_paths.get(int(f))
            if path:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)

    # ------------------------------------------------------------ maintenance
    def clear(self) -> int:
        """Forget every page this process owns and tombstone their headers on disk.

        Pages published by other processes sharing the directories are left to them.
        Returns the number of pages dropped."""
        with self._lock:
            own = [(k, e.slot) for k, e in self.index.entries.items() if e.owned]
            for k, _ in own:
                self.index.drop(k)
            for k in [k for k, e in self.index.entries.items() if not e.owned]:
                self.index.forget_slot(self.index.entries[k].slot)
        if own:
            self._write_tombstones(*self._slot_files(np.array([s for _, s in own], dtype=np.int64)))
        return len(own)

    def check(self, repair: bool = False, chunk: int = 256, progress: bool = False) -> dict:
        """Verify every indexed page's payload checksum (fsck). With repair, bad pages owned by
        this process are dropped and their headers tombstoned. Returns counts."""
        from tqdm import tqdm
        with self._lock:
            items = [(k, e) for k, e in self.index.entries.items()]
        bad, checked = [], 0
        m = len(self.layout.object_nbytes)
        for i in tqdm(range(0, len(items), chunk), desc="fsck", unit="chunk", leave=False,
                      disable=not progress):
            part = items[i:i + chunk]
            stage = extension().AlignedBuffer(len(part) * self.layout.payload_nbytes)
            addrs = self.layout.staged_objects(
                strided(stage.address, len(part), self.layout.payload_nbytes))
            slots = np.array([e.slot for _, e in part], dtype=np.int64)
            ok, sums = self._read_slots(slots, addrs, aligned=False, checksum=False)
            sums = self._checksums(addrs.reshape(len(part), m))[0]
            for (k, e), good, c in zip(part, ok, sums):
                if not good or int(c) != e.checksum:
                    bad.append((k, e))
            checked += len(part)
        bad_headers = sorted(self._bad_header_slots)
        if repair:
            self._drop_corrupt([e for _, e in bad])
            own = [e.slot for _, e in bad if e.owned] + [s for s in bad_headers if self._owns(s)]
            if own:
                self._write_tombstones(*self._slot_files(np.array(own, dtype=np.int64)))
        return {"checked": checked, "bad": len(bad), "bad_keys": [k for k, _ in bad][:20],
                "bad_headers": len(bad_headers)}

    def _owns(self, slot: int) -> bool:
        return int(self.placement.locate([slot])[1][0]) in self._lock_fds

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._rescan_wanted.set()
        thread = getattr(self, "_rescan_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)  # a re-scan in flight finishes before the engine goes
        self.engine.close()
        for fds in self._lock_fds.values():
            for fd in fds:
                os.close(fd)
        self._lock_fds.clear()
        fd, path = getattr(self, "_writer_lock", (None, None))
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            self._writer_lock = (None, None)

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats.__dict__)
            s["bad_headers"] = s.pop("extra").get("bad_headers", 0)
            s.update({f"sched_{k}": v for k, v in self.gate.stats.items()})
            s.update(pages=len(self.index), evictions=self.index.evictions,
                     capacity_slots=self.capacity_slots, slot_nbytes=self.layout.slot_nbytes,
                     owned_rows=len(self._lock_fds))
        s["engine"] = self.engine.name
        s.update({f"engine_{k}": v for k, v in self.engine.counters().items()})
        return s

    def register_memory(self, regions: list[tuple[int, int]]) -> int:
        """Register host memory (the KV pool) with the engine for fixed-buffer I/O."""
        self._registered = list(regions)
        return self.engine.register_buffers(self._registered)

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

    def _account_write(self, n, good, seconds) -> None:
        with self._lock:
            s = self._stats
            s.write_pages += good
            s.write_failures += n - good
            s.write_bytes += good * self.layout.geometry.page_nbytes
            s.write_seconds += seconds

    def _count_errors(self, res: np.ndarray, what: str) -> None:
        bad = res < 0
        if bad.any():
            first = int(res[bad][0])
            with self._lock:
                self._stats.read_errors += int(bad.sum()) if what == "read" else 0
            logger.warning("tutti: %d %s request(s) failed (first: %s)", int(bad.sum()), what,
                           os.strerror(-first))

    def _stage(self, which: str, n_slots: int):
        need = max(1, n_slots) * self.layout.payload_nbytes
        buf = self._staging.get(which)
        if buf is None or buf.nbytes < need:
            buf = extension().AlignedBuffer(need)
            self._staging[which] = buf
        return buf

    def _slot_files(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d, row, off = self.placement.locate(slots)
        return self._file_table[d, row], off

