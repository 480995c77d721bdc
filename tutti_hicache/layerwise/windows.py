"""Write windows learned online from the server's own forwards (no profiling step).

At a glance:
    times = LayerTimes(cuda)                  the forward's per-layer progress, by the counter:
        times.begin(n_input, n_prefix, index) [forward] set_consumer of a batch with a load
        times.arrive(layer) / times.passed(layer)   [forward] around wait_until's wait
        times.current() -> seconds | None     [loader] this forward's per-layer compute so far
        times.collect() -> [(n, p, seconds, err)]  forwards whose events completed (never waits);
                                              err: the in-forward estimate's error (running_error)
        times.report(wait) -> [record]        [finish] each finished forward's per-layer stalls
                                              and compute, once (tutti_timeline_file)
    model = OnlineModel(seed)                 t(n, p) = a + b*n + c*n*(p + n/2), recursive least
        model.observe(n, p, seconds)          squares with forgetting, seeded by an optional
        model.predict(n, p) -> seconds | None offline slack table (`tutti-hicache profile`)
    windows = Windows(mode, table, times, layer_bytes_per_token)
        windows.learn()                       [loader] at a load's start: the forwards since
        windows.window(n_input, n_prefix, read_Bps) -> seconds of writing between two layers
        windows.snapshot() -> {observations, converged_after, rel_error_*, in_forward_error_*,
                               in_forward_converged_after}

A layer's compute is the time from the forward passing wait_until(l) (its KV landed) to its arrival
at wait_until(l + 1): I/O waits are not in it. On a GPU both marks are CUDA events on the forward's
stream, read back only once they completed; on the CPU (the tests' forward runs synchronously)
they are host clocks. The window between two layers is the predicted compute of one layer minus
the read of one layer of the prefix at the loads' measured bandwidth, with a margin; unknown
compute gives no window (writes then run only while no read is pending, as without a table).

SGLang's linker gives `start_layer_wise_loading()` no batch size, so in a server n is unknown at
the start of a load: the current forward's own layers, once its first two have run, give the
per-layer compute; before that the model is asked with n = 0 (the prefix-only fit of past loads).
Thread-safety: begin/arrive/passed run on the forward's thread; current/collect on the loader's;
records are appended whole under a lock and never changed after.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Optional

import numpy as np

MARGIN = 0.8  # share of the predicted slack lent to writes
SMALLEST = 256  # new tokens assumed for a batch of unknown size, with a seed (its smallest row)
_SCALE = np.array([1.0, 1e-3, 1e-8])  # features (1, n, n(p + n/2)) brought near 1


def _features(n: int, p: int) -> np.ndarray:
    return np.array([1.0, n, n * (p + n / 2)]) * _SCALE


class OnlineModel:
    """Per-layer compute t(n, p) by recursive least squares (forgetting factor `forget`), and a
    per-prefix fit for loads whose new-token count is unknown (n = 0): an EWMA per prefix bucket."""

    def __init__(self, seed=None, forget: float = 0.97):
        self.forget = forget
        self.theta = np.zeros(3) if seed is None else np.array([seed.a, seed.b, seed.c]) / _SCALE
        self.P = np.eye(3) * (1e2 if seed is None else 1.0)
        self.seeded = seed is not None
        self.observations = 0
        self.rel_error: Optional[float] = None  # EWMA of |predicted - measured| / measured
        self.converged_after: Optional[int] = None  # forwards until rel_error stayed < 10%
        self._by_prefix: dict[int, float] = {}

    def predict(self, n: int, p: int) -> Optional[float]:
        if n <= 0:  # unknown: what past loads of this prefix size measured, else the seed's
            seen = self._by_prefix.get(_bucket(p))  # smallest batch (the conservative guess)
            return seen if seen is not None or not self.seeded else self.predict(SMALLEST, p)
        if not self.seeded and self.observations < 3:
            return None
        return max(0.0, float(_features(n, p) @ self.theta))

    def observe(self, n: int, p: int, seconds: float) -> None:
        if seconds <= 0:
            return
        guess = self.predict(n, p)
        if guess is not None:
            err = abs(guess - seconds) / seconds
            self.rel_error = err if self.rel_error is None else 0.7 * self.rel_error + 0.3 * err
        self.observations += 1
        if self.converged_after is None and self.rel_error is not None and self.rel_error < 0.1 \
                and self.observations >= 3:
            self.converged_after = self.observations
        b = _bucket(p)
        old = self._by_prefix.get(b)
        self._by_prefix[b] = seconds if old is None else 0.7 * old + 0.3 * seconds
        if n <= 0:
            return
        x = _features(n, p)
        px = self.P @ x
        gain = px / (self.forget + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.P = (self.P - np.outer(gain, px)) / self.forget


def _bucket(p: int) -> int:
    """Prefix buckets a factor of two apart (0, 1K, 2K, 4K, ...)."""
    return 0 if p < 1024 else 1 << (int(p).bit_length() - 1)


class _Forward:
    __slots__ = ("n", "p", "index", "arrive", "passed")

    def __init__(self, n: int, p: int, index: int = -1):
        self.n, self.p, self.index, self.arrive, self.passed = n, p, index, {}, {}


class LayerTimes:
    """Marks of the forward's progress through the layers of batches that load."""

    def __init__(self, cuda: bool, keep: int = 16):
        self.cuda = cuda
        self._lock = threading.Lock()
        self._current: Optional[_Forward] = None
        self._done: deque = deque(maxlen=keep)
        self._unreported: Optional[deque] = None  # forwards for report(), once one is wanted

    def begin(self, n_input: int, n_prefix: int, index: int = -1) -> None:
        with self._lock:
            self._retire()
            self._current = _Forward(n_input, n_prefix, index)

    def end(self) -> None:
        with self._lock:
            self._retire()
            self._current = None

    def end_of(self, index: int) -> None:
        """The forward of batch `index` has been launched (its marks are all recorded): it
        ends now if it is the current one, so report() can give it without a later forward."""
        with self._lock:
            if self._current is not None and self._current.index == index:
                self._retire()
                self._current = None

    def _retire(self) -> None:
        if self._current is not None:
            self._done.append(self._current)
            if self._unreported is not None:
                self._unreported.append(self._current)

    def report(self, wait: bool = False) -> list:
        """Finished forwards' marks, oldest first, each once: {forward_of (the batch's load
        number, LayerCounter's seq),
        n, p, clock ("gpu": CUDA event times on the forward's stream; "host"), stall_ms[l] =
        arrive(l) -> passed(l) (the forward waiting for layer l's KV: on the GPU, its stream
        idle before the layer's copy; the CPU's wait alone is not in it), span_ms[l] =
        passed(l) -> arrive(l + 1) (layer l's compute), and on the GPU with wait, when the
        last layer's passed mark had not completed before the wait: last_passed_ns, the host's
        CLOCK_MONOTONIC when it did (within the wake-up of a synchronize), which places the
        forward's GPU times on the host clock}. Without wait, it stops at the first
        forward whose marks have not completed (they stay for the next call). The first call
        starts the keeping; forwards retired before it are not reported."""
        with self._lock:
            if self._unreported is None:
                self._unreported = deque(maxlen=64)
                return []
            pending = list(self._unreported)
        out = []
        ms = lambda gaps: [round(g * 1e3, 4) for g in gaps]
        for f in pending:
            marks = list(f.arrive.values()) + list(f.passed.values())
            anchor = None
            if self.cuda:
                if wait:
                    final = f.passed[max(f.passed)] if f.passed else None
                    running = final is not None and not final.query()
                    for m in marks:
                        m.synchronize()
                    if running:  # the host clock when the GPU passed the last layer's wait
                        anchor = time.monotonic_ns()
                elif not all(m.query() for m in marks):
                    break
            rec = {"forward_of": f.index, "n": f.n, "p": f.p, "clock": "gpu" if self.cuda else "host",
                   "stall_ms": ms(self._gaps(f.arrive, f.passed, 0, True)),
                   "span_ms": ms(self._spans(f, True))}
            if anchor is not None:
                rec["last_passed_ns"] = anchor
            out.append(rec)
        with self._lock:
            for _ in out:
                self._unreported.popleft()
        return out

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def arrive(self, layer: int) -> None:
        f = self._current
        if f is not None:
            f.arrive[layer] = self._mark()

    def passed(self, layer: int) -> None:
        f = self._current
        if f is not None:
            f.passed[layer] = self._mark()

    def mark(self, layer: int) -> None:
        """arrive and passed at once, one mark (a forward that waits for nothing: its stalls
        are 0 and its spans run mark to mark)."""
        f = self._current
        if f is not None:
            f.arrive[layer] = f.passed[layer] = self._mark()

    def _spans(self, f: _Forward, wait: bool) -> list:
        """Per layer l in order, passed(l) -> arrive(l + 1), from marks that completed."""
        return self._gaps(f.passed, f.arrive, 1, wait)

    def _gaps(self, starts: dict, stops: dict, step: int, wait: bool) -> list:
        """Seconds from starts[l] to stops[l + step] per layer l of starts (in order), from stops
        that completed; without wait, up to the first one that has not."""
        gaps = []
        for layer, start in list(starts.items()):
            stop = stops.get(layer + step)
            if stop is None:
                continue
            if not self.cuda:
                gaps.append(stop - start)
            elif stop.query():
                gaps.append(start.elapsed_time(stop) / 1e3)
            elif not wait:
                break
        return gaps

    def _per_layer(self, f: _Forward, wait: bool) -> Optional[float]:
        """Median over layers l of passed(l) -> arrive(l + 1), from marks that completed."""
        spans = self._spans(f, wait)
        return float(np.median(spans)) if spans else None

    def current(self) -> Optional[float]:
        f = self._current
        return None if f is None else self._per_layer(f, wait=False)

    def collect(self) -> list:
        """(n, p, seconds per layer, in-forward error) of finished forwards whose marks completed;
        the others stay. The in-forward error: how far `current()` (the median of a forward's
        layers so far, what the windows use once two layers ran) was from each later layer, the
        median over layers 2.. of |estimate - span| / span; None with fewer than three layers."""
        out, keep = [], []
        with self._lock:
            done = list(self._done)
            self._done.clear()
        for f in done:
            last = f.arrive.get(max(f.arrive)) if f.arrive else None
            if self.cuda and last is not None and not last.query():
                keep.append(f)
                continue
            spans = self._spans(f, wait=True)
            if spans:
                out.append((f.n, f.p, float(np.median(spans)), running_error(spans)))
        with self._lock:
            self._done.extendleft(reversed(keep))
        return out


def running_error(spans: list) -> Optional[float]:
    """Median over k >= 2 of |median(spans[:k]) - spans[k]| / spans[k]. On the loader thread at a
    load's start, so plain Python (a layer count of small medians, microseconds each)."""
    errs = [abs(statistics.median(spans[:k]) - spans[k]) / spans[k]
            for k in range(2, len(spans)) if spans[k] > 0]
    return statistics.median(errs) if errs else None


class Windows:
    """The loader's write windows: predicted compute of a layer minus the read of one layer.
    mode: "online" (learned, seeded by `table` if any), "table" (the slack table's rows), "off"."""

    def __init__(self, mode: str, table, times: LayerTimes, layer_bytes_per_token: int):
        self.mode, self.table, self.times = mode, table, times
        self.model = OnlineModel(table.model if table is not None else None)
        self.layer_bytes_per_token = layer_bytes_per_token
        self.seed_read_Bps = table.read_Bps if table is not None else 0.0
        self.predictions: deque = deque(maxlen=256)  # (predicted, measured) per forward
        self.in_forward: deque = deque(maxlen=256)  # the in-forward estimate's error per forward
        self.forwards = 0  # forwards learned from
        # forwards until the in-forward estimate (what the windows use) had stayed within 10%
        # (its EWMA) over at least 3 forwards; the model's converged_after is its n = 0 fallback's
        self.in_forward_converged_after: Optional[int] = None
        self._in_forward_ewma: Optional[float] = None

    def learn(self) -> None:
        for n, p, seconds, err in self.times.collect():
            self.forwards += 1
            if err is not None:
                self.in_forward.append(err)
                e = self._in_forward_ewma
                self._in_forward_ewma = err if e is None else 0.7 * e + 0.3 * err
                if self.in_forward_converged_after is None and len(self.in_forward) >= 3 \
                        and self._in_forward_ewma < 0.1:
                    self.in_forward_converged_after = self.forwards
            guess = self.model.predict(n, p)
            if guess is not None:
                self.predictions.append((guess, seconds))
            self.model.observe(n, p, seconds)

    def compute(self, n_input: int, n_prefix: int) -> Optional[float]:
        now = self.times.current()
        return now if now is not None else self.model.predict(n_input, n_prefix)

    def window(self, n_input: int, n_prefix: int, read_Bps: float) -> float:
        if self.mode == "table":
            return 0.0 if self.table is None else self.table.window(n_input, n_prefix)[0]
        if self.mode == "off" or read_Bps <= 0:
            return 0.0
        c = self.compute(n_input, n_prefix)
        if c is None:
            return 0.0
        read = n_prefix * self.layer_bytes_per_token / read_Bps
        return max(0.0, MARGIN * (c - read))

    def snapshot(self) -> dict:
        m = self.model
        errs = [abs(g - s) / s for g, s in list(self.predictions) if s > 0]  # one C-level copy
        inf = list(self.in_forward)
        return {"mode": self.mode, "observations": m.observations, "converged_after": m.converged_after,
                "rel_error_ewma": m.rel_error, "seeded": m.seeded,
                "rel_error_p50": float(np.median(errs)) if errs else None,
                "rel_error_max": max(errs) if errs else None,
                # what the windows use from a forward's third layer on (rel_error_*: the model's
                # prediction before that, which in a server has no batch size: n = 0)
                "in_forward_error_p50": float(np.median(inf)) if inf else None,
                "in_forward_error_max": max(inf) if inf else None,
                "in_forward_converged_after": self.in_forward_converged_after}
