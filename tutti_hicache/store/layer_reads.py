"""Layer-wise reads of the store: one engine read stream over every layer of a batch of pages.

At a glance (ObjectStore.plan_pages / ObjectStore.stream_layers call these):
    plan = reads.plan(entries) -> PagePlan      per-page arrays, built once per batch (numpy)
    with reads.stream(plan, chunks, dsts, drop) as s:   the batch's directories are held for reads
        s.allow(n)                              admit chunks [0, n) to the devices
        s.admitted                              the chunks admitted so far
        s.wait(i) -> ok [pages of chunk i]      whole and verified (corrupt pages are dropped)
        s.settle(n)                             wait until chunks [0, n) landed (not consumed)
        s.lend(seconds)                         settle every admitted chunk, then lend the
                                                directories to writes for one window
    (leaving the with cancels and joins the stream, then releases the read hold)

chunks are [(layer, rows)] with rows a slice of the plan's pages; chunk i's page j lands that
layer's objects (K then V; MLA one) at dsts[i][j] + o * object_stride() (uint64, 4 KiB aligned).
A chunk's requests go out once allow() admits it, queued behind the chunks before it, so the
devices never drain between layers. Verification, where it applies, is per layer: against the
page's unit checksum, computed in C++ as each page lands when objects are unpadded.
Thread-safety: a stream belongs to the thread that opened it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from ..layout import Placement, SlotLayout, align_up, runs, strided
from .namespace import FileTable
from .scheduler import Gate, Lease
from .slot_io import SlotIO

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


@dataclass
class _Requests:
    """A stream's requests, chunk after chunk: requests [starts[i], starts[i + 1]) are chunk
    i's, one per page (plan index `pages`, layer `layers`)."""
    files: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    addrs: np.ndarray
    starts: np.ndarray
    pages: np.ndarray
    layers: np.ndarray
    unpadded: bool

    def expect(self, plan: PagePlan) -> np.ndarray:
        """Each request's expected checksum (its page's unit checksum of its layer)."""
        return np.ascontiguousarray(plan.units[self.pages, self.layers], dtype=np.uint64)


class _Expected:
    """What a chunk that landed whole and verified looks like, as bytes: wait() compares a
    chunk's results and checksums with it (two memcmp, the GIL kept) and takes the per-page
    path (layer_ok) only when they differ. Same verdict either way: a page is bad only where a
    result is short or, where it must be checked, a checksum differs."""

    def __init__(self, plan: PagePlan, req: _Requests, expect: Optional[np.ndarray]):
        self.starts = req.starts.tolist()
        self.whole = req.nbytes.astype(np.int32).tobytes()
        counts = np.zeros(len(req.pages) + 1, dtype=np.int64)
        counts[1:] = np.cumsum(plan.must[req.pages])  # pages that must be checked, up to each request
        self.must_any = (counts[req.starts[1:]] > counts[req.starts[:-1]]).tolist()
        # a chunk with pages that must be checked is whole only with C++'s checksums (expect)
        self.sums = expect.tobytes() if expect is not None else None
        self.ones = np.ones(np.diff(req.starts).max(initial=0), dtype=bool)
        self.ones.flags.writeable = False

    def whole_and_verified(self, i: int, res: np.ndarray, sums) -> bool:
        a, b = self.starts[i], self.starts[i + 1]
        if res.tobytes() != self.whole[4 * a:4 * b]:
            return False
        if not self.must_any[i]:
            return True
        return self.sums is not None and sums is not None and \
            sums.tobytes() == self.sums[8 * a:8 * b]


class LayerStream:
    """A running stream_layers read (see the module docstring)."""

    def __init__(self, reads: "LayerReads", plan: PagePlan, chunks: list, dsts: list, stream,
                 verify: bool, lease: Lease, drop: Callable[[list], None],
                 expected: Optional[_Expected] = None):
        self._reads, self._plan, self._chunks, self._dsts = reads, plan, chunks, dsts
        self._stream, self._verify, self._lease, self._drop = stream, verify, lease, drop
        self._expected = expected
        self._admitted = 0

    def allow(self, n: int) -> None:
        self._stream.allow(n)
        self._admitted = max(self._admitted, n)

    @property
    def admitted(self) -> int:
        return self._admitted

    def settle(self, n: int) -> None:
        for i in range(n):
            self._stream.wait(i)

    def wait(self, i: int) -> np.ndarray:
        return self.wait_whole(i)[0]

    def wait_whole(self, i: int) -> tuple[np.ndarray, bool]:
        """(wait(i), whether every page of chunk i is whole and verified)."""
        res, sums = self._stream.wait(i)
        if self._expected is not None and self._expected.whole_and_verified(
                i, res, sums if self._verify else None):
            whole, ok = True, self._expected.ones[:len(res)]
        else:
            layer, rows = self._chunks[i]
            ok, bad = self._reads.layer_ok(self._plan, layer, rows, self._dsts[i], res,
                                           sums if self._verify else None)
            if bad:
                self._drop(bad)
            whole = bool(ok.all())
        return ok, whole

    def done_ns(self) -> np.ndarray:
        """CLOCK_MONOTONIC ns at which each chunk's reads became final (0: not yet)."""
        return np.asarray(self._stream.done_ns(), dtype=np.int64)

    def lend(self, seconds: float) -> None:
        """Writes never overlap a read still in flight: settle what was admitted, then lend."""
        self.settle(self._admitted)
        self._lease.lend(seconds)

    def close(self) -> None:
        self._stream.cancel()
        try:
            self._stream.join()
        except Exception as e:  # OSError or a closed engine: already raised by wait()
            logger.debug("tutti: read stream ended with %s", e)


class LayerReads:
    def __init__(self, io: SlotIO, files: FileTable, layout: SlotLayout, placement: Placement,
                 gate: Gate, verify: bool):
        self._io, self._files, self._layout, self._placement = io, files, layout, placement
        self._gate, self._verify = gate, verify

    def object_stride(self) -> int:
        """Bytes between consecutive objects of a layer in a stream destination."""
        return align_up(int(self._layout.object_nbytes[0]))

    def plan(self, entries: list) -> PagePlan:
        slots = np.array([e.slot for e in entries], dtype=np.int64)
        files, offsets = self._files.slot_files(slots)
        u = self._layout.geometry.units
        units = np.frombuffer(b"".join(e.units or bytes(8 * u) for e in entries), "<u8")
        must = np.array([self._verify or not e.fresh for e in entries], dtype=bool)
        return PagePlan(list(entries), slots, files, offsets, must, units.reshape(len(entries), u))

    @contextlib.contextmanager
    def stream(self, plan: PagePlan, chunks: list, dsts: list,
               drop: Callable[[list], None]) -> Iterator[LayerStream]:
        """drop(entries): forget pages found corrupt (the store's index)."""
        with self._gate.reading(self._placement.devices(plan.slots)) as lease:
            req = self._requests(plan, chunks, dsts)
            verify = req.unpadded and bool(plan.must.any())  # checksums in C++ as pages land
            groups = np.arange(req.starts[-1] + 1, dtype=np.int64) if verify else None  # per page
            expect = req.expect(plan) if verify else None  # per request, for wait()
            stream = LayerStream(self, plan, chunks, list(dsts),
                                 self._io.engine.read_stream(req.files, req.offsets, req.nbytes,
                                                             req.addrs, req.starts, groups),
                                 verify, lease, drop, _Expected(plan, req, expect))
            try:
                yield stream
            finally:
                stream.close()  # nothing lands in the destinations after this

    def _requests(self, plan: PagePlan, chunks: list, dsts: list) -> "_Requests":
        """One request per page and chunk (a layer's objects of a page are contiguous on disk),
        built for every chunk at once: a few numpy operations per batch, not per chunk (each
        one over more than a few hundred elements lets the GIL go, and under a busy interpreter
        getting it back costs up to a switch interval)."""
        n = len(plan.entries)
        spans = [rows.indices(n) for _, rows in chunks]
        if any(step != 1 for _, _, step in spans):
            raise ValueError("stream_layers: chunk rows must be contiguous slices")
        sizes = np.array([max(0, stop - start) for start, stop, _ in spans], dtype=np.int64)
        starts, within = runs(sizes)
        firsts = np.array([start for start, _, _ in spans], dtype=np.int64)
        layers = [layer for layer, _ in chunks]
        objs = [self._layout.geometry.layer_objects(layer) for layer in layers]
        stride = self.object_stride()
        pages = within + np.repeat(firsts, sizes)
        first_off = np.array([self._layout.object_offsets[o[0]] for o in objs], dtype=np.int64)
        return _Requests(
            files=plan.files[pages], offsets=plan.offsets[pages] + np.repeat(first_off, sizes),
            nbytes=np.repeat(np.array([len(o) * stride for o in objs], dtype=np.int64), sizes),
            addrs=np.concatenate([np.asarray(d, dtype=np.uint64).ravel() for d in dsts])
            if dsts else np.zeros(0, np.uint64),
            starts=starts, pages=pages, layers=np.repeat(np.array(layers, dtype=np.int64), sizes),
            unpadded=bool(chunks) and stride == int(self._layout.object_nbytes[objs[0][0]]))

    def layer_ok(self, plan: PagePlan, layer: int, rows, dst: np.ndarray, res: np.ndarray,
                 sums) -> tuple[np.ndarray, list]:
        """(ok per page of a layer read: whole, and its checksum matches where it must (sums
        None: computed here); the entries of the corrupt pages)."""
        objs = self._layout.geometry.layer_objects(layer)
        k, stride = len(objs), self.object_stride()
        must = plan.must[rows]
        self._io.count_errors(res, "read")
        ok = res == k * stride
        corrupt: list = []
        if must.any():
            if sums is None:
                sums = self._io.layer_sums(strided(dst, k, stride),
                                           self._layout.object_nbytes[list(objs)])
            bad = must & ok & (sums != plan.units[rows, layer])
            if bad.any():
                corrupt = [e for e, b in zip(plan.entries[rows], bad) if b]
                ok &= ~bad
        return ok, corrupt
