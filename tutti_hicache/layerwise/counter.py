"""SGLang's layer counter for a layer-wise restore, ordered on the GPU.

At a glance:
    counter = LayerCounter(num_layers, times=None)
    counter.update_producer() -> index      [scheduler] a new batch (start_layer_wise_loading)
    counter.describe(index, n_input, n_prefix)   [scheduler] its shape, for the write windows
    counter.complete(index, layer, event)   [loader] layer enqueued; event: its copy on the GPU
    counter.fail(index, error)              [loader] every wait returns; finish() reports False
    counter.set_consumer(index), counter.wait_until(layer)   [forward] SGLang's interface
    counter.finish(index) -> bool           [scheduler] every layer landed (events synchronized)
    counter.annotate(index, **fields)       [loader] adds to the batch's timeline record
    counter.reset()

wait_until(l) blocks the CPU only until layer l's copy is enqueued, then makes the current CUDA
stream wait on that copy's event (no CPU stall). A failed load sets every layer, so the forward
never hangs; it runs on wrong bytes that finish() then refuses (SGLang aborts the requests).
Thread-safety: batches are created and removed under a lock; complete/fail only set a batch's
threading.Events, which finish() waits for before it removes the batch. `consumer_index` and
`waited` are single ints written by the forward's thread and read by the loader (a heuristic
for slack windows, never for correctness). `times` (windows.LayerTimes) is told where the forward is
(set_consumer, and around each wait), for write windows learned online; never for correctness.
`timeline` (timeline.TimelineFile, tutti_timeline_file) gets one record per batch at finish():
when it started, each layer was handed over, the forward waited for it, and finish ran; and,
with `times`, one record per loading forward once its CUDA events completed (report_forwards):
the forward's own stream stalls and layer times; and one per forward without a load whose layers
took at least BARE_MIN_MS (`bare_after`: the last load's seq before it; the compute-only twin of a
benchmark's point is the longest before the next load), its layer times alone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .timeline import now_ns

logger = logging.getLogger("tutti_hicache.timeline")
BARE_MIN_MS = 20.0  # a forward without a load is written when its layers took this long


@dataclass
class _Batch:
    """Per-batch layer state: CPU flags for "enqueued", CUDA events for "landed"."""
    layers: int
    enqueued: list = field(default_factory=list)
    events: list = field(default_factory=list)
    error: Optional[BaseException] = None
    shape: tuple = (0, 0)  # (new tokens, loaded prefix tokens), for the write windows' timing
    rec: Optional[dict] = None  # the timeline record, when one is kept
    seq: int = 0  # the counter's loads numbered from its creation (reset() keeps counting)

    def __post_init__(self):
        self.enqueued = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers


class LayerCounter:
    """SGLang's layer counter interface (num_layers, consumer_index, set_consumer, wait_until),
    ordered on the GPU: wait_until(l) blocks the CPU only until layer l's copy is enqueued,
    then makes the current stream wait on that copy's event."""

    def __init__(self, num_layers: int, times=None, timeline=None):
        self.num_layers = num_layers
        self.times = times  # windows.LayerTimes: the forward's progress, for write windows
        self.timeline = timeline  # timeline.TimelineFile, or None
        # with a timeline, forwards without a load are marked too ("bare": the compute-only
        # reference beside the loading ones); only those of at least BARE_MIN_MS are written
        self.bare = None
        if timeline is not None and times is not None:
            times.report()  # keep the loading forwards' marks from now on, for the timeline
            self.bare = type(times)(times.cuda)
            self.bare.report()
        self.consumer_index = -1
        self.producer_index = -1
        self.waited = -1  # last layer the forward waited for (its progress)
        self._batches: dict[int, _Batch] = {}
        self._lock = threading.Lock()
        self._seq = -1  # the timeline's load numbers: the index restarts at every reset()
        self._finished_seq = -1  # the last load finish() returned for (timeline only)
        self._offload_marked = -1  # the load whose first offload after its finish was written
        self._reporter: Optional[threading.Thread] = None  # writes the forwards' records
        self._report_due = threading.Event()
        self._report_lock = threading.Lock()

    def update_producer(self) -> int:
        with self._lock:
            self.producer_index += 1
            self._seq += 1
            b = self._batches[self.producer_index] = _Batch(self.num_layers, seq=self._seq)
            if self.timeline is not None:
                n = self.num_layers
                b.rec = {"index": self.producer_index, "seq": self._seq, "start_ns": now_ns(),
                         "complete_ns": [0] * n,
                         "wait_ns": [[0, 0] for _ in range(n)], "finish_ns": [0, 0]}
            return self.producer_index

    def annotate(self, index: int, **fields) -> None:
        b = self._batches.get(index)
        if b is not None and b.rec is not None:
            b.rec.update(fields)

    def describe(self, index: int, n_input: int, n_prefix: int) -> None:
        self._batches[index].shape = (n_input, n_prefix)

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index
        self.waited = -1
        if self.times is not None:
            b = self._batches.get(index)
            if b is None:
                self.times.end()
            else:
                self.times.begin(*b.shape, b.seq)
            if self.bare is not None:
                if b is None and not self._capturing():
                    self.bare.begin(0, 0, self._seq)  # forward_of: the last load before it
                else:
                    self.bare.end()
                if self._reporter is not None:
                    self._report_due.set()

    def _capturing(self) -> bool:  # a CUDA graph capture (SGLang's graphs): nothing recorded
        return self.bare.cuda and torch.cuda.is_current_stream_capturing()

    def complete(self, index: int, layer: int, event=None) -> None:
        b = self._batches[index]
        b.events[layer] = event
        if b.rec is not None:
            b.rec["complete_ns"][layer] = now_ns()
        b.enqueued[layer].set()

    def fail(self, index: int, error: BaseException) -> None:
        b = self._batches.get(index)
        if b is None:
            return
        b.error = b.error or error
        if b.rec is not None:
            b.rec["error"] = repr(b.error)
        for ev in b.enqueued:
            ev.set()  # the forward runs on (wrong) bytes; finish() reports the failure

    def wait_until(self, layer: int) -> None:
        self.waited = layer
        b = self._batches.get(self.consumer_index)
        if b is None:
            if self.bare is not None and not self._capturing():
                self.bare.mark(layer)  # one CUDA event per layer, only with a timeline
            return
        t, w = self.times, (b.rec["wait_ns"][layer] if b.rec is not None else None)
        if w is not None and not w[0]:
            w[0] = now_ns()
        if t is not None:
            t.arrive(layer)  # the previous layer's compute ends here
        b.enqueued[layer].wait()
        if b.events[layer] is not None:
            torch.cuda.current_stream().wait_event(b.events[layer])
        if t is not None:
            t.passed(layer)  # and this layer's starts here, once its KV landed
        if w is not None:
            w[1] = now_ns()

    def finish(self, index: int) -> bool:
        """Wait until every layer of batch `index` has landed in device memory."""
        b = self._batches.get(index)
        if b is None:
            return True
        t0 = now_ns()
        for ev in b.enqueued:
            ev.wait()
        for ev in b.events:
            if ev is not None:
                ev.synchronize()
        with self._lock:
            del self._batches[index]
        if b.rec is not None:
            b.rec["finish_ns"] = [t0, now_ns()]
            self.timeline.write(b.rec)
            self._finished_seq = b.seq
            if self.times is not None:
                # SGLang calls finish right after launching the batch's forward: its marks are
                # all recorded, and a thread writes its record once they completed on the GPU
                self.times.end_of(b.seq)
                self._reporter_wake()
        return b.error is None

    def offloaded(self, t0: int, pages: int) -> None:
        """An offload call (SGLang's scheduler thread) that began at t0: the first after a load's
        finish is written to the timeline (`offload_after`: the scheduler has processed the
        loading batch's result by then, the first part of its TTFT after the load)."""
        seq = self._finished_seq  # -1 without a timeline
        if seq < 0 or seq == self._offload_marked:
            return
        self._offload_marked = seq
        self.timeline.write({"offload_after": seq, "offload_ns": [t0, now_ns()], "pages": pages})

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
            self.report_forwards(wait=True)

    def report_forwards(self, final: bool = False, wait: bool = False) -> None:
        """Timeline records of the forwards that loaded, once their marks completed: where each
        one's stream waited for a layer and how long each layer computed (windows.LayerTimes
        .report). At finish() a batch's own forward is usually still running on the GPU: the
        `tutti-timeline` thread waits for its marks (wait) and writes it; at close (final) the
        current forward ends, and every record is written, waiting for its marks."""
        if self.timeline is None or self.times is None:
            return
        with self._report_lock:  # the thread and close: each record once, in order
            try:  # tracing never breaks a load or a close
                if final:
                    self.times.end()
                for rec in self.times.report(wait=final or wait):
                    self.timeline.write(rec)
                if final:
                    self.bare.end()
                for rec in self.bare.report(wait=final or wait):
                    if sum(rec["span_ms"]) >= BARE_MIN_MS:  # prefills, not decode steps
                        self.timeline.write({"bare_after": rec["forward_of"], "clock": rec["clock"],
                                             "span_ms": rec["span_ms"]})
            except Exception:  # e.g. a CUDA error surfacing in an event query
                logger.exception("tutti: the forwards' timeline records were not written")

    def reset(self) -> None:
        with self._lock:
            self.producer_index = self.consumer_index = -1
            self._batches.clear()
