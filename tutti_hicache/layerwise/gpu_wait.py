"""GPU-side completion for the layer-wise load: every chunk's copy and scatter enqueued at the
start of a load, each behind a wait on a counter the read stream advances.

At a glance ([loader] thread):
    gates = GateSlots(device_index)
    gate = gates.take()                      a zeroed gate: .host (release, verified) for the
                                             read stream, .device (release, verified) for the GPU,
                                             .copy a device word the scatters read `verified` from
    enqueue(plan, stream, device, gate, chunks, ...)   on the load stream, for chunk i: wait
        until release >= i + 1; H2D copy of its ring slot; copied(i) (the loader admits chunk
        i + depth, the next to use the slot, there); `verified` copied to device memory (gate.copy);
        scatter gated on that copy >= i + 1
        -> plan.copy_done[i], plan.layer_done[layer], plan.end
    close(plan, stream, gate, nchunks, stage, slots)   after the load's reads ended, always
    gates.retire(gate, plan.end)             the slot is reused once the GPU passed plan.end

Why: the CPU no longer reacts to each layer's completion with launches (about 45 us of Python
per launch); the read stream's C++ code stores the layer's count and the GPU proceeds. A load
that fails or is cancelled stores the terminal value (layer_reads.gate_release), so no wait is
left hanging, and the scatter of a chunk that did not pass reads `verified` below its count and
writes nothing: unverified bytes reach the device staging buffer at most, never the pool.
Thread-safety: GateSlots and plans belong to the loader thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import driver

WORDS_PER_GATE = 16  # one 64-byte line each: release at word 0, verified at word 1


@dataclass
class Gate:
    k: int
    host: tuple  # (release, verified) CPU addresses
    device: tuple  # (release, verified) GPU addresses of the same words
    copy: int  # a word of device memory: `verified` copied there before each scatter


@dataclass
class Plan:
    copy_done: list = field(default_factory=list)  # per chunk: its ring slot may be reused
    layer_done: list = field(default_factory=list)  # per layer: its last scatter ended
    starts: list = field(default_factory=list)  # tracing: per chunk (copy, scatter) start events
    end: Optional[torch.cuda.Event] = None


class GateSlots:
    """A pool of gates in one pinned, device-mapped allocation, reused round robin once the
    GPU has passed the end of the load that last used each."""

    def __init__(self, device: int, n: int = 8):
        self.device = device
        self.words = driver.HostWords(device, n * WORDS_PER_GATE)
        self.copies = torch.zeros(n * WORDS_PER_GATE, dtype=torch.int32, device=f"cuda:{device}")
        self._busy: list = [None] * n
        self._next = 0

    def take(self) -> Gate:
        k = self._next
        self._next = (k + 1) % len(self._busy)
        if self._busy[k] is not None:
            self._busy[k].synchronize()  # its last load's GPU work is done with the words
            self._busy[k] = None
        off = k * WORDS_PER_GATE * 4
        host = (self.words.address + off, self.words.address + off + 4)
        from ..layer_reads import gate_release
        gate_release(host, 0)  # zeroed before any wait on it is enqueued
        dev = (self.words.device_address + off, self.words.device_address + off + 4)
        return Gate(k, host, dev, self.copies.data_ptr() + off)

    def retire(self, gate: Gate, end: Optional[torch.cuda.Event]) -> None:
        self._busy[gate.k] = end

    def drain(self) -> None:
        for ev in self._busy:
            if ev is not None:
                ev.synchronize()


def enqueue(plan: Plan, stream, device: int, gate: Gate, chunks: list, slots: list, stage,
            nbytes: list, scatter: Callable, last_of_layer: list, on_layer: Callable,
            copied: Callable, trace: bool = False) -> None:
    """Enqueue every chunk's wait, copy and gated scatter on `stream`, in chunk order, filling
    `plan` as it goes (a launch that raises leaves the events of what was enqueued).
    chunks[i] = (layer, rows); slots[i]: its ring slot; nbytes[i]: its staged bytes;
    scatter(dev, layer, i, gate=(address, need)) launches its scatter; last_of_layer[i]: chunk
    i ends its layer, whose event goes to on_layer(layer, event) at once; copied(i) enqueues
    what follows chunk i's copy on the stream (the loader: a host function admitting reads)."""
    handle = stream.cuda_stream
    with torch.cuda.stream(stream):
        for i, (layer, _rows) in enumerate(chunks):
            driver.wait_value32(device, handle, gate.device[0], i + 1)
            copy_start = record(stream, True) if trace else None
            host = stage.host[slots[i]][: nbytes[i]]
            dev = stage.device[: nbytes[i]]
            dev.copy_(host, non_blocking=True)
            plan.copy_done.append(record(stream))
            copied(i)
            if trace:
                plan.starts.append((copy_start, record(stream, True)))
            # the kernel's programs read `verified` from device memory: read from the host by
            # each of them, it cost one PCIe round trip per program (~30 ms a 120 MB layer)
            driver.copy_word32(device, handle, gate.copy, gate.host[1])
            scatter(dev, layer, i, (gate.copy, i + 1))
            if last_of_layer[i]:
                plan.layer_done.append(record(stream))
                on_layer(layer, plan.layer_done[-1])
        plan.end = plan.layer_done[-1]


def close(plan: Plan, stream, gate: Gate, nchunks: int, stage, slots: list) -> None:
    """After a load, whatever happened: release every wait still enqueued (the terminal value,
    where the stream did not pass every chunk), hand each ring slot the event of its last copy
    (the next load reads into it after that), and mark where the load's GPU work ends."""
    from ..layer_reads import gate_release, gate_value
    if gate_value(gate.host[0]) != nchunks:
        gate_release(gate.host, None)
    for c, ev in enumerate(plan.copy_done):
        stage.events[slots[c]] = ev
    if plan.end is None:
        plan.end = record(stream)


def record(stream, timing: bool = False) -> torch.cuda.Event:
    """An event recorded on stream now (timing: usable with elapsed_time)."""
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(stream)
    return ev
