"""Pinned staging for the layer-wise path: a ring of host slots the engine reads into (or
writes from) and one device slot for the H2D / D2H copy.

At a glance:
    ring = Staging(slot_bytes, depth, device, cuda)
    ring.take() -> k          the next slot in ring order, once the copy that last used it ended
    ring.next                 the slot take() returns next (the loader plans its reads by it)
    ring.hold(k, future)      a host copy still reads slot k: take() waits for it too
    ring.bufs[k], ring.host[k], ring.device, ring.events[k]
    ring.regions()            [(address, nbytes)] to register with the engine
    ring.close()

Slots are page-aligned AlignedBuffers, registered with CUDA (cudaHostRegister) when there is a
GPU. Memory does not grow with the sequence length: slot_bytes comes from tutti_stage_mb.
Thread-safety: one ring belongs to one thread (the loader's or the offloader's).
"""

from __future__ import annotations

from concurrent import futures

import torch

from ..engine import extension


class Staging:
    """A ring of page-aligned pinned host slots (registered with the engine) plus one device
    slot; each ring slot remembers the event of the copy that last read it."""

    def __init__(self, slot_bytes: int, depth: int, device: torch.device, cuda: bool):
        ext = extension()
        self.slot_bytes = slot_bytes
        self.bufs = [ext.AlignedBuffer(slot_bytes) for _ in range(depth)]
        self.host = [torch.frombuffer(b, dtype=torch.uint8) for b in self.bufs]
        self.cuda = cuda
        if cuda:
            for t in self.host:
                torch.cuda.cudart().cudaHostRegister(t.data_ptr(), slot_bytes, 0)
        self.device = torch.empty(slot_bytes, dtype=torch.uint8, device=device) if cuda else None
        self.events = [None] * depth
        self.holds = [None] * depth  # host copies still reading a slot (hold)
        self.next = 0

    def regions(self) -> list[tuple[int, int]]:
        return [(b.address, b.nbytes) for b in self.bufs]

    def hold(self, k: int, future) -> None:
        """A host copy still reads slot k (a concurrent Future): take() waits for it too."""
        self.holds[k] = future

    def take(self) -> int:
        """Next ring slot, once the copies that last read it have finished."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        if self.events[k] is not None:
            self.events[k].synchronize()
            self.events[k] = None
        if self.holds[k] is not None:
            futures.wait([self.holds[k]])  # its outcome is the holder's to report
            self.holds[k] = None
        return k

    def close(self) -> None:
        if self.cuda:
            for t in self.host:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.host.clear()
        self.bufs.clear()
