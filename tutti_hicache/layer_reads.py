"""Layer-wise reads of the store: one engine read stream over every layer of a batch of pages.

At a glance (ObjectStore.plan_pages / ObjectStore.stream_layers call these):
    plan = reads.plan(entries) -> PagePlan      per-page arrays, built once per batch (numpy)
    with reads.stream(plan, chunks, dsts, drop) as s:   the batch's directories are held for reads
        s.allow(n)                              admit chunks [0, n) to the devices
        s.allow_after(device, cuda_stream, n)   the same, once a CUDA stream got there
        s.wait(i) -> ok [pages of chunk i]      whole and verified (corrupt pages are dropped)
        s.settle(n)                             wait until chunks [0, n) landed (not consumed)
        s.lend(seconds)                         settle every admitted chunk, then lend the
                                                directories to writes for one window
    (leaving the with cancels and joins the stream, then releases the read hold)
    reads.stream(..., gate=(release, verified))  a completion gate (two int32 words): chunk i
        passed (whole and verified) -> both words reach i + 1, in chunk order; a chunk failing
        or the stream ending early -> release = GATE_TERMINAL (every GPU wait returns) and
        verified stays below it. Written by the C++ stream as chunks land; by wait() here only
        where the checksum is computed in Python (padded objects).
    reads.stream(..., ahead=k)                  a read-ahead window: of the admitted chunks, at
        most k past the leading run of final ones are at the devices (0: no window; the first
        chunk not yet final always goes)

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

from .engine import extension
from .layout import Placement, SlotLayout, align_up, strided
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


class LayerStream:
    """A running stream_layers read (see the module docstring)."""

    def __init__(self, reads: "LayerReads", plan: PagePlan, chunks: list, dsts: list, stream,
                 verify: bool, lease: Lease, drop: Callable[[list], None], py_gate=None):
        self._reads, self._plan, self._chunks, self._dsts = reads, plan, chunks, dsts
        self._stream, self._verify, self._lease, self._drop = stream, verify, lease, drop
        self._py_gate = py_gate  # (release, verified) this thread advances, or None
        self._admitted = 0

    def allow(self, n: int) -> None:
        self._stream.allow(n)
        self._admitted = max(self._admitted, n)

    def allow_after(self, device: int, cuda_stream: int, n: int) -> None:
        """Admit chunks [0, n) once the CUDA stream reaches this point (a host function on it:
        no thread of ours, and no GIL, takes part in admitting them)."""
        extension().stream_allow_after(self._stream, device, cuda_stream, n)
        self._admitted = max(self._admitted, n)

    def settle(self, n: int) -> None:
        for i in range(n):
            self._stream.wait(i)

    def wait(self, i: int) -> np.ndarray:
        res, sums = self._stream.wait(i)
        layer, rows = self._chunks[i]
        ok, bad = self._reads.layer_ok(self._plan, layer, rows, self._dsts[i], res,
                                       sums if self._verify else None)
        if bad:
            self._drop(bad)
        if self._py_gate is not None:
            gate_release(self._py_gate, i + 1 if ok.all() else None)
        return ok

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
        if self._py_gate is not None and gate_value(self._py_gate[0]) != len(self._chunks):
            gate_release(self._py_gate, None)


def gate_value(address: int) -> int:
    return int(extension().gate_load(address))


def gate_release(gate: tuple, n: Optional[int]) -> None:
    """Advance a gate (release, verified) to n passed chunks, or (None) release every wait with
    the terminal value, verified unchanged."""
    ext = extension()
    if n is None:
        ext.gate_store(gate[0], ext.GATE_TERMINAL)
        return
    ext.gate_store(gate[1], n)  # the kernels' check first, then what the GPU waits on
    ext.gate_store(gate[0], n)


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
    def stream(self, plan: PagePlan, chunks: list, dsts: list, drop: Callable[[list], None],
               gate: Optional[tuple] = None, ahead: int = 0) -> Iterator[LayerStream]:
        """drop(entries): forget pages found corrupt (the store's index). gate: (release,
        verified) host addresses of a completion gate; ahead: the read-ahead window (both: the
        module docstring)."""
        with self._gate.reading(self._placement.devices(plan.slots)) as lease:
            reqs = [self._requests(plan, layer, d, rows) for (layer, rows), d in zip(chunks, dsts)]
            arrays = [np.concatenate([r[0][j] for r in reqs]) for j in range(4)]
            starts = np.zeros(len(chunks) + 1, dtype=np.int64)
            starts[1:] = np.cumsum([len(r[0][0]) for r in reqs])
            verify = bool(reqs) and reqs[0][1] and bool(plan.must.any())
            groups = np.arange(starts[-1] + 1, dtype=np.int64) if verify else None  # one per page
            native, py_gate = self._gate_spec(plan, chunks, gate, verify)
            stream = LayerStream(self, plan, chunks, [r[0][3] for r in reqs],
                                 self._io.engine.read_stream(*arrays, starts, groups, native,
                                                             ahead),
                                 verify, lease, drop, py_gate)
            try:
                yield stream
            finally:
                stream.close()  # nothing lands in the destinations after this

    @staticmethod
    def _gate_spec(plan: PagePlan, chunks: list, gate: Optional[tuple], verify: bool) -> tuple:
        """(the C++ stream's gate, or None; the gate this thread advances, or None). The stream
        checks what it can: results always, checksums where it computes them (verify: one
        group per page, in chunk order); pages that need a checksum computed in Python leave
        the gate to wait() here."""
        if gate is None:
            return None, None
        if verify:
            expect = np.concatenate([plan.units[rows, layer] for layer, rows in chunks])
            must = np.concatenate([plan.must[rows] for _, rows in chunks])
            return (gate[0], gate[1], expect.astype(np.uint64), must.astype(np.uint8)), None
        if not plan.must.any():
            return (gate[0], gate[1], np.zeros(0, np.uint64), np.zeros(0, np.uint8)), None
        return None, gate

    def _requests(self, plan: PagePlan, layer: int, dst, rows):
        """(file, offset, nbytes, addr) of one request per page (its layer's objects are
        contiguous on disk), and whether the objects are unpadded (checksums as pages land)."""
        objs = self._layout.geometry.layer_objects(layer)
        k, stride = len(objs), self.object_stride()
        files, offsets = plan.files[rows], plan.offsets[rows]
        n = len(files)
        args = (files, offsets + self._layout.object_offsets[objs[0]],
                np.full(n, k * stride, np.int64), np.asarray(dst, dtype=np.uint64))
        return args, stride == int(self._layout.object_nbytes[objs[0]])

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
