"""Write windows learned online: the recursive least-squares fit of per-layer compute, the
prefix-only fit for batches of unknown size, the span arithmetic of the forward's marks, and the
window rules (table, off, no estimate -> no window)."""

from __future__ import annotations

import numpy as np
import pytest

from tutti_hicache.layerwise.windows import (MARGIN, LayerTimes, OnlineModel, Windows, _Forward,
                                             running_error)
from tutti_hicache.profiler import LayerModel, build_table

TRUE = LayerModel(a=2e-4, b=4e-7, c=1.5e-12)  # an H200-like Llama-3-8B layer, seconds


def _shapes(rng, k):
    return [(int(rng.choice([512, 1024, 2048, 4096, 8192])), int(rng.choice([0, 8192, 32768, 65536])))
            for _ in range(k)]


def test_online_fit_converges_to_the_true_layer_model():
    rng = np.random.default_rng(0)
    m = OnlineModel()
    assert m.predict(1024, 8192) is None  # nothing seen, no seed: no guess, no window
    for n, p in _shapes(rng, 40):
        m.observe(n, p, TRUE.seconds(n, p) * (1 + rng.normal(0, 0.02)))
    assert m.observations == 40 and m.converged_after is not None and m.converged_after <= 40
    for n, p in [(3000, 20000), (700, 60000), (6000, 1000)]:  # shapes never seen
        assert abs(m.predict(n, p) - TRUE.seconds(n, p)) / TRUE.seconds(n, p) < 0.1


def test_seed_predicts_from_the_first_forward_and_is_corrected():
    seed = LayerModel(TRUE.a * 2, TRUE.b * 2, TRUE.c * 2)  # an offline table on another machine
    m = OnlineModel(seed)
    assert abs(m.predict(2048, 32768) - seed.seconds(2048, 32768)) < 1e-12
    rng = np.random.default_rng(1)
    for n, p in _shapes(rng, 60):
        m.observe(n, p, TRUE.seconds(n, p))
    assert abs(m.predict(2048, 32768) / TRUE.seconds(2048, 32768) - 1) < 0.1


def test_unknown_batch_size_uses_the_prefix_fit():
    m = OnlineModel()
    assert m.predict(0, 40000) is None
    m.observe(0, 40000, 0.010)  # a server load: n unknown
    m.observe(0, 40000, 0.020)
    assert abs(m.predict(0, 33000) - (0.7 * 0.010 + 0.3 * 0.020)) < 1e-12  # same bucket (32K-64K)
    assert m.predict(0, 9000) is None  # another bucket
    assert m.observations == 2 and m.predict(1024, 40000) is None  # no (n, p) fit from them


def test_layer_compute_excludes_the_waits_for_io():
    times = LayerTimes(cuda=False)
    f = _Forward(256, 4096)
    # layer 0 waited 0.5 s for its KV, computed 1.0 s; layer 1 waited 0.1, computed 0.9
    f.arrive.update({0: 0.0, 1: 1.5, 2: 2.5})
    f.passed.update({0: 0.5, 1: 1.6})
    assert abs(times._per_layer(f, wait=True) - 0.95) < 1e-12
    times._done.append(f)
    assert times.collect() == [(256, 4096, times._per_layer(f, wait=True), None)]  # 2 layers: no error
    assert times.collect() == []


def test_in_forward_error_is_the_running_median_against_each_later_layer():
    """collect's fourth field and the snapshot's in_forward_error_*: the estimate after k layers
    (their median) against layer k, from the third layer on; the model's own rel_error_* (n = 0 in
    a server) stays separate."""
    assert running_error([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert running_error([1.0, 1.0]) is None
    # layers 2 and 3: estimates 1.0 and median(1, 1, 2) = 1.0 against 2.0 and 1.0 -> 0.5 and 0.0
    assert running_error([1.0, 1.0, 2.0, 1.0]) == pytest.approx(0.25)
    times = LayerTimes(cuda=False)
    f = _Forward(0, 40000)
    t = 0.0
    for layer, span in enumerate([0.01, 0.01, 0.01, 0.011, 0.0]):
        f.arrive[layer] = t
        f.passed[layer] = t + 0.002  # the wait for its KV: not compute
        t += 0.002 + span
    times._done.append(f)
    w = Windows("online", None, times, 4096)
    w.learn()
    snap = w.snapshot()
    assert snap["in_forward_error_p50"] == pytest.approx(0.5 / 11)  # median of 0 and 0.001 / 0.011
    assert snap["observations"] == 1 and snap["rel_error_p50"] is None
    assert snap["in_forward_converged_after"] is None  # one forward: not yet


def test_in_forward_convergence_counts_the_forwards_until_the_estimate_held():
    """in_forward_converged_after: the forward after which the in-forward error's EWMA is below
    10% with at least 3 forwards seen; forwards without an error (under 3 layers) still count."""
    times = LayerTimes(cuda=False)

    def forward(spans):
        f, t = _Forward(0, 40000), 0.0
        for layer, span in enumerate(spans + [0.0]):
            f.arrive[layer], f.passed[layer] = t, t + 0.001
            t += 0.001 + span
        times._done.append(f)

    w = Windows("online", None, times, 4096)
    forward([0.01, 0.01])  # two layers: no in-forward error, counted
    forward([0.01, 0.01, 0.03, 0.03, 0.03])  # errors 2/3, 2/3, 1/3: median 2/3 -> EWMA 0.667
    for _ in range(3):
        forward([0.01] * 6)  # error 0 -> EWMA 0.467, 0.327, 0.229
    w.learn()
    assert w.in_forward_converged_after is None
    for _ in range(4):
        forward([0.01] * 6)
        w.learn()
    # EWMA 0.160, 0.112, 0.078: below 10% after the 8th forward
    assert w.snapshot()["in_forward_converged_after"] == 8


def test_window_rules():
    table = build_table(LayerModel(0.02, 0.0, 0.0), 1, read_Bps=1e12, write_Bps=1e9)
    times = LayerTimes(cuda=False)
    off = Windows("off", table, times, 4096)
    assert off.window(256, 8192, 1e10) == 0.0
    tab = Windows("table", table, times, 4096)
    assert tab.window(256, 8192, 1e10) == table.window(256, 8192)[0]
    online = Windows("online", None, times, 4096)
    assert online.window(256, 8192, 1e10) == 0.0  # no estimate yet
    seeded = Windows("online", table, times, 4096)
    read = 8192 * 4096 / 1e10
    assert abs(seeded.window(256, 8192, 1e10) - MARGIN * (0.02 - read)) < 1e-9
    assert seeded.window(256, 8192, 0.0) == 0.0  # no read rate known: no window
    assert seeded.window(256, 8192, 1e6) == 0.0  # the read takes longer than the compute


def test_report_gives_each_finished_forward_once_with_its_stalls_and_layer_times():
    """LayerTimes.report: per loading forward (the batch index it served), the stream's wait for
    each layer's KV (arrive -> passed) and each layer's compute (passed -> next arrive), in
    milliseconds of the marks; forwards before the first call are not kept; each one once."""
    times = LayerTimes(cuda=False)
    times.begin(100, 1000, index=0)
    times.end()
    assert times.report() == []  # the first call starts the keeping
    marks = iter([0.0, 0.010, 0.030, 0.031, 0.050, 0.050])  # arrive/passed of layers 0, 1, 2
    times._mark = lambda: next(marks)
    times.begin(200, 4096, index=7)
    for layer in range(3):
        times.arrive(layer)
        times.passed(layer)
    assert times.report() == []  # still the current forward
    times.end()
    (rec,) = times.report()
    assert rec == {"forward_of": 7, "n": 200, "p": 4096, "clock": "host",
                   "stall_ms": [10.0, 1.0, 0.0], "span_ms": [20.0, 19.0]}
    assert times.report() == []


class _GpuMark:
    """A CUDA event's surface as LayerTimes uses it: a GPU time (seconds) it completes at, on a
    GPU whose clock `gpu` the test moves; synchronize() runs the GPU up to it."""

    def __init__(self, gpu, t):
        self.gpu, self.t = gpu, t

    def query(self):
        return self.gpu[0] >= self.t

    def synchronize(self):
        self.gpu[0] = max(self.gpu[0], self.t)

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_report_with_wait_anchors_a_forward_still_running_on_the_gpu_to_the_host_clock():
    """The GPU branch of report(wait=True): a forward whose last mark had not completed when the
    report began gets last_passed_ns, the host clock once the wait for it returned; one whose
    marks had all completed gets none (the host did not see the moment); stalls and spans come
    from the events' own times either way."""
    import time as _time
    gpu = [0.0]
    times = LayerTimes(cuda=True)
    assert times.report() == []
    stamps = iter([0.0, 0.010, 0.030, 0.031, 0.050, 0.050])
    times._mark = lambda: _GpuMark(gpu, next(stamps))
    times.begin(200, 4096, index=7)
    for layer in range(3):
        times.arrive(layer)
        times.passed(layer)
    times.end()
    assert times.report() == []  # without wait: its marks have not completed
    before = _time.monotonic_ns()
    (rec,) = times.report(wait=True)
    assert rec["clock"] == "gpu" and rec["stall_ms"] == pytest.approx([10.0, 1.0, 0.0])
    assert rec["span_ms"] == pytest.approx([20.0, 19.0])
    assert rec["last_passed_ns"] >= before
    stamps = iter([0.06, 0.07])  # a forward that finished before the report
    times.begin(1, 4096, index=8)
    times.arrive(0)
    times.passed(0)
    times.end()
    gpu[0] = 1.0
    (rec,) = times.report(wait=True)
    assert rec["forward_of"] == 8 and "last_passed_ns" not in rec
