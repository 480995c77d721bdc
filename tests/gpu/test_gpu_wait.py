"""GPU-side completion waits, on the GPU: a stream waits on a device-mapped host word until the
CPU writes it; layer-wise restores are byte-exact with the CUDA part (tutti_gpu_wait=on) and
without it (off); a corrupt layer mid-load and a load cancelled or aborted mid-stream release
every enqueued wait (no CUDA stream is left waiting: bounded polling of CUDA events fails the
test instead of hanging) and land no byte of a chunk that did not pass in the pool."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry

pytestmark = pytest.mark.gpu
GEOM = PageGeometry("mha", 4, 16, 256, 256)  # 8 KiB per page and layer
PAGE, N, PER_CHUNK = 16, 300, 128  # 1 MiB staging slots: chunks of 128, 128 and 44 pages per layer
DEADLINE_S = 60.0
POISON = -7.0


def driver_or_skip():
    from tutti_hicache import driver
    ok, why = driver.available()
    if not ok:
        pytest.skip(f"the CUDA part is unavailable: {why}")
    return driver


def poll(events, what: str) -> None:
    """Wait for CUDA events by polling query(); past the deadline fail (a stream is hung)."""
    end = time.monotonic() + DEADLINE_S
    for ev in events:
        while not ev.query():
            if time.monotonic() > end:
                pytest.fail(f"{what}: a CUDA stream still waits after {DEADLINE_S:.0f} s")
            time.sleep(0.001)


def test_a_stream_waits_on_a_host_word_until_the_cpu_writes_it():
    driver = driver_or_skip()
    dev = torch.cuda.current_device()
    words = driver.HostWords(dev, 2)
    stream = torch.cuda.Stream()
    x = torch.zeros(1 << 16, device="cuda")
    x.add_(0)  # loads the kernel: a lazy load behind the wait may synchronize the context first
    torch.cuda.synchronize()
    for need, value in ((1, 1), (2, extension().GATE_TERMINAL)):  # a count, then the terminal value
        driver.wait_value32(dev, stream.cuda_stream, words.device_address, need)
        with torch.cuda.stream(stream):
            x.add_(1)
            ev = torch.cuda.Event()
            ev.record()
        time.sleep(0.2)
        assert not ev.query(), "the stream ran past a wait whose word was below its value"
        extension().gate_store(words.address, value)
        poll([ev], f"after the word became {value}")
        assert bool((x == need).all())


def make_lw(tmp_path, gpu_wait: str, **extra):
    from tutti_hicache.layerwise import LayerwiseKV
    driver_or_skip()
    g = torch.Generator().manual_seed(3)
    rows = (N + 1) * PAGE
    k, v = ([torch.randn(rows, 2, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(GEOM.num_layers)]
            for _ in range(2))
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path / "a"), str(tmp_path / "b")],
                                    "tutti_capacity_gb": 0.05, "tutti_stage_mb": 1,
                                    "tutti_gpu_wait": gpu_wait, **extra}, env={})
    lw = LayerwiseKV(cfg, GEOM, {"t": "gpu-wait"}, k, v, PAGE)
    assert lw.gpu_wait_on == (gpu_wait == "on"), lw.gpu_wait
    keys = [f"g{i:063d}" for i in range(N)]
    pool_rows = torch.arange(PAGE, PAGE * (N + 1), device="cuda")
    assert lw.offload(keys, pool_rows, [])
    end = time.monotonic() + DEADLINE_S
    while lw.num_completed() < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert lw.pop_completed()
    want = [t[PAGE:].clone() for t in k + v]
    for t in k + v:
        t[PAGE:] = POISON  # a page or layer not restored is caught
    return lw, k + v, keys, pool_rows, want


def restore(lw, keys, rows, rid: str) -> bool:
    """A forward's view: wait_until(l) for every layer on the current stream, then the current
    stream's progress polled (bounded), then finish() on a thread (bounded)."""
    assert lw.load(rid, keys, rows)
    idx = lw.start()
    lw.counter.set_consumer(idx)
    for layer in range(GEOM.num_layers):
        lw.counter.wait_until(layer)
    forward = torch.cuda.Event()
    forward.record(torch.cuda.current_stream())
    poll([forward], "the forward's stream behind wait_until")
    result: list = []
    t = threading.Thread(target=lambda: result.append(lw.finish(idx)), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert result, "finish() hung"
    ends = [torch.cuda.Event() for _ in range(2)]
    for ev, stream in zip(ends, (lw.io.stream, lw.io.load_stream)):
        ev.record(stream)
    poll(ends, "the I/O streams")
    return result[0]


def passed_pages(layer: int, chunks_passed: int) -> int:
    """Pages of `layer` restored when the load's first `chunks_passed` chunks passed."""
    per_layer = [PER_CHUNK, PER_CHUNK, N - 2 * PER_CHUNK]
    first = layer * len(per_layer)
    return sum(per_layer[: max(0, min(len(per_layer), chunks_passed - first))])


def check_pool(bufs, want, chunks_passed=None):
    """Restored rows equal what was written; rows of chunks that did not pass keep the poison."""
    for j, (t, w) in enumerate(zip(bufs, want)):
        layer = j % GEOM.num_layers
        n = N if chunks_passed is None else passed_pages(layer, chunks_passed)
        got = t[PAGE:]
        assert torch.equal(got[: n * PAGE], w[: n * PAGE]), f"layer {layer}: restored rows differ"
        assert bool((got[n * PAGE:] == POISON).all()), f"layer {layer}: unverified bytes landed"


@pytest.mark.parametrize("gpu_wait", ["on", "off"])
@pytest.mark.parametrize("read_ahead,depth,edge", [(1, 2, 1), (3, 4, 1), (3, 4, 4)])
def test_restore_is_byte_exact_with_either_completion_path(tmp_path, gpu_wait, read_ahead, depth, edge):
    """edge: tutti_edge_chunks, the first and the last layer in that many chunks each."""
    lw, bufs, keys, rows, want = make_lw(tmp_path, gpu_wait, tutti_read_ahead=read_ahead,
                                         tutti_stage_depth=depth, tutti_edge_chunks=edge)
    for trial in range(3):  # the gates and ring slots are reused across loads
        assert restore(lw, keys, rows, rid=f"r{trial}")
        check_pool(bufs, want)
        for t in bufs:
            t[PAGE:] = POISON
    lw.close()


@pytest.mark.parametrize("gpu_wait", ["on", "off"])
def test_a_corrupt_layer_mid_load_fails_releases_every_wait_and_lands_nothing_unverified(tmp_path, gpu_wait):
    lw, bufs, keys, rows, want = make_lw(tmp_path, gpu_wait, tutti_read_ahead=2)
    store = lw.store
    path, off = store.locate(keys[200])  # layer 1's second chunk (chunk 4 of the load)
    at = off + int(store.layout.object_offsets[2]) + 5  # layer 1's K object
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    assert not restore(lw, keys, rows, rid="bad")
    check_pool(bufs, want, chunks_passed=4)
    for t in bufs:
        t[PAGE:] = POISON
    assert restore(lw, keys[:200], rows[: 200 * PAGE], rid="good")  # the next load is clean
    for t, w in zip(bufs, want):
        assert torch.equal(t[PAGE:PAGE * 201], w[: 200 * PAGE])
    lw.close()


@pytest.mark.parametrize("gpu_wait", ["on", "off"])
@pytest.mark.parametrize("fault", ["cancel", "raise"])
def test_a_load_ended_mid_stream_releases_every_wait(tmp_path, monkeypatch, gpu_wait, fault):
    """At chunk 5 the stream is cancelled (nothing new is submitted: the chunks not yet admitted,
    7 on, end -ECANCELED) or the loader raises (the stream is closed under it): the load fails,
    every wait is released, layer 3 (chunks 9-11) keeps its poison, and the next load is exact."""
    from tutti_hicache.layer_reads import LayerStream
    lw, bufs, keys, rows, want = make_lw(tmp_path, gpu_wait, tutti_read_ahead=2)
    real = LayerStream.wait

    def ending(self, i):
        if i == 5 and fault == "cancel":
            self._stream.cancel()
        if i == 5 and fault == "raise":
            raise RuntimeError("the load is abandoned")
        return real(self, i)

    monkeypatch.setattr(LayerStream, "wait", ending)
    assert not restore(lw, keys, rows, rid="ended")
    for j, t in enumerate(bufs):
        if j % GEOM.num_layers == 3:
            assert bool((t[PAGE:] == POISON).all()), "a chunk never read landed in the pool"
    monkeypatch.setattr(LayerStream, "wait", real)
    assert restore(lw, keys, rows, rid="again")
    check_pool(bufs, want)
    lw.close()


def test_gpu_wait_on_without_the_cuda_part_fails_the_attach(tmp_path, monkeypatch):
    from tutti_hicache import driver
    from tutti_hicache.layerwise import LayerwiseKV
    monkeypatch.setattr(driver, "available", lambda: (False, "no driver here"))
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path / "a")], "tutti_capacity_gb": 0.01,
                                    "tutti_stage_mb": 1, "tutti_gpu_wait": "on"}, env={})
    k = [torch.zeros(4 * PAGE, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(GEOM.num_layers)]
    with pytest.raises(RuntimeError, match="no driver here"):
        LayerwiseKV(cfg, GEOM, {"t": "gpu-wait"}, k, [t.clone() for t in k], PAGE)


def hold_the_gil_in_a_context_synchronize(root: str) -> None:
    """(Run in a child process.) A GPU-wait load of 12 chunks through a ring of 2, then, once
    its GPU work is enqueued, the main thread synchronizes the context from a call that keeps
    the GIL (what a launch that loads a kernel lazily may do): the load must still run to its
    end, because its copies admit its later reads, not the Python loader."""
    import ctypes
    import pathlib
    lw, bufs, keys, rows, want = make_lw(pathlib.Path(root), "on", tutti_read_ahead=1,
                                         tutti_stage_depth=2)
    assert lw.load("held", keys, rows)
    idx = lw.start()
    last = lw.counter._batches[idx].enqueued[-1]  # set once all of the load's GPU work is queued
    assert last.wait(DEADLINE_S), "the load never enqueued its GPU work"
    assert ctypes.PyDLL("libcuda.so.1").cuCtxSynchronize() == 0  # holds the GIL throughout
    lw.counter.set_consumer(idx)
    assert lw.finish(idx)
    check_pool(bufs, want)
    lw.close()
    print("held-gil load: exact")


def test_a_load_runs_to_its_end_while_a_thread_holds_the_gil_in_a_context_synchronize(tmp_path):
    driver_or_skip()
    code = ("import runpy, sys; runpy.run_path(sys.argv[1])"
            "['hold_the_gil_in_a_context_synchronize'](sys.argv[2])")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        r = subprocess.run([sys.executable, "-P", "-c", code, __file__, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=DEADLINE_S + 60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the load deadlocked with the GIL held: {(e.stderr or '')[-2000:]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "held-gil load: exact" in r.stdout
