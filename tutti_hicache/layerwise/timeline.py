"""`tutti_timeline_file`: one JSON line per layer-wise load, for tracing where a restore's time
goes; an observer (observe.py) of the counter, the loader and LayerwiseKV.

At a glance:
    tl = Timeline(write, times=None)    an Observer: one record per load, given to write(record)
                                        once finish returned; with times (windows.LayerTimes),
                                        the forwards' records too (below)
    trace = Trace()                     the loads' records kept in trace.loads (a benchmark's)
    f = TimelineFile(path_template)     "{pid}" in the template is replaced by the process id;
    f.write(record)                     appends json.dumps(record) + newline; never raises (tracing
                                        must not break loads): the first failure is logged once
    now_ns()                            CLOCK_MONOTONIC nanoseconds, the read stream's clock

A load's record holds, all in now_ns():
    index, start_ns                 the batch handed to the loader (LayerwiseKV.start)
    seq                             the load's number since the counter was made (the index
                                    restarts at every reset); a forward's record says it as
                                    forward_of
    complete_ns[layer]              the layer handed to the forward (its copy enqueued)
    wait_ns[layer] = [in, out]      the forward's wait_until(layer): entry and return (0, 0: never)
    finish_ns = [in, out]           finish_layer_wise_loading
    pages, chunk_layers, chunk_done_ns, loader_end_ns   from the loader: the pages loaded, each
                                    staging chunk's layer and the time its reads became final,
                                    the loader's end; error on failure
    lookup_ns = [in, out], load_ns  the linker's last lookup before the start (0, 0: none)
                                    and its first load call (0: none)
    begin_ns, opened_ns             the loader thread took the batch; its read stream was open
                                    (pages planned, directories held for reads)
With `times`, one record per loading forward once its CUDA events completed (written by the
`tutti-timeline` thread; windows.LayerTimes.report: the forward's own stream stalls and layer
times, `forward_of` its load's seq); one per forward without a load whose layers took at least
BARE_MIN_MS (`bare_after`: the last load's seq before it; a benchmark's compute-only twin is the
longest before the next load), its layer times alone; and the first offload call after a load's
finish (`offload_after`: that load's seq, `offload_ns`, `pages`).
tutti_hicache/benchmarks/timeline.py summarizes a file.
Thread-safety: records are created and dropped under a lock; each field has one writer (the
hook's thread); the forwards' records are written under a lock of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from ..statsfile import TimelineFile  # noqa: F401 - this module's API (statsfile.py holds it)
from .observe import Observer

logger = logging.getLogger("tutti_hicache.timeline")
BARE_MIN_MS = 20.0  # a forward without a load is written when its layers took this long


def now_ns() -> int:
    return time.monotonic_ns()  # CLOCK_MONOTONIC on Linux, as the read stream's done_ns


class Timeline(Observer):
    """The timeline's records (the module docstring), each given to `write` once complete."""

    def __init__(self, write: Callable[[dict], object], times=None):
        self._write = write
        self._recs: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._before = [0, 0, 0]  # the next load's last lookup (entry, return) and first load call
        self._finished_seq = -1  # the last load finish() returned for
        self._offload_marked = -1  # the load whose first offload after its finish was written
        self.times, self.bare = times, None
        if times is not None:
            times.report()  # keep the loading forwards' marks from now on
            # forwards without a load are marked too ("bare": the compute-only reference beside
            # the loading ones); only those of at least BARE_MIN_MS are written
            self.bare = type(times)(times.cuda)
            self.bare.report()
        self._reporter: Optional[threading.Thread] = None  # writes the forwards' records
        self._closed = False
        self._report_due = threading.Event()
        self._report_lock = threading.Lock()

    # ------------------------------------------------------------ a load's record
    def looked_up(self, begin_ns: int, end_ns: int) -> None:
        self._before[:2] = [begin_ns, end_ns]  # the last lookup before a load counts

    def load_called(self) -> None:
        if not self._before[2]:
            self._before[2] = now_ns()

    def started(self, index: int, seq: int, layers: int) -> None:
        rec = {"index": index, "seq": seq, "start_ns": now_ns(), "complete_ns": [0] * layers,
               "wait_ns": [[0, 0] for _ in range(layers)], "finish_ns": [0, 0],
               "lookup_ns": self._before[:2], "load_ns": self._before[2]}
        self._before = [0, 0, 0]
        with self._lock:
            self._recs[index] = rec

    def _set(self, index: int, **fields) -> None:
        rec = self._recs.get(index)
        if rec is not None:
            rec.update(fields)

    def load_begun(self, index: int, host_pages: int = 0, copied_pages: int = 0) -> None:
        self._set(index, begin_ns=now_ns(), host_pages=host_pages, copied_pages=copied_pages)

    def stream_opened(self, index: int) -> None:
        self._set(index, opened_ns=now_ns())

    def reads_final(self, index: int, pages: int, chunk_layers: list, done_ns) -> None:
        self._set(index, pages=pages, chunk_layers=list(chunk_layers),
                  chunk_done_ns=[int(t) for t in done_ns], loader_end_ns=now_ns())

    def layer_handed(self, index: int, layer: int) -> None:
        rec = self._recs.get(index)
        if rec is not None:
            rec["complete_ns"][layer] = now_ns()

    def failed(self, index: int, error: BaseException) -> None:
        self._set(index, error=repr(error))

    def waiting(self, index, layer: int) -> None:
        if index is None:
            if self.bare is not None and not self._capturing():
                self.bare.mark(layer)  # one CUDA event per layer, only with a timeline
            return
        rec = self._recs.get(index)
        if rec is not None and not rec["wait_ns"][layer][0]:
            rec["wait_ns"][layer][0] = now_ns()

    def waited(self, index, layer: int) -> None:
        rec = self._recs.get(index) if index is not None else None
        if rec is not None:
            rec["wait_ns"][layer][1] = now_ns()

    def finishing(self, index: int) -> None:
        self._set(index, finish_ns=[now_ns(), 0])

    def finished(self, index: int, seq: int) -> None:
        with self._lock:
            rec = self._recs.pop(index, None)
        if rec is None:
            return
        rec["finish_ns"][1] = now_ns()
        self._write(rec)
        self._finished_seq = seq
        if self.times is not None:
            # SGLang calls finish right after launching the batch's forward: its marks are all
            # recorded, and a thread writes its record once they completed on the GPU
            self.times.end_of(seq)
            self._reporter_wake()

    def offloaded(self, begin_ns: int, pages: int) -> None:
        """The first offload call after a load's finish (SGLang's scheduler thread has processed
        the loading batch's result by then: the first part of its TTFT after the load)."""
        seq = self._finished_seq
        if seq < 0 or seq == self._offload_marked:
            return
        self._offload_marked = seq
        self._write({"offload_after": seq, "offload_ns": [begin_ns, now_ns()], "pages": pages})

    def reset(self) -> None:
        with self._lock:
            self._recs.clear()

    # ------------------------------------------------------------ the forwards' records
    def forward_begun(self, index, seq: int) -> None:
        if self.bare is None:
            return
        if index is None and not self._capturing():
            self.bare.begin(0, 0, seq)  # forward_of: the last load before it
        else:
            self.bare.end()
        if self._reporter is not None:
            self._report_due.set()

    def _capturing(self) -> bool:  # a CUDA graph capture (SGLang's graphs): nothing recorded
        return self.bare.cuda and torch.cuda.is_current_stream_capturing()

    def _reporter_wake(self) -> None:
        with self._lock:
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report_loop, daemon=True,
                                                  name="tutti-timeline")
                self._reporter.start()
        self._report_due.set()

    def _report_loop(self) -> None:
        while True:
            self._report_due.wait()
            self._report_due.clear()
            if self._closed:
                return
            self.report_forwards(wait=True)

    def close(self) -> None:
        """The thread ends; every forward's record is written (the current forward ends)."""
        self._closed = True
        self._report_due.set()
        if self._reporter is not None:
            self._reporter.join(timeout=60)
        self.report_forwards(final=True)

    def report_forwards(self, final: bool = False, wait: bool = False) -> None:
        """Records of the forwards that loaded, once their marks completed: where each one's
        stream waited for a layer and how long each layer computed (windows.LayerTimes.report).
        At finish() a batch's own forward is usually still running on the GPU: the
        `tutti-timeline` thread waits for its marks (wait) and writes it; at close (final) the
        current forward ends, and every record is written, waiting for its marks."""
        if self.times is None:
            return
        with self._report_lock:  # the thread and close: each record once, in order
            try:  # tracing never breaks a load or a close
                if final:
                    self.times.end()
                for rec in self.times.report(wait=final or wait):
                    self._write(rec)
                if final:
                    self.bare.end()
                for rec in self.bare.report(wait=final or wait):
                    if sum(rec["span_ms"]) >= BARE_MIN_MS:  # prefills, not decode steps
                        self._write({"bare_after": rec["forward_of"], "clock": rec["clock"],
                                     "span_ms": rec["span_ms"]})
            except Exception:  # e.g. a CUDA error surfacing in an event query
                logger.exception("tutti: the forwards' timeline records were not written")


class Trace(Timeline):
    """A benchmark's timeline: every load's record kept in memory (`loads`, in finish order), no
    forwards' records."""

    def __init__(self):
        self.loads: list = []
        super().__init__(self.loads.append)
