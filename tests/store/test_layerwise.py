"""LayerwiseKV driven directly on CPU: layers larger than one staging slot (several chunks per
layer), the next chunks admitted to the store's read stream while one lands (read_ahead 1-3),
both engines; a bad page in the middle of the pipeline fails the batch and leaves nothing in
flight behind it; a write starving behind a long load never deadlocks it."""

import logging
import os
import threading
import time

import numpy as np
import pytest

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry

torch = pytest.importorskip("torch")
GEOM = PageGeometry("mha", 4, 16, 256, 256)  # 4 KiB objects: 8 KiB per page and layer
PAGE, N = 16, 300  # 1 MiB staging slots hold 128 pages: 3 chunks per layer (128, 128, 44)
ENGINES = ["uring", "posix"] if extension().uring_compiled() else ["posix"]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # cuda: the GPU machine


def make_lw(tmp_path, engine="posix", device="cpu", observer=None, copy_recent=True, ranks=1, **extra):
    from tutti_hicache.layerwise import LayerwiseKV
    g = torch.Generator().manual_seed(7)
    rows = (N + 1) * PAGE
    k = [torch.randn(rows, 2, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(GEOM.num_layers)]
    v = [torch.randn(rows, 2, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(GEOM.num_layers)]
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path / "a"), str(tmp_path / "b")],
                                    "tutti_capacity_gb": 0.05, "tutti_stage_mb": 1,
                                    "tutti_engine": engine, **extra}, env={})
    return LayerwiseKV(cfg, GEOM, {"t": "layerwise"}, k, v, PAGE, observer=observer,
                       copy_recent=copy_recent, ranks=ranks), k, v


def offload_all(lw, keys, rows):
    assert lw.offload(keys, rows, [])
    end = time.time() + 60
    while lw.num_completed() < 1 and time.time() < end:
        time.sleep(0.01)
    assert lw.pop_completed()


def restore(lw, keys, rows, rid="r", decode=True):
    """One prefill batch restoring `keys`; then (decode) the decode batch that follows it in
    SGLang, so the next load reads from the store (with decode=False it may copy the pages this
    one brought into the pool: loader.py)."""
    assert lw.load(rid, keys, rows)
    return forward(lw, lw.start(), decode)


def forward(lw, idx, decode=True):
    """The started batch idx's forward (its per-layer waits) and finish; then (decode) a decode
    batch."""
    lw.counter.set_consumer(idx)
    for layer in range(lw.num_layers):
        lw.counter.wait_until(layer)
    ok = lw.finish(idx)
    if decode:
        lw.counter.set_consumer(-1)
    return ok


def roundtrip(lw, k, v, device="cpu", reverse=True):
    """Offload all N pages, then restore them byte-exact over poisoned pool pages: in pool order
    and (reverse) reversed, where pool pages and disk slots no longer line up."""
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1), device=device)
    offload_all(lw, keys, rows)
    want = [t[PAGE:].clone() for t in k + v]
    rev = torch.flip(rows.view(N, PAGE), [0]).reshape(-1).contiguous()
    for rid, ks, rs in [("r", keys, rows)] + ([("r2", keys[::-1], rev)] if reverse else []):
        for t in k + v:
            t[PAGE:] = -7  # poison: a page or layer not restored is caught
        assert restore(lw, ks, rs, rid=rid)
        assert all(torch.equal(t[PAGE:], w) for t, w in zip(k + v, want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("read_ahead,depth", [(1, 2), (2, 3), (3, 4)])
def test_multi_chunk_layers_restore_byte_exact(tmp_path, engine, read_ahead, depth, device):
    lw, k, v = make_lw(tmp_path, engine, device, tutti_read_ahead=read_ahead, tutti_stage_depth=depth)
    assert lw.stage_pages == 128 and lw.read_ahead == read_ahead
    roundtrip(lw, k, v, device)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_graph_replay_waiting_for_the_last_layer_only_finds_every_layer(tmp_path, device):
    """SGLang's prefill CUDA graph replay calls wait_until(num_layers - 1) alone, before the
    replay: once that returns (and, on CUDA, the forward's stream has passed the wait), every
    layer of the batch is in the pool, not only the last one."""
    lw, k, v = make_lw(tmp_path, device=device)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1), device=device)
    offload_all(lw, keys, rows)
    want = [t[PAGE:].clone() for t in k + v]
    for t in k + v:
        t[PAGE:] = -7
    assert lw.load("r", keys, rows)
    idx = lw.start()
    lw.counter.set_consumer(idx)
    lw.counter.wait_until(GEOM.num_layers - 1)
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    assert all(torch.equal(t[PAGE:], w) for t, w in zip(k + v, want))
    assert lw.finish(idx)
    lw.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream ordering: needs CUDA")
def test_an_offload_gathers_its_pages_only_once_their_ids_are_computed(tmp_path):
    """SGLang records the offload's ready events (record_offload_ready) before the linker's
    offload computes the page ids from the device indices, on the same stream. With that stream
    held back (here by a 1 s sleep kernel), the gather on the I/O stream must still wait for
    the ids: it used to read the uncomputed block, which the allocator had just given back
    holding page 20's id, and stored page 20's bytes under every key (valid checksums)."""
    lw, k, v = make_lw(tmp_path, device="cuda")
    keys = [f"p{i:063d}" for i in range(8)]
    rows = torch.arange(PAGE, PAGE * 9, device="cuda")
    want = [t[PAGE:9 * PAGE].clone() for t in k + v]
    stale = torch.full((8,), 20, dtype=torch.int64, device="cuda")  # the block page_ids will reuse
    del stale
    events = [torch.cuda.Event()]
    events[0].record()  # what record_offload_ready() does, before the offload's index math
    torch.cuda._sleep(2_000_000_000)  # the scheduler's stream is busy for about a second
    assert lw.offload(keys, rows, events)
    end = time.time() + 60
    while lw.num_completed() < 1 and time.time() < end:
        time.sleep(0.01)
    assert lw.pop_completed()
    torch.cuda.synchronize()
    for t in k + v:
        t[PAGE:9 * PAGE] = -7
    assert restore(lw, keys, rows)
    torch.cuda.synchronize()
    assert all(torch.equal(t[PAGE:9 * PAGE], w) for t, w in zip(k + v, want))
    lw.close()


@pytest.mark.parametrize("writers", [1, 3])
@pytest.mark.parametrize("engine", ENGINES)
def test_offload_writers_set_the_chunks_written_at_once_and_stay_byte_exact(tmp_path, engine, writers):
    """tutti_offload_writers: writers + 1 pinned out slots, that many chunk writes in flight; an
    offload of 10 chunks (32 pages each) then restores byte-exact, in pool order and reversed."""
    lw, k, v = make_lw(tmp_path, engine, tutti_offload_writers=writers)
    assert len(lw.out.bufs) == writers + 1 and lw._offloader._writes_in_flight == writers
    assert lw.out_pages == 32
    roundtrip(lw, k, v)
    lw.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_multi_chunk_offload_publishes_every_chunk_with_one_header_batch(tmp_path, engine):
    """Each chunk of an offload lands (payloads) on its own; the headers of all 10 chunks go out in
    one batch once the last has landed, so no chunk's headers queue behind another's payload."""
    lw, k, v = make_lw(tmp_path, engine)
    calls = []
    orig = lw.store._io.write_headers
    lw.store._io.write_headers = lambda keys_, *a: calls.append(len(keys_)) or orig(keys_, *a)
    roundtrip(lw, k, v, reverse=False)
    assert lw.out_pages == 32 and calls == [N]
    lw.close()


def test_an_offload_failing_mid_way_publishes_what_landed_and_leaks_no_slot(tmp_path):
    """The third chunk's gather raises: the offload reports failure, the chunks that landed before
    it are published (readable), the rest of its reservations go back, and the same offload run
    again stores everything and restores byte-exact."""
    lw, k, v = make_lw(tmp_path)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    off, orig, calls = lw._offloader, lw._offloader._gather_chunk, []

    def flaky(keys, page_ids, job=None):
        calls.append(len(keys))
        if len(calls) == 3:
            raise RuntimeError("injected gather failure")
        return orig(keys, page_ids, job)
    off._gather_chunk = flaky
    assert lw.offload(keys, rows, [])
    while lw.num_completed() < 1:
        time.sleep(0.01)
    assert not lw.pop_completed()
    assert lw.store.prefix_len(keys) == 2 * lw.out_pages and lw.store.stats()["pages"] == 2 * lw.out_pages
    assert not lw.store._index.reserved
    off._gather_chunk = orig
    for t in k + v:
        t[PAGE:] = t[PAGE:].roll(1, 0)  # new content: the landed chunks are not rewritten (dedup)
    want = [t[PAGE:].clone() for t in k + v]
    offload_all(lw, keys, rows)
    assert lw.store.prefix_len(keys) == N
    for t in k + v:
        t[PAGE:] = -7
    assert restore(lw, keys[2 * lw.out_pages:], rows[2 * lw.out_pages * PAGE:])
    assert all(torch.equal(t[PAGE * (1 + 2 * lw.out_pages):], w[2 * lw.out_pages * PAGE:])
               for t, w in zip(k + v, want))
    lw.close()


def test_read_ahead_is_capped_by_the_staging_ring(tmp_path):
    lw, _, _ = make_lw(tmp_path, tutti_read_ahead=8, tutti_stage_depth=3)
    assert lw.read_ahead == 2  # one slot stays free for the copy still reading it
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
def test_bad_page_mid_pipeline_fails_the_batch_and_the_next_load_is_clean(tmp_path, engine, device):
    lw, k, v = make_lw(tmp_path, engine, device, tutti_read_ahead=2)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1), device=device)
    offload_all(lw, keys, rows)
    want = [t[PAGE:].clone() for t in k + v]
    store = lw.store
    path, off = store.locate(keys[200])  # second chunk of each layer
    with open(path, "r+b") as f:  # layer 1's K object
        f.seek(off + int(store.layout.object_offsets[2]) + 5)
        b = f.read(1)
        f.seek(off + int(store.layout.object_offsets[2]) + 5)
        f.write(bytes([b[0] ^ 0x01]))
    assert not restore(lw, keys, rows)
    assert store.stats()["checksum_failures"] == 1
    assert keys[200] not in store
    # the pages before the bad one are intact and restore exactly; nothing of the failed batch
    # still lands in the staging slots they use
    for t in k + v:
        t[PAGE:] = -7
    good = keys[:200]
    assert restore(lw, good, rows[: 200 * PAGE], rid="r2")
    assert all(torch.equal(t[PAGE:PAGE * 201], w[: 200 * PAGE]) for t, w in zip(k + v, want))
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["cancel", "raise"])
def test_a_load_ended_mid_stream_fails_and_the_next_load_is_exact(tmp_path, monkeypatch, device, fault):
    """At chunk 5 of 12 the stream is cancelled (nothing new is submitted: the chunks not yet
    admitted end -ECANCELED) or the loader raises (the stream is closed under it): the load fails
    and the forward's waits all return (no hang), layer 3 (chunks 9-11) keeps its poison, and the
    next load is byte-exact."""
    from tutti_hicache.store.layer_reads import LayerStream
    lw, k, v = make_lw(tmp_path, device=device, tutti_read_ahead=2)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1), device=device)
    offload_all(lw, keys, rows)
    want = [t[PAGE:].clone() for t in k + v]
    real = LayerStream.wait_whole

    def ending(self, i):
        if i == 5 and fault == "cancel":
            self._stream.cancel()
        if i == 5 and fault == "raise":
            raise RuntimeError("the load is abandoned")
        return real(self, i)

    monkeypatch.setattr(LayerStream, "wait_whole", ending)
    for t in k + v:
        t[PAGE:] = -7
    assert not restore(lw, keys, rows, rid="ended")
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(bool((t[PAGE:] == -7).all()) for t in (k[3], v[3])), "a chunk never read landed"
    monkeypatch.setattr(LayerStream, "wait_whole", real)
    assert restore(lw, keys, rows, rid="again")
    assert all(torch.equal(t[PAGE:], w) for t, w in zip(k + v, want))
    lw.close()


def test_a_starving_write_never_deadlocks_a_long_load(tmp_path, monkeypatch):
    """A load holds its directories for every layer; a write that arrives meanwhile starves
    (floor 1 ms). The floor makes *new* reads wait for that write, so the load's own per-chunk
    reads must not count as new ones, or load and write wait for each other forever."""
    lw, _, _ = make_lw(tmp_path, tutti_write_floor_ms=1)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    offload_all(lw, keys, rows)
    from tutti_hicache.store.objectstore import LayerStream
    real = LayerStream.wait_whole

    def slow(self, i):  # a long restore: 12 chunks, 20 ms each
        time.sleep(0.02)
        return real(self, i)

    monkeypatch.setattr(LayerStream, "wait_whole", slow)
    assert lw.load("r", keys, rows)
    idx = lw.start()
    time.sleep(0.03)  # the load now holds the directories
    assert lw.offload(["q" + "0" * 63], torch.arange(0, PAGE), [])  # waits, then starves
    result = []
    t = threading.Thread(target=lambda: result.append(lw.finish(idx)), daemon=True)
    t.start()
    t.join(30)
    assert result == [True], "the load deadlocked behind a starving write"
    end = time.time() + 30
    while lw.num_completed() < 1 and time.time() < end:
        time.sleep(0.01)
    assert lw.pop_completed()  # and the write went through once the load released
    assert lw.store.gate.stats["write_chunks"] >= 1
    lw.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_random_restores_under_a_stream_of_offloads_are_byte_exact(tmp_path, engine):
    """Ten restores of random page subsets in random pool orders (1-3 chunks per layer) while a
    thread keeps offloading fresh pages through the same scheduler: every restored byte is the
    page's own."""
    lw, k, v = make_lw(tmp_path, engine, tutti_capacity_gb=0.2)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    offload_all(lw, keys, rows)
    want = {key: [t[PAGE * (i + 1):PAGE * (i + 2)].clone() for t in k + v] for i, key in enumerate(keys)}
    stop, first, sent, done = threading.Event(), threading.Event(), [0], []

    def offloads():
        while not stop.is_set():
            if lw.offload([f"q{sent[0]:063d}"], torch.arange(0, PAGE), []):
                sent[0] += 1
                first.set()
            while lw.num_completed():
                done.append(lw.pop_completed())
            time.sleep(0.002)

    t = threading.Thread(target=offloads, daemon=True)
    t.start()
    assert first.wait(60)  # the stream is flowing before the first restore, however busy the CPU
    rng = np.random.default_rng(3)
    try:
        for trial in range(10):
            pick = rng.choice(N, size=int(rng.integers(1, N + 1)), replace=False)
            dest = rng.permutation(N)[: len(pick)] + 1  # pool pages 1..N, shuffled
            dest_rows = torch.from_numpy((dest[:, None] * PAGE + np.arange(PAGE)).ravel())
            for t_ in k + v:
                t_[PAGE:] = -3
            assert restore(lw, [keys[i] for i in pick], dest_rows, rid=f"r{trial}")
            for i, d in zip(pick, dest):
                got = [t_[PAGE * d:PAGE * (d + 1)] for t_ in k + v]
                assert all(torch.equal(g, w) for g, w in zip(got, want[keys[i]])), (trial, i, d)
    finally:
        stop.set()
        t.join(30)
    end = time.time() + 60  # every offload sent completes: counted, not one poll that may come early
    while len(done) < sent[0] and time.time() < end:
        while lw.num_completed():
            done.append(lw.pop_completed())
        time.sleep(0.01)
    assert len(done) == sent[0] >= 1 and all(done)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_stats_file_counts_loads_and_offloads(tmp_path, device):
    """tutti_stats_file for the linker: exact pages and bytes of one offload and two loads, beside
    the store's counters, and the warm-up at attach left the pool's page 0 as it was."""
    import json
    path = tmp_path / "stats-{pid}.json"
    lw, k, v = make_lw(tmp_path, device=device, tutti_stats_file=str(path))
    page0 = [t[:PAGE].clone() for t in k + v]
    keys = [f"s{i:063d}" for i in range(20)]
    rows = torch.arange(PAGE, PAGE * 21, device=device)
    offload_all(lw, keys, rows)
    assert restore(lw, keys, rows) and restore(lw, keys[:5], rows[: 5 * PAGE], rid="r2")
    lw.close()
    import os
    s = json.loads((tmp_path / f"stats-{os.getpid()}.json").read_text())
    per_page = GEOM.num_layers * 2 * 4096
    lk = s["linker"]
    assert (lk["loads"], lk["load_pages"], lk["load_bytes"]) == (2, 25, 25 * per_page)
    assert (lk["offloads"], lk["offload_pages"], lk["load_failures"]) == (1, 20, 0)
    assert lk["first_load_seconds"] is not None and lk["load_seconds"] >= lk["first_load_seconds"] > 0
    assert s["pages"] == 20 and s["write_pages"] == 20
    assert all(torch.equal(t[:PAGE], w) for t, w in zip(k + v, page0))


@pytest.mark.slow
def test_offload_backlog_stays_exact_under_contention(tmp_path, monkeypatch, caplog):
    """offload() adds to the backlog on SGLang's scheduler thread while the offload thread takes
    finished jobs off it. Every len() here first lets the other thread run (so a switch lands
    inside each unguarded read-modify-write of the counter, which the GIL alone does not
    prevent); thousands of failing jobs later the backlog must be back at zero, and a full
    backlog's worth of pages must be accepted again."""
    import builtins
    caplog.set_level(logging.CRITICAL, logger="tutti_hicache.linker")  # a line per failed job
    lw, _, _ = make_lw(tmp_path, tutti_offload_backlog_pages=64)
    rows = torch.arange(PAGE, 2 * PAGE)

    class NeverReady:  # the job fails at once: no I/O, so the two threads contend all the time
        def synchronize(self):
            raise RuntimeError("never ready")

    real_len = builtins.len

    def yielding_len(x):
        time.sleep(0)
        return real_len(x)

    sent = done = 0
    end = time.time() + 60  # a counter that drifted up to the bound refuses every offload
    monkeypatch.setattr(builtins, "len", yielding_len)
    try:
        while sent < 2000 and time.time() < end:
            for _ in range(min(50, 2000 - sent)):  # a refused offload (backlog full) sends none
                sent += lw.offload([f"s{sent:063d}"], rows, [NeverReady()])
            while lw.num_completed():
                assert not lw.pop_completed()
                done += 1
        end = time.time() + 60
        while done < sent and time.time() < end:
            while lw.num_completed():
                assert not lw.pop_completed()
                done += 1
            time.sleep(0.001)
    finally:
        monkeypatch.setattr(builtins, "len", real_len)
    assert done == sent == 2000
    assert lw.offload_backlog == 0
    keys = [f"t{i:063d}" for i in range(64)]
    assert lw.offload(keys, torch.arange(PAGE, PAGE * 65), [NeverReady()])  # the whole bound
    lw.close()


def test_timeline_file_records_each_load_in_order(tmp_path):
    """tutti_timeline_file: one JSON line per load, its times ordered as the pipeline runs them
    (start < first read <= last read <= last layer handed over <= finish), a failed load's error,
    and the summary the e2e harness reports."""
    import json

    from tutti_hicache.benchmarks import timeline
    path = tmp_path / "tl-{pid}.jsonl"
    lw, k, v = make_lw(tmp_path, tutti_timeline_file=str(path))
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    offload_all(lw, keys, rows)
    assert restore(lw, keys, rows)
    assert lw.lookup(keys[:10]) == 10  # SGLang's match may look up twice
    lookup_between = [time.monotonic_ns()]
    assert lw.lookup(keys[:10]) == 10
    assert restore(lw, keys[:10], rows[:10 * PAGE], rid="r2")
    files = list(tmp_path.glob("tl-*.jsonl"))
    assert len(files) == 1 and str(os.getpid()) in files[0].name

    def lines_with(n, key="forward_of"):  # the tutti-timeline thread writes the forwards' records
        deadline = time.monotonic() + 30
        while True:
            lines = [json.loads(x) for x in files[0].read_text().splitlines()]
            if sum(key in r for r in lines) >= n or time.monotonic() > deadline:
                return lines
            time.sleep(0.01)

    lines = lines_with(2)
    recs = [r for r in lines if "start_ns" in r]
    assert [r["index"] for r in recs] == [0, 1] and [r["pages"] for r in recs] == [N, 10]
    assert [r["seq"] for r in recs] == [0, 1]
    # the linker's calls before each start: no lookup for the first load, the last of two
    assert recs[0]["lookup_ns"] == [0, 0] and 0 < recs[0]["load_ns"] <= recs[0]["start_ns"]
    look = recs[1]["lookup_ns"]
    assert recs[0]["finish_ns"][1] < look[0] <= look[1] <= recs[1]["load_ns"] <= recs[1]["start_ns"]
    assert look[0] >= lookup_between[0]
    # each load's forward, written once its marks completed, without a later load
    fwds = [r for r in lines if "forward_of" in r]
    assert [f["forward_of"] for f in fwds] == [0, 1] and fwds[0]["clock"] == "host"
    assert len(fwds[0]["stall_ms"]) == GEOM.num_layers and len(fwds[0]["span_ms"]) == GEOM.num_layers - 1
    assert min(fwds[0]["stall_ms"] + fwds[0]["span_ms"]) >= 0
    r = recs[0]
    assert r["chunk_layers"] == [l for l in range(GEOM.num_layers) for _ in range(3)]
    done = r["chunk_done_ns"]
    assert len(done) == 3 * GEOM.num_layers and all(done)
    assert r["start_ns"] <= r["begin_ns"] <= r["opened_ns"] < min(done) <= max(done) \
        <= max(r["complete_ns"]) <= r["finish_ns"][1]
    assert all(w[0] <= w[1] for w in r["wait_ns"]) and all(w[0] for w in r["wait_ns"])
    for layer in range(GEOM.num_layers):  # a layer is handed over after its last chunk landed
        assert r["complete_ns"][layer] >= max(done[3 * layer:3 * layer + 3])
    s = timeline.summarize(r)
    assert 0 <= s["begin_ms"] <= s["opened_ms"] < s["first_read_ms"] <= s["reads_ms"] <= s["handed_ms"] \
        <= s["finish_ms"]
    assert s["react_ms_p50"] >= 0 and s["forward_wait_ms"] >= 0 and s["error"] is None
    assert "stream_stall_ms" not in s  # the raw line: its forward is a line of its own
    merged = timeline.read([files[0], tmp_path / "missing"])
    assert [m["index"] for m in merged] == [0, 1] and merged[0]["forward"] == fwds[0]
    assert merged[1]["forward"] == fwds[1] and fwds[1]["p"] == 10 * PAGE
    s = timeline.summarize(merged[0])
    # each stall (arrive -> passed) lies inside the forward's wait_until(l) (entry -> return)
    assert 0 <= s["stream_stall_first_ms"] <= s["stream_stall_ms"] <= s["forward_wait_ms"] + 0.01
    assert s["layers_compute_ms"] >= 0 and s["forward_clock"] == "host"
    assert "| 0 | 300 | " + str(s["begin_ms"]) + " |" in timeline.table(recs)
    # SGLang's first offload after a load's finish is marked, once per load, and joined to it
    offload_all(lw, keys[:2], rows[:2 * PAGE])
    offload_all(lw, keys[2:4], rows[2 * PAGE:4 * PAGE])
    offs = [r for r in map(json.loads, files[0].read_text().splitlines()) if "offload_after" in r]
    assert len(offs) == 1 and offs[0]["offload_after"] == 1 and offs[0]["pages"] == 2
    assert recs[1]["finish_ns"][1] <= offs[0]["offload_ns"][0] <= offs[0]["offload_ns"][1]
    merged = timeline.read([files[0]])
    assert "offload_ns" not in merged[0] and merged[1]["offload_ns"] == offs[0]["offload_ns"]
    assert timeline.summarize(merged[1])["offload_ms"] >= timeline.summarize(merged[1])["finish_ms"]
    # a load that fails (its slots cut short on disk) is recorded with its error
    for seg in (tmp_path / "a").rglob("*"):
        if seg.is_file() and seg.stat().st_size > 1 << 20:
            os.truncate(seg, 4096)
    for seg in (tmp_path / "b").rglob("*"):
        if seg.is_file() and seg.stat().st_size > 1 << 20:
            os.truncate(seg, 4096)
    # forwards without a load: a decode-sized one is not written, a prefill-sized one is, with the
    # last load's number, and read() hands it to that load as its compute-only twin
    from tutti_hicache.layerwise.timeline import BARE_MIN_MS
    step = BARE_MIN_MS / 1e3 / (GEOM.num_layers - 1)
    for pause in (0.0, 4 * step, step):  # short (not written), the twin, a shorter one after it
        lw.counter.set_consumer(-1)
        for layer in range(GEOM.num_layers):
            lw.counter.wait_until(layer)
            time.sleep(pause)
    lw.counter.set_consumer(-1)  # the next batch: the last one retires and the thread writes it
    lines = lines_with(2, "bare_after")
    time.sleep(0.2)  # and nothing more follows
    lines = [json.loads(x) for x in files[0].read_text().splitlines()]
    bare = [r for r in lines if "bare_after" in r]
    assert len(bare) == 2 and {b["bare_after"] for b in bare} == {1}
    assert sum(bare[0]["span_ms"]) > sum(bare[1]["span_ms"]) >= BARE_MIN_MS
    assert len(bare[0]["span_ms"]) == GEOM.num_layers - 1
    merged = timeline.read([files[0]])
    assert "next_bare" not in merged[0] and merged[1]["next_bare"] == bare[0]
    assert timeline.summarize(merged[1])["next_bare_compute_ms"] == pytest.approx(sum(bare[0]["span_ms"]),
                                                                                   abs=0.01)
    lw.reset()  # SGLang's reset: the batch index restarts, the timeline's numbers do not
    assert not restore(lw, keys, rows, rid="r3")
    last = [r for r in map(json.loads, files[0].read_text().splitlines()) if "start_ns" in r][-1]
    assert last["index"] == 0 and last["seq"] == 2 and "LoadFailed" in last["error"]
    lw.close()  # every forward's record is written by now, and the thread has ended
    assert not lw.observer._reporter.is_alive()
    lines = [json.loads(x) for x in files[0].read_text().splitlines()]
    fwds = [r for r in lines if "forward_of" in r]
    assert [f["forward_of"] for f in fwds] == [0, 1, 2]
    merged = timeline.read([files[0]])  # matched on seq, not on the restarted index
    assert [m["forward"]["forward_of"] for m in merged] == [0, 1, 2]


def test_the_default_observer_does_nothing_observable(tmp_path):
    """No tutti_timeline_file and no observer given: the plain Observer, shared by the counter and
    the loader; a restore leaves no file, starts no timeline thread and keeps no forward marks
    for reporting."""
    from tutti_hicache.layerwise.observe import Observer
    before = set(threading.enumerate())
    lw, _, _ = make_lw(tmp_path)
    assert type(lw.observer) is Observer and lw.counter.observer is lw.observer
    keys = [f"p{i:063d}" for i in range(8)]
    rows = torch.arange(PAGE, PAGE * 9)
    offload_all(lw, keys, rows)
    assert restore(lw, keys, rows)
    lw.close()
    assert not list(tmp_path.rglob("*.jsonl"))
    assert not [t for t in set(threading.enumerate()) - before if t.name == "tutti-timeline"]
    assert lw.times._unreported is None  # report() never asked: no marks are kept for it


class Recorder:
    """An observer that records every hook call with its thread: (thread name, hook, args)."""

    def __init__(self):
        from tutti_hicache.layerwise.observe import Observer
        self.calls = []
        for name in [n for n in vars(Observer) if not n.startswith("_")]:
            setattr(self, name, lambda *args, _n=name: self.calls.append(
                (threading.current_thread().name, _n, args)))

    def on(self, thread: str) -> list:
        return [(hook, args) for t, hook, args in self.calls if t == thread]


def test_the_observer_hears_each_named_point_on_its_thread(tmp_path):
    """A given observer replaces the setting's; the scheduler's calls, the loader's and the
    forward's each come in pipeline order (4 layers of 3 chunks: the chunks' reads are final
    before the last layer is handed over); an offload and the close are heard too."""
    rec = Recorder()
    lw, k, v = make_lw(tmp_path, tutti_timeline_file=str(tmp_path / "unused.jsonl"), observer=rec)
    assert lw.observer is rec
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    offload_all(lw, keys, rows)
    rec.calls.clear()
    assert lw.lookup(keys) == N
    assert restore(lw, keys, rows, decode=False)
    main, layers = threading.current_thread().name, GEOM.num_layers
    on_main = rec.on(main)
    assert [h for h, _ in on_main[:3]] == ["looked_up", "load_called", "started"]
    assert on_main[2][1] == (0, 0, layers) and on_main[3] == ("forward_begun", (0, 0))
    waits = [h for h, args in on_main if h in ("waiting", "waited")]
    assert waits == ["waiting", "waited"] * layers
    assert [(h, args) for h, args in on_main[-2:]] == [("finishing", (0,)), ("finished", (0, 0))]
    loader = rec.on("tutti-load")
    assert [h for h, _ in loader[:2]] == ["load_begun", "stream_opened"]
    assert [args for h, args in loader if h == "layer_handed"] == [(0, layer) for layer in range(layers)]
    final = [i for i, (h, _) in enumerate(loader) if h == "reads_final"]
    assert final == [len(loader) - 2]  # before the last layer is handed over
    index, pages, chunk_layers, done = loader[final[0]][1]
    assert (index, pages) == (0, N) and chunk_layers == [l for l in range(layers) for _ in range(3)]
    assert len(done) == 3 * layers and all(done)
    assert not [c for c in rec.calls if c[0] not in (main, "tutti-load")]
    rec.calls.clear()
    offload_all(lw, keys[:2], rows[:2 * PAGE])
    assert [(h, args[1]) for h, args in rec.on(main)] == [("offloaded", 2)]
    lw.close()
    assert [h for _, h, _ in rec.calls[-2:]] == ["close", "reset"]


def test_a_trace_keeps_each_load_record_in_memory(tmp_path):
    """timeline.Trace (the benchmark's observer): each load's record, as the timeline file holds
    it, in trace.loads once its finish returned; no forwards' records, no file, no thread."""
    from tutti_hicache.benchmarks import timeline
    from tutti_hicache.layerwise.timeline import Trace
    trace = Trace()
    before = set(threading.enumerate())
    lw, k, v = make_lw(tmp_path, observer=trace)
    keys = [f"p{i:063d}" for i in range(N)]
    rows = torch.arange(PAGE, PAGE * (N + 1))
    offload_all(lw, keys, rows)
    assert restore(lw, keys, rows)
    assert restore(lw, keys[:10], rows[:10 * PAGE], rid="r2")
    assert [(r["seq"], r["pages"]) for r in trace.loads] == [(0, N), (1, 10)]
    s = timeline.summarize(trace.loads[0])
    assert 0 <= s["begin_ms"] <= s["opened_ms"] < s["first_read_ms"] <= s["reads_ms"] <= s["handed_ms"] \
        <= s["finish_ms"] and s["react_ms_p50"] >= 0 and s["error"] is None
    lw.close()
    assert all("forward_of" not in r and "bare_after" not in r for r in trace.loads)
    assert not list(tmp_path.glob("*.jsonl"))
    assert not [t for t in set(threading.enumerate()) - before if t.name == "tutti-timeline"]


# ------------------------------------------------------------------ every TP rank answers alike
# SGLang reduces load and offload results over the TP ranks but acts on each rank's offload()
# and load() answers as given: an answer that depends on this rank's own state (its backlog, its
# evictions) must not differ from the other ranks' (unified_cache_linker's _offload_node, and
# its note that the load's answer depends on the transfers alone).
def test_a_full_offload_backlog_is_a_failed_result_not_a_refusal(tmp_path):
    lw, _, _ = make_lw(tmp_path, tutti_offload_backlog_pages=4)
    keys = [f"b{i:063d}" for i in range(8)]
    assert lw.offload(keys, torch.arange(PAGE, PAGE * 9), [])  # over the bound: queued as failed
    end = time.time() + 30
    while lw.num_completed() < 1 and time.time() < end:
        time.sleep(0.01)
    assert lw.num_completed() == 1 and lw.pop_completed() is False
    assert lw.offload_backlog == 0 and lw.lookup(keys) == 0
    lw.close()


def test_a_page_evicted_after_the_lookup_fails_the_batch_and_holds_nothing(tmp_path):
    """Two ranks agreed on a hit; on this one a page left the store before load(). load() still
    queues (True), and the batch's finish() reports the failure, so every rank's finish (reduced
    by SGLang) says so; no page stays pinned, the other request's of the batch included. A rank
    alone answers False, and SGLang recomputes."""
    lw, k, v = make_lw(tmp_path / "alone")
    keys = [f"p{i:063d}" for i in range(8)]
    offload_all(lw, keys, torch.arange(PAGE, PAGE * 9))
    lw.store.forget([keys[5]])
    assert not lw.load("alone", keys, torch.arange(PAGE * 20, PAGE * 28))
    assert not lw.store._index.pinned_slots
    lw.close()
    lw, k, v = make_lw(tmp_path / "two", ranks=2)
    keys = [f"p{i:063d}" for i in range(8)]
    offload_all(lw, keys, torch.arange(PAGE, PAGE * 9))
    assert lw.lookup(keys) == 8
    lw.store.forget([keys[5]])  # evicted between the lookup and the load
    assert lw.load("ok", keys[:4], torch.arange(PAGE * 10, PAGE * 14))
    assert lw.load("lost", keys, torch.arange(PAGE * 20, PAGE * 28))
    assert forward(lw, lw.start()) is False
    assert not lw.store._index.pinned_slots
    assert restore(lw, keys[:4], torch.arange(PAGE * 10, PAGE * 14), rid="again")  # the next batch
    lw.close()


def test_a_loads_dram_slots_are_given_back_after_its_copies_ran(tmp_path):
    """On a GPU the DRAM tier's copies into the pool are only queued on the I/O stream when the
    loader is done with a load: its DRAM slots are given back once that stream ran them (a slot
    refilled before could put another page's bytes into this load's pool pages). A stream that
    fails to synchronize keeps them."""
    from types import SimpleNamespace
    lw, _, _ = make_lw(tmp_path, tutti_host_gb=0.01)
    if lw.host is None:
        pytest.skip("no DRAM tier")
    keys = [f"p{i:063d}" for i in range(4)]
    offload_all(lw, keys, torch.arange(PAGE, PAGE * 5))
    lw._offloader.worker.drain()  # its own DRAM pins given back
    slots = lw.host.pin(keys)
    assert (slots >= 0).all()
    pins = lw.host._pins[slots].copy()
    loader, order = lw._loader, []
    real_unpin = lw.host.unpin

    class Stream:
        fail = False

        def synchronize(self):
            order.append("synchronize")
            if self.fail:
                raise RuntimeError("device lost")
    stream = Stream()
    loader._cuda, loader._io = True, SimpleNamespace(stream=stream)
    me = threading.current_thread()
    lw.host.unpin = lambda s: (threading.current_thread() is me and order.append("unpin"), real_unpin(s))
    stream.fail = True
    loader._unpin_host(slots)
    assert order == ["synchronize"] and (lw.host._pins[slots] == pins).all()  # kept
    stream.fail = False
    loader._unpin_host(slots)
    assert order == ["synchronize", "synchronize", "unpin"] and (lw.host._pins[slots] == pins - 1).all()
    loader._cuda, loader._io = False, None
    lw.host.unpin = real_unpin
    lw.close()


def test_a_batch_that_cannot_be_built_gives_its_pins_back(tmp_path, monkeypatch):
    """start() raising while it builds the batch (never seen with SGLang's inputs; a device error
    on a GPU) leaves no page pinned: the next batches still evict and load normally."""
    lw, k, v = make_lw(tmp_path)
    keys = [f"p{i:063d}" for i in range(4)]
    offload_all(lw, keys, torch.arange(PAGE, PAGE * 5))
    assert lw.load("r", keys, torch.arange(PAGE * 10, PAGE * 14))
    monkeypatch.setattr(torch, "cat", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device error")))
    with pytest.raises(RuntimeError, match="device error"):
        lw.start()
    monkeypatch.undo()
    assert not lw.store._index.pinned_slots
    assert restore(lw, keys, torch.arange(PAGE * 10, PAGE * 14), rid="again")
    lw.close()
