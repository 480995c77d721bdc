"""How long the GPU takes to react to a layer's reads completing (bench/bench_prefill.py).

    cal = Calibration.now(device)          a CUDA event pinned to a CLOCK_MONOTONIC time
    stats = reaction(lw.trace[-1], cal)    per layer: its last chunk's read completion (the C++
                                           stream's clock) -> its copy and scatter starting on the
                                           GPU (CUDA events), in microseconds; and the load's
                                           edges: the loader taking the batch -> layer 0's
                                           scatter starting, the last layer's reaction

Method: the read stream stamps each chunk's completion with CLOCK_MONOTONIC in C++ (done_ns);
the loader records timing events just before the chunk's H2D copy and just before its scatter.
A calibration event is recorded on an idle stream and synchronized, bracketed by two host
clock reads; its GPU time is taken as their midpoint, so every event converts to host time
to within half that bracket (reported as `calibration_us`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Calibration:
    event: torch.cuda.Event
    host_ns: float
    bracket_ns: float

    @classmethod
    def now(cls, device=None, tries: int = 5) -> "Calibration":
        """The tightest of `tries` brackets (an event's GPU time vs time.monotonic_ns)."""
        stream = torch.cuda.Stream(device=device)
        best = None
        for _ in range(tries):
            ev = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            t0 = time.monotonic_ns()
            ev.record(stream)
            ev.synchronize()
            t1 = time.monotonic_ns()
            if best is None or t1 - t0 < best.bracket_ns:
                best = cls(ev, (t0 + t1) / 2, float(t1 - t0))
        return best

    def host_ns_of(self, ev: torch.cuda.Event) -> float:
        return self.host_ns + self.event.elapsed_time(ev) * 1e6


def reaction(entry: dict, cal: Calibration) -> dict:
    """Per layer (its last chunk): read completion -> copy start and -> scatter start, in us:
    median, 90th percentile and max over the layers of one load."""
    layers, done = entry["layers"], np.asarray(entry["done_ns"], dtype=np.float64)
    starts = entry["starts"]
    last = [i for i in range(len(layers)) if i + 1 == len(layers) or layers[i + 1] != layers[i]]
    for copy_ev, scatter_ev in starts:
        scatter_ev.synchronize()
    copy_us = np.array([(cal.host_ns_of(starts[i][0]) - done[i]) / 1e3 for i in last])
    scatter_us = np.array([(cal.host_ns_of(starts[i][1]) - done[i]) / 1e3 for i in last])
    out = {"calibration_us": cal.bracket_ns / 2e3}
    for name, v in (("copy", copy_us), ("scatter", scatter_us)):
        out[f"{name}_start_us_p50"] = float(np.median(v))
        out[f"{name}_start_us_p90"] = float(np.percentile(v, 90))
        out[f"{name}_start_us_max"] = float(v.max())
    # the load's two edges, which no compute hides: the first layer's scatter start after the
    # loader took the batch, and the last layer's after its last read
    out["first_scatter_ms"] = (cal.host_ns_of(starts[last[0]][1]) - entry["begin_ns"]) / 1e6
    out["last_scatter_start_us"] = float(scatter_us[-1])
    # the load's reads on its own clock: the loader taking the batch -> the last read final (the
    # rate the medium gave this load, which moves by ~20% from one restore to the next)
    out["reads_ms"] = (float(done.max()) - entry["begin_ns"]) / 1e6
    return out
