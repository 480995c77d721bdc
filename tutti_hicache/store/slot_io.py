"""Engine batches over slots: page reads and writes, headers, tombstones, checksums, fdatasync.

At a glance (every call is one or a few engine batches; no index, no policy):
    io = SlotIO(engine, files, layout, placement, cfg, gate, fingerprint)
    io.read(slots, addrs, aligned, checksum) -> (ok [n], page checksums [n] | None)
    a write batch in publication order, in three steps:
    io.begin(keys, slots, dirty, seqs) -> Landed    tombstones of reused slots
    io.land(landed, sel, addrs, aligned)            payloads of pages sel (one call or chunks)
    io.headers([Landed, ...]) -> [ok, ...]          their headers in one batch: now visible
    io.write_payloads(files, offsets, addrs, aligned) -> ok [n]
    io.write_headers(keys, slots, files, offsets, sums, units, seqs) -> ok [n]
    io.tombstones(files, offsets) -> ok [n]        all-zero headers: the slots read as free
    io.checksums(addrs) -> (page [n], unit [n, units])   of pages in memory
    io.page_sums(units), io.unit_starts(n_pages)
    io.sync(files)                                  fdatasync when tutti_durability=sync
    io.close()                                      ends the checksum helper threads
    io.count_errors(res, "read" | "write")          log failed requests (reads are counted)
    io.wear                                         bytes written per directory (wear.py)

`addrs` is a uint64 array [n_pages, objects_per_page] of host addresses, one per object in
on-disk order. aligned: every address and object size is a multiple of 4 KiB, so objects move
straight between disk and memory (O_DIRECT, zero copy); otherwise whole slot payloads go through
an aligned bounce buffer and C++ copies the pieces (memcpy_batch).
Thread-safety: each bounce buffer has one lock per direction; read_errors has its own lock.
Reads hold their directories in the scheduler (`gate.reading`); writes are gated by the caller.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import header
from ..config import TuttiConfig
from ..engine import extension
from ..layout import HEADER_NBYTES, Placement, SlotLayout, strided
from .namespace import FileTable
from .scheduler import Gate
from .wear import Wear

logger = logging.getLogger("tutti_hicache.store")


@dataclass
class Landed:
    """Pages of reserved slots on their way to publication (SlotIO.begin, land, headers),
    invisible to every reader until SlotIO.headers writes their headers. ready: per page, its
    tombstone (reused slot) written; landed: ready and its payload written."""
    keys: list
    slots: np.ndarray
    files: np.ndarray
    offsets: np.ndarray
    seqs: np.ndarray
    sums: np.ndarray  # page checksums
    units: np.ndarray  # [n, units] little-endian
    landed: np.ndarray
    ready: np.ndarray


class SlotIO:
    def __init__(self, engine, files: FileTable, layout: SlotLayout, placement: Placement,
                 cfg: TuttiConfig, gate: Gate, fingerprint: bytes):
        self.engine = engine
        self._files, self._layout, self._placement, self._gate = files, layout, placement, gate
        self._threads, self._durability = cfg.threads, cfg.durability
        self._fingerprint = fingerprint
        self._bounce_lock = {"r": threading.Lock(), "w": threading.Lock()}
        self._bounce: dict[str, object] = {}  # "r" / "w" -> AlignedBuffer, grown on demand
        self._zero = extension().AlignedBuffer(HEADER_NBYTES)
        self._errors_lock = threading.Lock()  # also guards _pool
        self.read_errors = 0
        self.wear = Wear(files.ns_dirs, files.dirs_of, cfg.drive_capacity_gb)
        self._pool: ThreadPoolExecutor | None = None  # payload checksums beside their writes
        # one checksum thread per concurrent writer (the linker's tutti_offload_writers chunk
        # writes, or SGLang's backup thread and a promotion): with one, their checksums take turns
        self._checksum_workers = max(2, cfg.offload_writers)

    # -------------------------------------------------------------------- reads
    def read(self, slots: np.ndarray, addrs: np.ndarray, aligned: bool, checksum: bool):
        """Read slots into addrs [n, m]. Returns (ok per page, checksums per page or None).

        On the zero-copy path each page's checksum is computed as soon as its reads land,
        while the rest of the batch is still in flight."""
        files, offsets = self._files.slot_files(slots)
        lay = self._layout
        n, m = addrs.shape
        devices = self._placement.devices(slots)
        if aligned:
            args = (np.repeat(files, m), (offsets[:, None] + lay.object_offsets[None, :]).ravel(),
                    np.tile(lay.object_nbytes, n), addrs.ravel())
            with self._gate.reading(devices):
                if checksum:
                    res, units = self.engine.submit("read", *args, self.unit_starts(n))
                    sums = self.page_sums(units)
                else:
                    res, sums = self.engine.submit("read", *args), None
            self.count_errors(res, "read")
            return (res.reshape(n, m) == lay.object_nbytes[None, :]).all(axis=1), sums
        with self._bounce_lock["r"]:
            base = strided(self._bounce_for("r", n).address, n, lay.payload_nbytes)
            with self._gate.reading(devices):
                res = self.engine.submit("read", files, offsets + HEADER_NBYTES,
                                         np.full(n, lay.payload_nbytes, np.int64), base)
            good = res == lay.payload_nbytes
            self.count_errors(res, "read")
            src = lay.staged_objects(base)
            sums = self.checksums(src)[0] if checksum else None
            sel = np.flatnonzero(good)
            extension().memcpy_batch(addrs[sel].ravel(), src[sel].ravel(),
                                     np.tile(lay.object_nbytes, len(sel)), self._threads)
            return good, sums

    # ------------------------------------------------------------------- writes
    def begin(self, keys: list[str], slots: np.ndarray, dirty: list[bool],
              seqs: np.ndarray) -> "Landed":
        """A publication's first step, in scheduler-sized chunks (gate.write): the tombstones of
        reused (dirty) slots, which lose their old headers before any payload overwrites them.
        Then land() writes payloads (all at once, or a caller's chunks one by one) and headers()
        makes what landed visible: the slots stay invisible until then."""
        n = len(keys)
        files, offsets = self._files.slot_files(slots)

        def tombstones(a: int, b: int) -> np.ndarray:
            good = np.ones(b - a, dtype=bool)
            reused = np.flatnonzero(dirty[a:b])
            if len(reused):
                good[reused] = self.tombstones(files[a:b][reused], offsets[a:b][reused])
            return good

        if any(dirty):
            ready = self._gated(self._placement.devices(slots), n, HEADER_NBYTES, tombstones)
        else:  # nothing to tombstone: no write window to wait for, no backlog to be refused by
            ready = np.ones(n, dtype=bool)
        return Landed(list(keys), np.asarray(slots), files, offsets, np.asarray(seqs),
                      np.zeros(n, dtype=np.uint64),
                      np.zeros((n, self._layout.geometry.units), dtype="<u8"),
                      np.zeros(n, dtype=bool), ready)

    def land(self, x: "Landed", sel: np.ndarray, addrs: np.ndarray, aligned: bool) -> None:
        """Payloads of x's pages `sel` (indices into x) from addrs [len(sel), m], checksummed
        inside the write window -> fdatasync (sync durability); sets their sums, units and
        landed flags. Calls on disjoint `sel` may run at once (a linker offload's chunks).
        Only ready pages are written: a reused slot whose tombstone was refused or failed still
        holds the evicted page's valid header, which must never end up over another page's
        bytes; it stays unlanded (headers() skips it, the caller gives its slot back)."""
        keep = x.ready[sel]
        sel, addrs = sel[keep], addrs[keep]
        if not len(sel):
            return
        files, offsets = x.files[sel], x.offsets[sel]
        sums = np.zeros(len(sel), dtype=np.uint64)
        units = np.zeros((len(sel), self._layout.geometry.units), dtype=np.uint64)

        def payload(a: int, b: int) -> np.ndarray:
            # checksums inside the write window too, so their CPU time does not compete with
            # reads; on a helper thread while the chunk's writes are in flight (both read memory)
            done = self._helper().submit(self.checksums, addrs[a:b])
            try:
                ok = self.write_payloads(files[a:b], offsets[a:b], addrs[a:b], aligned)
            finally:
                sums[a:b], units[a:b] = done.result()
            return ok

        good = self._gated(self._placement.devices(x.slots[sel]), len(sel),
                           self._layout.payload_nbytes, payload)
        self.sync(files[good])
        x.sums[sel], x.units[sel] = sums, units
        x.landed[sel] = good

    def headers(self, landings: list) -> list:
        """The second half: the headers of every landed slot of `landings` in one gated batch,
        which makes them visible -> fdatasync (sync durability). Returns ok per page of each."""
        if sum(len(x.keys) for x in landings) == 0:
            return [np.zeros(0, dtype=bool) for _ in landings]
        cat = lambda f: np.concatenate([f(x) for x in landings])
        keys = [k for x in landings for k in x.keys]
        slots, files, offsets = cat(lambda x: x.slots), cat(lambda x: x.files), cat(lambda x: x.offsets)
        seqs, sums, landed = cat(lambda x: x.seqs), cat(lambda x: x.sums), cat(lambda x: x.landed)
        units = np.concatenate([x.units for x in landings])

        def write(a: int, b: int) -> np.ndarray:
            out = np.zeros(b - a, dtype=bool)
            sel = a + np.flatnonzero(landed[a:b])
            out[sel - a] = self.write_headers([header.encode_key(keys[i]) for i in sel],
                                              slots[sel], files[sel], offsets[sel], sums[sel],
                                              units[sel], seqs[sel])
            return out

        good = self._gated(self._placement.devices(slots), len(keys), HEADER_NBYTES, write)
        self.sync(files[good])
        self.wear.stored(files[good], self._layout.geometry.page_nbytes)
        return np.split(good, np.cumsum([len(x.keys) for x in landings])[:-1])

    def _gated(self, devices, n_pages: int, unit: int, write) -> np.ndarray:
        """Run write(a, b) -> ok[b-a] over pages [0, n_pages) in scheduler-sized chunks; all False
        when the write backlog refuses it."""
        ok = np.zeros(n_pages, dtype=bool)

        def run(offset: int, length: int) -> None:
            a, b = offset // unit, (offset + length) // unit
            ok[a:b] = write(a, b)

        if not self._gate.write(devices, n_pages * unit, run, unit=unit):
            logger.warning("tutti: write backlog full (tutti_write_backlog_mb): %d pages refused",
                           n_pages)
        return ok

    def write_payloads(self, files, offsets, addrs, aligned) -> np.ndarray:
        lay = self._layout
        n, m = addrs.shape
        if aligned:
            res = self.engine.submit("write", np.repeat(files, m),
                                     (offsets[:, None] + lay.object_offsets[None, :]).ravel(),
                                     np.tile(lay.object_nbytes, n), addrs.ravel())
            self.count_errors(res, "write")
            self.wear.wrote("payload", files, res)
            return (res.reshape(n, m) == lay.object_nbytes[None, :]).all(axis=1)
        with self._bounce_lock["w"]:
            base = strided(self._bounce_for("w", n).address, n, lay.payload_nbytes)
            dst = lay.staged_objects(base)
            extension().memcpy_batch(dst.ravel(), addrs.ravel(), np.tile(lay.object_nbytes, n),
                                     self._threads)
            res = self.engine.submit("write", files, offsets + HEADER_NBYTES,
                                     np.full(n, lay.payload_nbytes, np.int64), base)
            self.count_errors(res, "write")
            self.wear.wrote("payload", files, res)
            return res == lay.payload_nbytes

    def write_headers(self, keys: list[bytes], slots, files, offsets, sums, units,
                      seqs) -> np.ndarray:
        """Pack and write the headers that publish these slots (keys UTF-8 encoded)."""
        n = len(keys)
        if not n:
            return np.zeros(0, dtype=bool)
        buf = extension().AlignedBuffer(n * HEADER_NBYTES)
        raw = np.frombuffer(buf, dtype=np.uint8).reshape(n, HEADER_NBYTES)
        header.pack(raw, keys, slots, seqs, sums, units, self._fingerprint,
                    int(self._layout.object_nbytes.sum()), time.time_ns())
        w = self.engine.submit("write", files, offsets, np.full(n, HEADER_NBYTES, np.int64),
                               strided(buf.address, n, HEADER_NBYTES))
        self.count_errors(w, "write")
        self.wear.wrote("header", files, w)
        return w == HEADER_NBYTES

    def tombstones(self, files: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """All-zero headers at these slots (they read as free). Returns ok per slot."""
        out = self.engine.submit("write", files, offsets,
                                 np.full(len(files), HEADER_NBYTES, np.int64),
                                 np.full(len(files), self._zero.address, np.uint64))
        self.count_errors(out, "write")
        self.wear.wrote("tombstone", files, out)
        return out == HEADER_NBYTES

    def sync(self, files: np.ndarray) -> None:
        if self._durability != "sync":
            return
        paths = self._files.paths()
        for f in np.unique(files):
            path = paths.get(int(f))
            if path:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)

    # ---------------------------------------------------------------- checksums
    def unit_starts(self, n_pages: int) -> np.ndarray:
        """group_start over n pages' objects, one group per checksum unit (layer)."""
        m = len(self._layout.object_nbytes)
        return np.arange(0, n_pages * m + 1, self._layout.geometry.objects_per_unit, dtype=np.int64)

    def page_sums(self, units: np.ndarray) -> np.ndarray:
        """Page checksum = XXH3-64 over the page's unit checksums (uint64 LE)."""
        u = np.ascontiguousarray(units, dtype="<u8").reshape(-1, self._layout.geometry.units)
        n = u.shape[0]
        return extension().checksum_groups(strided(u.ctypes.data, n, u.strides[0]),
                                           np.full(n, u.strides[0], np.int64),
                                           np.arange(n + 1, dtype=np.int64))

    def checksums(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page checksums [n], unit checksums [n, units]) of pages in memory at addrs [n, m]."""
        n, m = addrs.shape
        units = extension().checksum_groups(
            addrs.ravel(), np.tile(self._layout.object_nbytes, n), self.unit_starts(n),
            self._threads).reshape(n, self._layout.geometry.units)
        return self.page_sums(units), units

    def layer_sums(self, pieces: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """One checksum per row of pieces [n, k] (a page's objects of one layer) of nbytes [k]."""
        n, k = pieces.shape
        return extension().checksum_groups(pieces.ravel(), np.tile(nbytes, n),
                                           np.arange(0, n * k + 1, k, dtype=np.int64), self._threads)

    # --------------------------------------------------------------- internals
    def count_errors(self, res: np.ndarray, what: str) -> None:
        bad = res < 0
        if bad.any():
            first = int(res[bad][0])
            if what == "read":
                with self._errors_lock:
                    self.read_errors += int(bad.sum())
            logger.warning("tutti: %d %s request(s) failed (first: %s)", int(bad.sum()), what,
                           os.strerror(-first))

    def _helper(self) -> ThreadPoolExecutor:
        with self._errors_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._checksum_workers,
                                                thread_name_prefix="tutti-checksum")
            return self._pool

    def close(self) -> None:
        """End the checksum helper threads (the store's close)."""
        with self._errors_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _bounce_for(self, which: str, n_slots: int):
        need = max(1, n_slots) * self._layout.payload_nbytes
        buf = self._bounce.get(which)
        if buf is None or buf.nbytes < need:
            buf = extension().AlignedBuffer(need)
            self._bounce[which] = buf
        return buf
