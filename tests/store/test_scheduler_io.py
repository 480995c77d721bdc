"""The scheduler with real I/O: a store's reads (submit calls and layer-wise read streams) and
writes from two threads never overlap on a directory (checked on the engine calls themselves),
refusal at the backlog bound, and the linker pipeline opening slack-table write windows while its
reads are ahead of the forward."""

import itertools
import threading
import time

import numpy as np
import pytest

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import engine_for, extension
from tutti_hicache.layout import PageGeometry
from tutti_hicache.store import ObjectStore

from test_grow_ahead import wait_for

GEOM = PageGeometry("mha", 4, 16, 256, 256)  # 4 KiB objects


def store_config(dirs, **extra):
    return TuttiConfig.from_sources({"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": 0.05,
                                     "tutti_segment_gb": 1 / 256, **extra}, env={})


def make_store(dirs, engine=None, **extra):
    return ObjectStore(store_config(dirs, **extra), GEOM, {"t": "sched"}, engine=engine)


class Recorder:
    """Wraps the engine (give it to the store): once start(store) is called, logs (kind,
    devices, start, end) of every submit call, and of every read stream ("r", from its creation
    until its join or cancel returned; end None while it is open)."""

    def __init__(self, real_engine):
        self.store, self.log, self.lock = None, [], threading.Lock()
        self.real_engine = real_engine
        self.real_submit = self.real_engine.submit

    def start(self, store):
        self.store = store

    def __getattr__(self, name):  # counters(), close(), ... go to the real engine
        return getattr(self.real_engine, name)

    def _call(self, kind, op, file, *args):
        if self.store is None:  # not recording yet
            return self.real_submit(op, file, *args)
        devs = {self._dir(int(f)) for f in np.unique(file)}
        t0 = time.monotonic()
        out = self.real_submit(op, file, *args)
        with self.lock:
            self.log.append((kind, devs, t0, time.monotonic()))
        return out

    def _dir(self, f):
        path = self.store.files()[f]
        return next(d for d, ns in enumerate(self.store.ns_dirs) if path.startswith(ns + "/"))

    def submit(self, op, file, *a):
        return self._call("r" if op == "read" else "w", op, file, *a)

    def read_stream(self, file, *a):
        if self.store is None:
            return self.real_engine.read_stream(file, *a)
        rec = ["r", {self._dir(int(f)) for f in np.unique(file)}, time.monotonic(), None]
        with self.lock:
            self.log.append(rec)  # from before its first request can go out
        return RecordedStream(self.real_engine.read_stream(file, *a), rec, self.lock)


class RecordedStream:
    """A read stream whose log record ends when its join or cancel returns."""

    def __init__(self, stream, rec, lock):
        self.stream, self.rec, self.lock = stream, rec, lock

    def __getattr__(self, name):  # allow(), wait()
        return getattr(self.stream, name)

    def _ended(self, out):
        with self.lock:
            self.rec[3] = time.monotonic()
        return out

    def cancel(self):
        return self._ended(self.stream.cancel())

    def join(self):
        try:
            return self.stream.join()
        finally:
            self._ended(None)


def assert_no_overlap(log):
    """No write ran on a directory while a read (a submit call or an open stream) was in flight."""
    reads = [x for x in log if x[0] == "r"]
    writes = [x for x in log if x[0] == "w"]
    assert reads and writes
    for _, rd, r0, r1 in reads:
        r1 = float("inf") if r1 is None else r1  # a stream never joined holds on
        for _, wd, w0, w1 in writes:
            if rd & wd:
                assert w1 <= r0 or r1 <= w0, "a write ran on a directory while a read was in flight"


def pages(n, seed):
    m = len(GEOM.object_nbytes)
    buf = extension().AlignedBuffer(n * m * 4096)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(seed).integers(1, 255, n * m * 4096, dtype=np.uint8)
    return buf, (buf.address + np.arange(n * m, dtype=np.uint64) * 4096).reshape(n, m)


def test_reads_and_writes_never_overlap_on_a_directory(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    rec = Recorder(engine_for(store_config(dirs)))
    store = make_store(dirs, engine=rec, tutti_write_window_ms=1.0)
    rbuf, raddr = pages(32, 1)
    keys = [f"r{i:063d}" for i in range(32)]
    assert store.write_pages(keys, raddr, True).all()
    rec.start(store)
    errors = []
    dbuf, daddr = pages(32, 3)

    def read_once():
        if not store.read_pages(keys, daddr, True).all():
            errors.append("read")

    run_beside_a_writer(store, read_once, errors)
    assert not errors
    assert_no_overlap(rec.log)
    store.close()


def run_beside_a_writer(store, read_once, errors, rounds=30):
    """`read_once` in a loop beside a writer of 16-page batches (each forgotten again) on `store`,
    until each side has done `rounds` rounds: counted, not timed, so a busy machine makes the
    test slower, never weaker. Fails if either side stops making progress."""
    wbuf, waddr = pages(16, 2)
    stop, done = threading.Event(), {"read": 0, "write": 0}
    serial = itertools.count()

    def write_once():
        ks = [f"w{next(serial):04d}{j:059d}" for j in range(16)]
        if not store.write_pages(ks, waddr, True).all():
            errors.append("write")
        store.forget(ks)

    def loop(side, once):
        while not stop.is_set():
            once()
            done[side] += 1
            if min(done.values()) >= rounds:
                stop.set()

    ts = [threading.Thread(target=loop, args=("read", read_once), daemon=True),
          threading.Thread(target=loop, args=("write", write_once), daemon=True)]
    for t in ts:
        t.start()
    finished = stop.wait(120)  # a hang guard only: 30 rounds take well under a second
    stop.set()
    for t in ts:
        t.join(60)
    assert finished, f"no progress: {done}"


def test_layer_streams_and_writes_never_overlap_on_a_directory(tmp_path):
    """The same invariant on the layer-wise path: a stream_layers read holds its directories
    from the stream's first request until it is joined, and writes wait."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    rec = Recorder(engine_for(store_config(dirs)))
    store = make_store(dirs, engine=rec, tutti_write_window_ms=1.0)
    rbuf, raddr = pages(32, 1)
    keys = [f"r{i:063d}" for i in range(32)]
    assert store.write_pages(keys, raddr, True).all()
    want = np.frombuffer(rbuf, np.uint8).reshape(32, len(GEOM.object_nbytes), 4096)
    rec.start(store)
    errors = []
    stride = store.layer_object_stride()
    per_layer = 2 * stride  # K and V of one layer
    dst = extension().AlignedBuffer(GEOM.num_layers * 32 * per_layer)
    got = np.frombuffer(dst, np.uint8).reshape(GEOM.num_layers, 32, 2, stride)
    dsts = [dst.address + np.uint64(layer * 32 * per_layer) + np.arange(32, dtype=np.uint64) * np.uint64(per_layer)
            for layer in range(GEOM.num_layers)]
    streams = []

    def read_once():
        entries = store.pin(keys)
        try:
            plan = store.plan_pages(entries)
            chunks = [(layer, slice(None)) for layer in range(GEOM.num_layers)]
            with store.stream_layers(plan, chunks, dsts) as s:
                for layer in range(GEOM.num_layers):
                    s.allow(layer + 1)
                    if not s.wait(layer).all():
                        errors.append("stream")
            streams.append(1)
            for layer in range(GEOM.num_layers):
                k, v = GEOM.layer_objects(layer)
                if not (np.array_equal(got[layer, :, 0], want[:, k])
                        and np.array_equal(got[layer, :, 1], want[:, v])):
                    errors.append(f"bytes of layer {layer}")
        finally:
            store.unpin(entries)

    run_beside_a_writer(store, read_once, errors)
    assert not errors, errors[:5]
    assert streams
    assert all(x[3] is not None for x in rec.log if x[0] == "r"), "a stream was never joined"
    assert_no_overlap(rec.log)
    store.close()


def test_backlog_bound_refuses_stores_at_once(tmp_path):
    store = make_store([tmp_path], tutti_write_backlog_mb=1)
    buf, addr = pages(64, 4)  # 64 pages x 36 KiB > 1 MiB of payload
    ok = store.write_pages([f"k{i:063d}" for i in range(64)], addr, True)
    assert not ok.any()  # the payload phase was refused at arrival: no chunk of it ran
    assert store.stats()["sched_refused"] >= 1 and len(store) == 0
    store.close()


def _linker_with_a_prefix(tmp_path, **settings):
    """A 4-layer LayerwiseKV on CPU with 8 pages offloaded; returns it, its K/V buffers, the keys,
    the pool rows and the bytes those rows must hold after a restore."""
    torch = pytest.importorskip("torch")
    from tutti_hicache.layerwise import LayerwiseKV
    k = [torch.randn(20 * 16, 2, 64).to(torch.bfloat16) for _ in range(4)]
    v = [torch.randn(20 * 16, 2, 64).to(torch.bfloat16) for _ in range(4)]
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path / "s")], "tutti_capacity_gb": 0.05,
                                    "tutti_stage_mb": 1, **settings}, env={})
    lw = LayerwiseKV(cfg, GEOM, {"t": "lw"}, k, v, 16)
    keys = [f"p{i:063d}" for i in range(8)]
    rows = torch.arange(16, 16 * 9)
    assert lw.offload(keys, rows, [])
    while lw.num_completed() < 1:
        time.sleep(0.01)
    assert lw.pop_completed()
    return lw, k + v, keys, rows, [t[16:16 * 9].clone() for t in k + v]


def test_linker_opens_write_windows_when_ahead(tmp_path):
    from tutti_hicache.profiler import LayerModel, build_table
    table = build_table(LayerModel(0.02, 0.0, 0.0), 1, read_Bps=1e12, write_Bps=1e9)
    path = tmp_path / "slack.json"
    table.save(str(path))
    lw, bufs, keys, rows, want = _linker_with_a_prefix(tmp_path, tutti_slack_table=str(path))
    for t in bufs:
        t[16:16 * 9] = 0
    assert lw.load("r", keys, rows)
    idx = lw.start(input_tokens=256)
    lw.counter.set_consumer(idx)
    # a slow forward: it starts only once the loader, ahead of it, has lent the disk to writes
    assert wait_for(lambda: lw.windows_opened >= 1), "the loader ran ahead and opened no window"
    for layer in range(4):
        lw.counter.wait_until(layer)
    assert lw.finish(idx)
    assert all(torch_equal(t[16:16 * 9], w) for t, w in zip(bufs, want))
    lw.close()


@pytest.mark.slow
def test_linker_learns_write_windows_from_its_forwards(tmp_path):
    """No slack table: the windows come from the forwards' own per-layer compute (a forward that
    spends >= 40 ms per layer on the CPU), learned over a few loads, then lent to writes."""
    lw, bufs, keys, rows, want = _linker_with_a_prefix(tmp_path)
    assert lw.cfg.write_windows == "online" and not lw.cfg.slack_table
    for trial in range(6):
        for t in bufs:
            t[16:16 * 9] = 0
        assert lw.load(f"r{trial}", keys, rows)
        idx = lw.start(input_tokens=256 * (1 + trial % 3))
        lw.counter.set_consumer(idx)
        for layer in range(4):
            lw.counter.wait_until(layer)
            time.sleep(0.04)  # this layer's compute
        assert lw.finish(idx)
        assert all(torch_equal(t[16:16 * 9], w) for t, w in zip(bufs, want))
        lw.counter.set_consumer(-1)  # a decode batch ends the timed forward (the next load reads)
    lw.drain_loads()
    snap = lw.windows.snapshot()
    assert snap["mode"] == "online" and snap["observations"] >= 4  # every forward but the last
    assert lw.windows.model.predict(0, len(keys) * 16) >= 0.04  # what the layers spent, at least
    assert lw.windows_opened >= 1  # later loads ran ahead and lent the disk to writes
    assert lw.stats()["linker"]["write_windows"]["observations"] == snap["observations"]
    lw.close()


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
