"""A continuous offload stream through a LayerwiseKV, for benchmarks that measure restores
while a server keeps storing (bench/bench_prefill.py --offload-stream)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..layerwise import LayerwiseKV


class OffloadStream:
    """A continuous offload (gather -> pinned -> engine writes) of fresh keys through the same
    LayerwiseKV, as a server storing the previous request's KV would run it; at most `limit`
    pages per burst so the store's LRU never reaches the prefix being restored."""

    def __init__(self, lw: LayerwiseKV, model, limit: int, chunk: int = 16):
        page = model.s["page"]
        self.lw, self.limit, self.chunk = lw, limit, chunk
        self.rows = torch.arange(page, page * (chunk + 1), device=model.device)
        self.serial, self.pages, self.refused = 0, 0, 0

    def _run(self, stop: threading.Event) -> None:
        queued = done = 0
        while not stop.is_set() and queued * self.chunk < self.limit:
            keys = [f"{0xFF << 240 | (self.serial + i):064x}" for i in range(self.chunk)]
            if self.lw.offload(keys, self.rows, []):
                self.serial += self.chunk
                queued += 1
            else:
                self.refused += 1
                time.sleep(0.002)
            while self.lw.num_completed():
                done += 1
                self.pages += self.chunk * bool(self.lw.pop_completed())
            if queued - done >= 4:
                time.sleep(0.001)
        while done < queued:  # drain: every queued offload reports, in order
            if self.lw.num_completed():
                done += 1
                self.pages += self.chunk * bool(self.lw.pop_completed())
            else:
                time.sleep(0.001)

    def during(self, fn):
        """fn() while the stream runs; returns (fn's result, pages written, seconds)."""
        stop, pages0, t0 = threading.Event(), self.pages, time.perf_counter()
        t = threading.Thread(target=self._run, args=(stop,))
        t.start()
        time.sleep(0.05)  # writes in flight before the request arrives
        try:
            out = fn()
        finally:
            stop.set()
            t.join()
        return out, self.pages - pages0, time.perf_counter() - t0
