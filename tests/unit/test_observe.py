"""The layer-wise path's observer without a store: LayerCounter driven by hand (as the loader and
SGLang's forward drive it), the no-op default, and the timeline writer's records as
tutti_hicache/benchmarks/timeline.py reads them."""

import json

import pytest

from tutti_hicache.benchmarks import timeline as reader
from tutti_hicache.config import TuttiConfig
from tutti_hicache.layerwise.counter import LayerCounter
from tutti_hicache.layerwise.observe import Observer, observer_for
from tutti_hicache.layerwise.timeline import Timeline, TimelineFile, Trace

pytest.importorskip("torch")
LAYERS = 3


def one_load(counter: LayerCounter, fail: bool = False) -> bool:
    """A batch through every hook the counter calls: handed over layer by layer (the loader's
    part written before the last layer, as the loader does), waited for, finished."""
    index = counter.update_producer()
    obs = counter.observer
    obs.load_begun(index)
    obs.stream_opened(index)
    counter.set_consumer(index)
    for layer in range(LAYERS):
        if layer + 1 == LAYERS:
            obs.reads_final(index, 7, [0, 0, 1, 2], [10, 20, 30, 40])
        if fail and layer == 1:
            counter.fail(index, RuntimeError("layer 1 unreadable"))
        else:
            counter.complete(index, layer)
        counter.wait_until(layer)
    return counter.finish(index)


def test_the_default_observer_is_a_no_op_at_every_hook():
    counter = LayerCounter(LAYERS)
    assert type(counter.observer) is Observer
    assert one_load(counter) and not one_load(counter, fail=True)
    obs = Observer()
    hooks = [n for n in vars(Observer) if not n.startswith("_")]
    assert len(hooks) == 16 and not vars(obs)  # no state at all
    counter.reset()


def test_observer_for_takes_the_timeline_file_only_when_it_is_set(tmp_path):
    assert type(observer_for(TuttiConfig())) is Observer
    cfg = TuttiConfig.from_sources({"tutti_timeline_file": str(tmp_path / "t-{pid}.jsonl")}, env={})
    obs = observer_for(cfg)
    assert isinstance(obs, Timeline) and obs.times is None and obs.bare is None


def test_the_timeline_writes_the_records_the_reader_summarizes(tmp_path):
    """Through a TimelineFile: one line per load once its finish returned (the failed one with its
    error), the linker's lookup and load calls before it, the first offload after a finish once;
    benchmarks/timeline.py reads, joins and summarizes them."""
    f = TimelineFile(str(tmp_path / "tl-{pid}.jsonl"))
    tl = Timeline(f.write)
    counter = LayerCounter(LAYERS, observer=tl)
    tl.looked_up(1, 2)
    tl.looked_up(3, 4)  # the last lookup before the start counts
    tl.load_called()
    assert one_load(counter)
    tl.offloaded(5, 2)
    tl.offloaded(6, 3)  # only the first offload after a finish
    assert not one_load(counter, fail=True)
    with open(f.path) as fh:
        lines = [json.loads(x) for x in fh]
    loads = [r for r in lines if "start_ns" in r]
    assert [(r["index"], r["seq"]) for r in loads] == [(0, 0), (1, 1)]
    r = loads[0]
    assert r["lookup_ns"] == [3, 4] and 0 < r["load_ns"] <= r["start_ns"]
    assert loads[1]["lookup_ns"] == [0, 0] and loads[1]["load_ns"] == 0
    assert r["pages"] == 7 and r["chunk_layers"] == [0, 0, 1, 2] and r["chunk_done_ns"] == [10, 20, 30, 40]
    assert r["start_ns"] <= r["begin_ns"] <= r["opened_ns"] <= r["loader_end_ns"] <= r["complete_ns"][-1]
    assert all(w[0] <= w[1] for w in r["wait_ns"]) and all(r["complete_ns"])
    assert r["finish_ns"][0] <= r["finish_ns"][1] and "error" not in r
    assert "layer 1 unreadable" in loads[1]["error"]
    offs = [x for x in lines if "offload_after" in x]
    assert len(offs) == 1 and (offs[0]["offload_after"], offs[0]["offload_ns"][0], offs[0]["pages"]) == (0, 5, 2)
    merged = reader.read([f.path])
    assert [m["index"] for m in merged] == [0, 1] and merged[0]["offload_ns"][0] == 5
    s = reader.summarize(merged[0])
    assert s["pages"] == 7 and s["finish_ms"] >= s["handed_ms"] >= 0 and s["forward_wait_ms"] >= 0
    assert "| 0 | 7 |" in reader.table(merged)
    counter.reset()


def test_a_trace_keeps_the_records_in_memory():
    trace = Trace()
    counter = LayerCounter(LAYERS, observer=trace)
    assert one_load(counter) and not one_load(counter, fail=True)
    assert [r["seq"] for r in trace.loads] == [0, 1] and "error" in trace.loads[1]
    assert reader.summarize(trace.loads[0])["reads_ms"] is not None
    trace.close()  # no forwards' records to write, no thread to end


def test_host_restores_group_gets_and_time_sglangs_hit_query(tmp_path):
    """The host tier's calls (storage.py's _trace lines) as a restore: gets each entered within
    HOST_GAP_MS of the previous one's return are one restore; the time from the last exists
    call's entry to its first get is SGLang's queue; a later get is another restore."""
    import json
    from tutti_hicache.benchmarks import timeline
    ms = 1_000_000
    lines = [{"host_op": "set", "t0_ns": 0, "t1_ns": 5 * ms, "keys": 4, "found": 4, "thread": "backup"},
             {"host_op": "exists", "t0_ns": 100 * ms, "t1_ns": 101 * ms, "keys": 4, "found": 4},
             {"host_op": "get", "t0_ns": 130 * ms, "t1_ns": 150 * ms, "keys": 2, "found": 2},
             {"host_op": "get", "t0_ns": 160 * ms, "t1_ns": 170 * ms, "keys": 2, "found": 2},
             {"host_op": "get", "t0_ns": 500 * ms, "t1_ns": 540 * ms, "keys": 4, "found": 4},
             {"host_op": "set", "t0_ns": 520 * ms, "t1_ns": 600 * ms, "keys": 4, "found": 4, "thread": "backup"}]
    path = tmp_path / "timeline-x-1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(lines)) + "not json\n")
    out = timeline.host_summary([str(path)], 1_000_000)
    first, second = out["restores"]
    assert (first["start_ms"], first["ms"], first["calls"], first["pages"]) == (130.0, 40.0, 2, 4)
    assert first["exists_to_get_ms"] == 30.0 and first["GBps"] == pytest.approx(4e6 / 0.04 / 1e9)
    assert (second["calls"], second["pages"], second["exists_to_get_ms"]) == (1, 4, 400.0)
    # inside the gets 20 + 10 of the first restore's 40 ms (10 ms SGLang's between them); the
    # set at 0-5 ms overlaps neither, the one at 520-600 ms overlaps the second
    assert (first["in_calls_ms"], second["in_calls_ms"]) == (30.0, 40.0)
    assert (first["sets_during"], second["sets_during"]) == (0, 1)
    assert out["exists"] == {"calls": 1, "ms_p50": 1.0, "ms_max": 1.0, "first_ms": 1.0}
    assert out["sets"]["pages"] == 8 and out["sets"]["calls"] == 2
    assert timeline.read([str(path)]) == []  # no linker load among them
