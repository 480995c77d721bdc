"""SGLang's layer counter for a layer-wise restore, ordered on the GPU.

At a glance:
    counter = LayerCounter(num_layers, times=None, observer=None)
    counter.update_producer() -> index      [scheduler] a new batch (start_layer_wise_loading)
    counter.describe(index, n_input, n_prefix)   [scheduler] its shape, for the write windows
    counter.complete(index, layer, event)   [loader] layer enqueued; event: its copy on the GPU
    counter.fail(index, error)              [loader] every wait returns; finish() reports False
    counter.set_consumer(index), counter.wait_until(layer)   [forward] SGLang's interface
    counter.launches                        forwards begun so far (set_consumer is called for every
                                            batch, decode ones with -1): whether one ran between two
                                            loads (the loader's copies from the last batch's pages)
    counter.finish(index) -> bool           [scheduler] every layer landed (events synchronized)
    counter.reset()

wait_until(l) blocks the CPU only until layer l's copy is enqueued, then makes the current CUDA
stream wait on that copy's event (no CPU stall). A failed load sets every layer, so the forward
never hangs; it runs on wrong bytes that finish() then refuses (SGLang aborts the requests).
Thread-safety: batches are created and removed under a lock; complete/fail only set a batch's
threading.Events, which finish() waits for before it removes the batch. `consumer_index` and
`waited` are single ints written by the forward's thread and read by the loader (a heuristic
for slack windows, never for correctness). `times` (windows.LayerTimes) is told where the forward is
(set_consumer, and around each wait), for write windows learned online; never for correctness.
`observer` (observe.py; the default does nothing) is called at each of these points: a batch
started, a layer handed over, a load failed, a forward begun, wait_until entered and returned,
finish entered and returning, the counter reset. `seq` numbers the loads from the counter's
creation (the index restarts at every reset): the observer's and `times`' name for a load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .observe import Observer


@dataclass
class _Batch:
    """Per-batch layer state: CPU flags for "enqueued", CUDA events for "landed"."""
    layers: int
    enqueued: list = field(default_factory=list)
    events: list = field(default_factory=list)
    error: Optional[BaseException] = None
    shape: tuple = (0, 0)  # (new tokens, loaded prefix tokens), for the write windows' timing
    seq: int = 0  # the counter's loads numbered from its creation (reset() keeps counting)

    def __post_init__(self):
        self.enqueued = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers


class LayerCounter:
    """SGLang's layer counter interface (num_layers, consumer_index, set_consumer, wait_until),
    ordered on the GPU: wait_until(l) blocks the CPU only until layer l's copy is enqueued,
    then makes the current stream wait on that copy's event."""

    def __init__(self, num_layers: int, times=None, observer: Optional[Observer] = None):
        self.num_layers = num_layers
        self.times = times  # windows.LayerTimes: the forward's progress, for write windows
        self.observer = observer if observer is not None else Observer()
        self.consumer_index = -1
        self.producer_index = -1
        self.waited = -1  # last layer the forward waited for (its progress)
        self.launches = 0  # set_consumer calls: one per forward SGLang begins
        self._batches: dict[int, _Batch] = {}
        self._lock = threading.Lock()
        self._seq = -1  # the last load's number

    def update_producer(self) -> int:
        with self._lock:
            self.producer_index += 1
            self._seq += 1
            self._batches[self.producer_index] = _Batch(self.num_layers, seq=self._seq)
            self.observer.started(self.producer_index, self._seq, self.num_layers)
            return self.producer_index

    def describe(self, index: int, n_input: int, n_prefix: int) -> None:
        self._batches[index].shape = (n_input, n_prefix)

    def set_consumer(self, index: int) -> None:
        self.launches += 1
        self.consumer_index = index
        self.waited = -1
        b = self._batches.get(index)
        if self.times is not None:
            if b is None:
                self.times.end()
            else:
                self.times.begin(*b.shape, b.seq)
        self.observer.forward_begun(None if b is None else index, self._seq)

    def complete(self, index: int, layer: int, event=None) -> None:
        b = self._batches[index]
        b.events[layer] = event
        self.observer.layer_handed(index, layer)
        b.enqueued[layer].set()

    def fail(self, index: int, error: BaseException) -> None:
        b = self._batches.get(index)
        if b is None:
            return
        b.error = b.error or error
        self.observer.failed(index, b.error)
        for ev in b.enqueued:
            ev.set()  # the forward runs on (wrong) bytes; finish() reports the failure

    def wait_until(self, layer: int) -> None:
        self.waited = layer
        b = self._batches.get(self.consumer_index)
        index = None if b is None else self.consumer_index
        self.observer.waiting(index, layer)
        if b is None:
            return
        t = self.times
        if t is not None:
            t.arrive(layer)  # the previous layer's compute ends here
        b.enqueued[layer].wait()
        if b.events[layer] is not None:
            torch.cuda.current_stream().wait_event(b.events[layer])
        if t is not None:
            t.passed(layer)  # and this layer's starts here, once its KV landed
        self.observer.waited(index, layer)

    def finish(self, index: int) -> bool:
        """Wait until every layer of batch `index` has landed in device memory."""
        b = self._batches.get(index)
        if b is None:
            return True
        self.observer.finishing(index)
        for ev in b.enqueued:
            ev.wait()
        for ev in b.events:
            if ev is not None:
                ev.synchronize()
        with self._lock:
            del self._batches[index]
        self.observer.finished(index, b.seq)
        return b.error is None

    def reset(self) -> None:
        with self._lock:
            self.producer_index = self.consumer_index = -1
            self._batches.clear()
        self.observer.reset()
