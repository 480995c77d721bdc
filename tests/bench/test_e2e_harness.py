"""The end-to-end benchmark's workload, report and server command lines (tutti_hicache/benchmarks/e2e.py).

The server run itself needs a GPU (bench/e2e_sglang.py); what is checked here: the prompts are seeded
and stable across configurations, a sweep point's cached share is what it claims, the report's
ratios and SLO come out of the records as defined, every configuration's argv is accepted by
SGLang's real argument parser (with the plugin's `tutti` choices), and the run's bookkeeping
(tutti_hicache/benchmarks/e2e_sglang.py) keeps what it measured, with the servers faked.
"""

import argparse
import copy
import json
import os

import pytest

from tutti_hicache.benchmarks import configs, e2e, e2e_report, e2e_sglang


@pytest.fixture(scope="module")
def wl():
    return e2e.Workload(contexts=(2048, 4096), docs=2, q_tokens=32)


def test_documents_share_the_system_prompt_and_are_seeded(wl):
    a, b = wl.document(2048, 0), wl.document(2048, 1)
    assert len(a) == len(b) == 2048
    assert a[:e2e.SYSTEM_TOKENS] == b[:e2e.SYSTEM_TOKENS]
    assert a[e2e.SYSTEM_TOKENS:] != b[e2e.SYSTEM_TOKENS:]
    again = e2e.Workload(contexts=(2048, 4096), docs=2, q_tokens=32)
    assert [r.ids for r in again.warm()] == [r.ids for r in wl.warm()]
    assert e2e.Workload(contexts=(2048,), docs=1, seed=1).document(2048, 0) != a


def test_warm_and_first(wl):
    warm = wl.warm()
    assert [r.id for r in warm] == ["warm/2048/0", "warm/2048/1", "warm/4096/0", "warm/4096/1"]
    for r in warm:
        assert len(r.ids) == r.context + 32 and r.cached == r.context
    first = wl.first()
    assert first.context == 4096 and first.ids[:4096] == wl.document(4096, 0)
    assert first.ids[4096:] != warm[2].ids[4096:]  # a new question on a warmed document


@pytest.mark.parametrize("h", [0.5, 0.9, 0.95, 0.99])
def test_sweep_point_keeps_a_page_aligned_share_of_a_warmed_document(wl, h):
    pts = {r.id: r for r in wl.sweep([0.5, 0.9, 0.95, 0.99])}
    r = pts[f"sweep/4096/{h:g}"]
    assert r.cached % e2e.PAGE == 0 and r.cached <= h * 4096 < r.cached + e2e.PAGE
    assert len(r.ids) == 4096 + 32
    doc = wl.document(4096, [0.5, 0.9, 0.95, 0.99].index(h) % 2)
    assert r.ids[: r.cached] == doc[: r.cached]
    assert r.ids[r.cached: r.cached + e2e.PAGE] != doc[r.cached: r.cached + e2e.PAGE]


@pytest.mark.parametrize("page", [16, 32])
def test_a_workload_cuts_its_cached_prefixes_to_the_servers_page(page):
    """--page-size 16 or 32 with the harness's own client: a sweep point keeps the most whole
    pages of that size under h*C (more than at 64 where 64 does not divide it), the twin shares
    that prefix, and the warm and reuse prompts count their cached share in those pages."""
    wl16 = e2e.Workload(contexts=(4096,), docs=2, q_tokens=32, page=page)
    wl64 = e2e.Workload(contexts=(4096,), docs=2, q_tokens=32)
    for h in (0.9, 0.95, 0.99):
        (r,) = [x for x in wl16.sweep([h]) if x.id == f"sweep/4096/{h:g}"]
        (r64,) = wl64.sweep([h])
        assert r.cached % page == 0 and r.cached <= h * 4096 < r.cached + page
        assert r.cached >= r64.cached
        point, twin = e2e.sweep_requests(wl16, [h])
        assert twin.cached == point.cached and twin.ids[: point.cached] == point.ids[: point.cached]
    assert wl16.warm()[0].cached == 4096 and wl16.first().cached == 4096
    with pytest.raises(ValueError):
        e2e.Workload(contexts=(4096,), page=0)


def test_sweep_requests_interleave_contexts_and_add_a_compute_only_twin(wl):
    reqs = e2e.sweep_requests(wl, [0.5, 0.9])
    assert [r.id for r in reqs] == ["sweep/2048/0.5", "sweep/2048/0.5/l1", "sweep/4096/0.5", "sweep/4096/0.5/l1",
                                    "sweep/2048/0.9", "sweep/2048/0.9/l1", "sweep/4096/0.9", "sweep/4096/0.9/l1"]
    point, twin = reqs[2], reqs[3]
    assert twin.ids[: point.cached] == point.ids[: point.cached]
    assert len(twin.ids) == len(point.ids) and twin.ids[point.cached:] != point.ids[point.cached:]


def test_rates_and_capacity_are_seeded_reuses_of_warmed_documents(wl):
    docs = {tuple(wl.document(c, d)) for c in wl.contexts for d in range(wl.docs)}
    reqs = wl.rates(2.0, 10)
    assert len(reqs) == 10 and len({r.id for r in reqs}) == 10
    assert all(tuple(r.ids[: r.context]) in docs for r in reqs)
    assert [r.ids for r in wl.rates(2.0, 10)] == [r.ids for r in reqs]
    warm = wl.capacity_warm(5, 2048)
    reuse = wl.capacity_reuse(5, 2048, 5)
    assert sorted(tuple(r.ids[:2048]) for r in reuse) == sorted(tuple(r.ids[:2048]) for r in warm)
    assert not {tuple(r.ids[:2048]) for r in warm} & docs  # its own documents


def _rec(rid, ttft, out=(1, 2), cached=0, itl=(0.01,), prompt=100, details=None):
    return {"id": rid, "ttft_s": ttft, "itl_s": list(itl), "cached_tokens": cached, "output_ids": list(out),
            "prompt_tokens": prompt, "details": details}


def test_summarize_counts_failures_and_tiers():
    s = e2e.summarize([_rec("a", 0.1, details={"device": 0, "host": 64, "storage": 0}),
                       _rec("b", 0.3, details={"device": 64, "host": 0}),
                       {"id": "c", "ttft_s": None, "error": "x"}], seconds=2.0)
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["ttft_mean_ms"] == pytest.approx(200) and s["ttft_p50_ms"] == pytest.approx(200)
    assert s["itl_mean_ms"] == pytest.approx(10) and s["throughput_rps"] == pytest.approx(1.0)
    assert s["cached_by_tier_mean"] == {"device": 32, "host": 32, "storage": 0}


def _runs():
    bpt = e2e.bytes_per_token(8)
    mk = lambda cfg, sweep, rates, **kw: {"config": cfg, "medium": "m", "raw_read_GBps": 10.0, **kw,
                                          "phases": {"sweep": sweep, **{f"rate{r:g}": [] for r in rates}},
                                          "summaries": {f"rate{r:g}": {"ttft_mean_ms": t, "failed": 0}
                                                        for r, t in rates.items()}}
    cached = 4096
    runs = [
        mk("recompute", [_rec("sweep/4096/0.9", 1.0), _rec("sweep/4096/0.9/l1", 1.0, out=(7, 7))],
           {0.5: 900.0, 1: 1500.0}),
        mk("dram", [_rec("sweep/4096/0.9", 0.2)], {0.5: 300.0, 1: 400.0}),
        mk("tutti-linker", [dict(_rec("sweep/4096/0.9", 0.25), cached=cached),
                            _rec("sweep/4096/0.9/l1", 0.1, out=(7, 8))], {0.5: 200.0, 1: 250.0, 2: 1200.0}),
    ]
    for r in runs[2]["phases"]["sweep"]:
        r["cached"] = r["cached_tokens"] = cached
    return runs, bpt, cached


def test_sweep_rows_ratios():
    runs, bpt, cached = _runs()
    rows = [r for r in e2e_report.sweep_rows(runs, bpt) if r["config"] == "tutti-linker"]
    assert len(rows) == 1
    row = rows[0]
    io_ms = cached * bpt / 10e9 * 1e3
    assert row["io_floor_ms"] == pytest.approx(io_ms)
    assert row["compute_ms"] == pytest.approx(100)
    assert row["vs_bound"] == pytest.approx(0.25 / max(0.1, io_ms / 1e3))
    assert row["vs_dram"] == pytest.approx(1.25) and row["vs_recompute"] == pytest.approx(0.25)


def test_each_run_prices_its_io_floor_at_its_own_bytes_per_token():
    """A report over a bf16 and an fp8 run (plot_e2e passes one bpt for all): each run's floor
    comes from the page bytes its server recorded, so fp8's floor is half of bf16's."""
    runs, bpt, cached = _runs()
    fp8 = dict(runs[2], config="tutti-linker", medium="fp8", page_size=64, page_bytes=bpt * 64 // 2)
    bf16 = dict(runs[2], page_size=64, page_bytes=bpt * 64)
    floors = {r["medium"]: r["io_floor_ms"] for r in e2e_report.sweep_rows([bf16, fp8], bpt * 4)
              if r["config"] == "tutti-linker"}
    assert floors[fp8["medium"]] == pytest.approx(cached * bpt / 2 / 10e9 * 1e3)
    assert floors[bf16["medium"]] == pytest.approx(cached * bpt / 10e9 * 1e3)


def test_slo_and_outputs_and_report():
    runs, bpt, _ = _runs()
    slo = {r["config"]: r["max_rate_within_slo"] for r in e2e_report.slo_rows(runs, 1000.0)}
    assert slo == {"recompute": 0.5, "dram": 1.0, "tutti-linker": 1.0}
    eq = e2e.outputs_vs(runs)
    assert eq["tutti-linker@m"]["sweep"] == {"compared": 2, "equal": 1, "with_logprobs": 0,
                                             "max_logprob_diff": None, "mismatches": ["sweep/4096/0.9/l1"]}
    assert (eq["dram@m"]["sweep"]["equal"], eq["dram@m"]["sweep"]["compared"]) == (1, 1)
    text = e2e_report.report_markdown(runs, bpt)
    for part in ("Hit-fraction sweep", "max rate in SLO", "Capacity phase", "Per configuration"):
        assert part in text
    assert "| m | 4096 | 0.9 | 1000 | 200 | 250 | 100 |" in text  # recompute, dram, linker, compute only
    assert "| 4.0 |" in text  # recompute / linker
    runs[0].update(raw_request_bytes=72 << 10, raw_request_GBps=6.5)  # the linker's request size
    assert "(10.00; 6.50 in 72 KiB)" in e2e_report.report_markdown(runs, bpt)


def test_sweep_table_names_whose_ratio_to_the_bound_it_shows():
    """With the linker in the rows its ratio is the column; without it (a baseline's call alone),
    the column is headed by the configuration it comes from."""
    runs, bpt, _ = _runs()
    assert "| linker / max(compute, I/O) |" in e2e_report.report_markdown(runs, bpt)
    runs = [r for r in runs if r["config"] != "dram"]
    for r in runs:
        if r["config"] == "tutti-linker":
            r["config"] = "lmcache-dram"
    text = e2e_report.report_markdown(runs, bpt)
    assert "| lmcache-dram / max(compute, I/O) |" in text and "| linker / max" not in text


def test_capacity_rows_hit_rate():
    runs = [{"config": "dram", "medium": "m", "phases": {"capacity": [
        _rec("cap/1", 0.5, cached=0, prompt=1000), _rec("cap/2", 0.1, cached=960, prompt=1000)]}}]
    row = e2e_report.capacity_rows(runs)[0]
    assert row["token_hit_rate"] == pytest.approx(0.48) and row["requests_with_hit"] == 0.5


def test_capacity_rows_one_per_alpha_with_tier_shares():
    tiers = {"device": 0, "host": 600, "storage": 300}
    runs = [{"config": "tutti-tiered", "medium": "m",
             "serving": {"capacity0.8": {"shape": {"zipf": 0.8}}, "capacity1": {"shape": {"zipf": 1.0}}},
             "phases": {"capwarm": [_rec("w", 1.0)],
                        "capacity0.8": [_rec("a", 0.2, cached=900, prompt=1000, details=tiers),
                                        {"id": "b", "ttft_s": None, "error": "x", "prompt_tokens": 1000}],
                        "capacity1": [_rec("c", 0.1, cached=900, prompt=1000, details=tiers)]}}]
    rows = e2e_report.capacity_rows(runs)
    assert [(r["phase"], r["zipf_alpha"]) for r in rows] == [("capacity0.8", 0.8), ("capacity1", 1.0)]
    assert rows[0]["tier_hit_rate"] == pytest.approx({"device": 0, "host": 0.3, "storage": 0.15})
    assert rows[1]["tier_hit_rate"] == pytest.approx({"device": 0, "host": 0.6, "storage": 0.3})
    assert "| m | tutti-tiered | 1 |" in e2e_report.report_markdown(runs, 1)
    assert rows[0]["dram_page_share_run"] is None  # no stats: no tier to count
    # tutti's stats count the pages DRAM gave, mixed loads too (two processes: a restart)
    runs[0]["tutti_stats"] = [{"linker": {"load_pages": 300, "load_host_pages": 90, "host_slots": 8}},
                              {"linker": {"load_pages": 100, "load_host_pages": 10, "host_slots": 8}},
                              {"read_pages": 5}]
    assert e2e_report.capacity_rows(runs)[1]["dram_page_share_run"] == pytest.approx(0.25)
    assert e2e_report.report_markdown(runs, 1).count("| 0.25 |") == 2
    runs[0]["tutti_stats"] = [{"linker": {"load_pages": 300, "load_host_pages": 0}}]  # SSD-only linker
    assert e2e_report.capacity_rows(runs)[0]["dram_page_share_run"] is None


def test_output_ids_cumulative_or_incremental():
    assert e2e.output_ids([[5], [5, 6], [5, 6, 7]]) == [5, 6, 7]
    assert e2e.output_ids([[5], [6], [7]]) == [5, 6, 7]


@pytest.mark.slow
@pytest.mark.sglang
def test_every_configuration_parses_with_sglangs_own_arguments(tmp_path):
    from tutti_hicache.testing.sglang import ensure_sglang
    ensure_sglang()
    from sglang.srt.server_args import ServerArgs

    from tutti_hicache import plugin
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    plugin._add_choices(None, parser)
    args = argparse.Namespace(model=str(tmp_path), max_total_tokens=150000, dram_gb=14, host_gb=6,
                              one_dir=str(tmp_path / "one"), tutti_dirs=f"{tmp_path}/a,{tmp_path}/b",
                              capacity_gb=60, out_dir=str(tmp_path))
    for config in configs.CONFIGS:
        argv, env = configs.server_cmd(args, config, 30000)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        ns = parser.parse_args(argv[3:])
        assert ns.max_total_tokens == 150000 and ns.page_size == e2e.PAGE
        linker = config in configs.LINKERS
        lmc = config in configs.LMCACHE
        assert ns.enable_hierarchical_cache == (config != "recompute" and not linker and not lmc)
        assert ns.enable_lmcache == lmc
        if lmc:  # SGLang dials the harness's daemon, whose port the YAML names
            with open(ns.lmcache_config_file) as f:
                assert f"mp_port: {configs.lmcache_port(30000)}" in f.read()
        assert ns.enable_unified_cache_external_linker == linker
        if linker and config != "tutti-linker-dynamic":
            cfg = ns.unified_cache_external_linker_config
            assert cfg["tutti_timeline_file"].endswith(".jsonl")
            # the SSD-only linker has no DRAM tier; the tiered one has dram's GB
            assert cfg["tutti_host_gb"] == (args.dram_gb if config == "tutti-tiered" else 0)
        if config == "tutti-host-readme":
            assert ns.hicache_storage_prefetch_policy == "wait_complete" and ns.hicache_ratio == 2
            assert ns.hicache_mem_layout == "layer_first" and not ns.hicache_size
        if config == "tutti-host-defaults":  # SGLang's own defaults for every other flag
            assert ns.hicache_storage_prefetch_policy == "timeout" and ns.hicache_storage_backend == "tutti"
        if config == "file":
            assert env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(tmp_path / "one" / "file")
        if config == configs.CLUSTER:  # node A by default; B gets its own directories and keys
            assert ns.hicache_storage_backend == "tutti-mooncake" and ns.mem_fraction_static == 0.35
            assert ns.hicache_mem_layout == "page_first_direct"
            argv, _ = configs.server_cmd(args, config, 30050, "b", {"master_server_address": "127.0.0.1:5",
                                                                 "tutti_cluster_promote": False})
            extra = json.loads(parser.parse_args(argv[3:]).hicache_storage_backend_extra_config)
            assert extra["tutti_dirs"] == [f"{tmp_path}/a/tutti-b", f"{tmp_path}/b/tutti-b"]
            assert extra["master_server_address"] == "127.0.0.1:5" and not extra["tutti_cluster_promote"]
            assert "stats-tutti-mooncake-b-" in extra["tutti_stats_file"]
    with pytest.raises(ValueError):
        configs.server_cmd(args, "lmcache", 30000)
    assert parser.parse_args(configs.server_cmd(args, "recompute", 30000)[0][3:]).load_format == "dummy"
    args.weights = "seeded"  # the seeded checkpoint: SGLang's own loader (safetensors)
    assert parser.parse_args(configs.server_cmd(args, "recompute", 30000)[0][3:]).load_format == "auto"
    del args.weights
    # CUDA graphs: eager by default; --cuda-graph-max-bs N gives decode graphs, never prefill ones
    assert parser.parse_args(configs.server_cmd(args, "tutti-linker", 30000)[0][3:]).disable_cuda_graph
    args.cuda_graph_max_bs = 4
    ns = parser.parse_args(configs.server_cmd(args, "tutti-linker", 30000)[0][3:])
    if hasattr(ns, "cuda_graph_max_bs_decode"):  # 0.5.23
        assert ns.cuda_graph_max_bs_decode == 4 and ns.cuda_graph_backend_prefill == "disabled"
    else:  # 0.5.17
        assert ns.cuda_graph_max_bs == 4 and ns.disable_piecewise_cuda_graph
    assert not ns.disable_cuda_graph
    assert configs.graph_flags(2, "0.5.17") == ["--cuda-graph-max-bs", "2", "--disable-piecewise-cuda-graph"]
    assert configs.graph_flags(2, "0.5.23")[-2:] == ["--cuda-graph-max-bs-decode", "2"]
    assert configs.graph_flags(2, "0.5.23", prefill=True) == ["--cuda-graph-max-bs-decode", "2"]
    assert configs.graph_flags(2, "0.5.17", prefill=True) == ["--cuda-graph-max-bs", "2"]
    args.prefill_graphs = True
    ns = parser.parse_args(configs.server_cmd(args, "tutti-linker", 30000)[0][3:])
    assert getattr(ns, "cuda_graph_backend_prefill", None) is None and not ns.disable_cuda_graph
    del args.cuda_graph_max_bs, args.prefill_graphs
    # a variant: the base configuration's server with tutti settings on top, its own stats files
    argv, _ = configs.server_cmd(args, "tutti-linker+tutti_threads=4+tutti_verify=false", 30000)
    cfg = parser.parse_args(argv[3:]).unified_cache_external_linker_config
    assert cfg["tutti_threads"] == "4" and cfg["tutti_verify"] == "false"
    assert "stats-tutti-linker+tutti_threads=4+tutti_verify=false-" in cfg["tutti_stats_file"]
    argv, _ = configs.server_cmd(args, "tutti-host+tutti_read_ahead=2", 30000)
    extra = json.loads(parser.parse_args(argv[3:]).hicache_storage_backend_extra_config)
    assert extra["tutti_read_ahead"] == "2" and extra["tutti_dirs"] == [f"{tmp_path}/a/tutti", f"{tmp_path}/b/tutti"]
    for bad in ("dram+tutti_threads=4", "tutti-linker+threads=4", "tutti-linker+tutti_threads", "tutti+x=1"):
        with pytest.raises(ValueError):
            configs.split_config(bad)
    assert configs.split_config("tutti-linker") == ("tutti-linker", {})


def test_config_files_match_one_configuration_exactly(tmp_path):
    """Stats and timeline files per configuration: tutti-linker's are not tutti-linker-dynamic's nor
    a variant's; the cluster run's node files (-a-, -b-) belong to tutti-mooncake."""
    from tutti_hicache.benchmarks.server import config_files, tutti_stats
    names = ["stats-tutti-linker-11.json", "stats-tutti-linker-dynamic-12.json",
             "stats-tutti-linker+tutti_threads=4-13.json", "timeline-tutti-linker-11.jsonl",
             "stats-tutti-mooncake-a-14.json", "stats-tutti-mooncake-b-15.json", "stats-tutti-linker-x.json"]
    for i, n in enumerate(names):
        (tmp_path / n).write_text(json.dumps({"i": i}))
    base = lambda paths: [os.path.basename(p) for p in paths]
    assert base(config_files(str(tmp_path), "stats", "tutti-linker")) == ["stats-tutti-linker-11.json"]
    assert base(config_files(str(tmp_path), "stats", "tutti-linker+tutti_threads=4")) == \
        ["stats-tutti-linker+tutti_threads=4-13.json"]
    assert base(config_files(str(tmp_path), "timeline", "tutti-linker")) == ["timeline-tutti-linker-11.jsonl"]
    assert [s["i"] for s in tutti_stats(str(tmp_path), "tutti-mooncake")] == [4, 5]
    assert [s["i"] for s in tutti_stats(str(tmp_path), "tutti-mooncake-b")] == [5]


def test_timeline_rows_and_their_table():
    """Loads' timeline summaries (bench/e2e_sglang.py keeps them per run): medians per
    configuration, the read rate from pages and page bytes; failed loads and runs without a
    timeline left out; the report gets the table only when some run has one."""
    runs, bpt, _ = _runs()
    assert "Where the loads' time went" not in e2e_report.report_markdown(runs, bpt)
    ok = [{"pages": 100, "reads_ms": r, "handed_ms": r + 2, "react_ms_p50": 0.5, "forward_wait_ms": 10,
           "finish_ms": r + 3} for r in (100.0, 200.0, 400.0)]
    linker = next(r for r in runs if r["config"] == "tutti-linker")
    linker.update(page_bytes=10**7, timeline=ok + [{"pages": 5, "reads_ms": 1.0, "error": "LoadFailed()"}])
    rows = e2e_report.timeline_rows(runs)
    assert len(rows) == 1 and rows[0]["config"] == "tutti-linker" and rows[0]["loads"] == 3
    assert rows[0]["reads_ms"] == 200.0 and rows[0]["handed_ms"] == 202.0 and rows[0]["finish_ms"] == 203.0
    assert rows[0]["read_GBps"] == pytest.approx(5.0)  # 1 GB in 0.2 s
    text = e2e_report.report_markdown(runs, bpt)
    assert "Where the loads' time went" in text and "| m | tutti-linker | 3 | 5.00 | 200.0 |" in text


def test_split_rows_join_requests_with_the_load_that_started_between_send_and_first_token():
    """The client's CLOCK_MONOTONIC send and first-token times against the timeline's load start
    and finish: TTFT = before + load + after, each request with the load inside its own span
    (not a neighbour's); requests without a load there, twins (/l1) and failed loads left out."""
    run = {"config": "tutti-linker", "medium": "m", "phases": {"sweep": [
        {"id": "sweep/4096/0.9", "sent_ns": 1_000_000_000, "first_token_ns": 1_300_000_000},
        {"id": "sweep/4096/0.9/l1", "sent_ns": 1_400_000_000, "first_token_ns": 1_450_000_000,
         "ttft_s": 0.05},
        {"id": "sweep/4096/0.99", "sent_ns": 2_000_000_000, "first_token_ns": 2_250_000_000},
        {"id": "sweep/8192/0.9", "sent_ns": 3_000_000_000, "first_token_ns": 3_100_000_000}]},
        "timeline": [
            {"start_ns": 2_040_000_000, "finish_ns": 2_200_000_000, "reads_ms": 150.0,
             "offload_ns": 2_230_000_000,
             "stream_stall_first_ms": 12.5, "stream_stall_ms": 31.0, "layers_compute_ms": 104.0},
            {"start_ns": 1_030_000_000, "finish_ns": 1_280_000_000, "reads_ms": 240.0,
             "lookup_ns": 1_025_000_000},
            {"start_ns": 1_420_000_000, "finish_ns": 1_440_000_000, "reads_ms": 10.0},
            {"start_ns": 3_010_000_000, "finish_ns": 3_050_000_000, "error": "LoadFailed()"}]}
    rows = e2e_report.split_rows([run, {"config": "dram", "phases": run["phases"]}])
    assert [(r["context"], r["h"]) for r in rows] == [(4096, 0.9), (4096, 0.99)]
    a, b = rows
    assert (a["before_ms"], a["load_ms"], a["after_ms"], a["reads_ms"]) == pytest.approx((30, 250, 20, 240))
    assert a["before_ms"] + a["load_ms"] + a["after_ms"] == pytest.approx(a["ttft_ms"]) == pytest.approx(300)
    assert (b["before_ms"], b["load_ms"], b["after_ms"]) == pytest.approx((40, 160, 50))
    assert a["floor_ms"] is None  # no bytes per token given
    assert a["twin_ms"] == pytest.approx(50) and a["to_lookup_ms"] == pytest.approx(25)
    assert b["twin_ms"] is None and b["to_lookup_ms"] is None
    assert b["to_offload_ms"] == pytest.approx(30) and a["to_offload_ms"] is None
    run["raw_read_GBps"] = 10.0
    run["phases"]["sweep"][2]["cached"] = 1000  # 1000 tokens x 1000 B at 10 GB/s: 0.1 ms of I/O
    text = e2e_report.report_markdown([run], 1000)
    assert "| m | tutti-linker | 4096 | 0.99 | 250 | - | 40.0 | - | 160.0 | 150.0 | 50.0 | 30.0 | 90 | 2.77 | - / - | 12.5 / 31.0 " \
        "| 104.0 / - |" in text
    assert "| m | tutti-linker | 4096 | 0.9 | 300 | 50 | 30.0 | 25.0 | 250.0 | 240.0 | 20.0 | - | - | - | - / - | - / - | - / - |" \
        in text
    assert e2e_report.split_rows([run], 1000)[1]["floor_ms"] == pytest.approx(90.1)


def test_a_salted_workload_keeps_the_documents_and_changes_what_follows():
    """--share-linker-store: a second linker configuration asks salted prompts on the same store:
    the documents (hence the stored prefixes) are the same, everything after them differs, and the
    ids say so, so no salted output is compared with an unsalted recompute."""
    a, b = e2e.Workload([4096], 2), e2e.Workload([4096], 2, salt=1)
    assert a.document(4096, 1) == b.document(4096, 1) and a.system == b.system
    sa, sb = a.sweep([0.9]), b.sweep([0.9])
    assert [r.id for r in sa] == ["sweep/4096/0.9"] and [r.id for r in sb] == ["sweep~s1/4096/0.9"]
    assert sa[0].cached == sb[0].cached and sa[0].ids[: sa[0].cached] == sb[0].ids[: sb[0].cached]
    assert sa[0].ids[sa[0].cached:] != sb[0].ids[sb[0].cached:]
    ta, tb = e2e.sweep_requests(a, [0.9])[1], e2e.sweep_requests(b, [0.9])[1]
    assert tb.id == "sweep~s1/4096/0.9/l1" and ta.ids[ta.cached:] != tb.ids[tb.cached:]
    assert a.first().id == "first/4096/0" and b.first().id == "first~s1/4096/0"
    assert a.first().ids != b.first().ids and a.warm()[0].ids[:4096] == b.warm()[0].ids[:4096]
    assert b.capacity_warm(1, 4096)[0].ids[:4096] == a.capacity_warm(1, 4096)[0].ids[:4096]
    rec = {"id": "sweep~s1/4096/0.9", "output_ids": [1], "ttft_s": 0.1}
    runs = [{"config": "recompute", "medium": "m", "phases": {"sweep": [{"id": "sweep/4096/0.9", "output_ids": [2]}]}},
            {"config": "tutti-linker-dynamic", "medium": "m", "phases": {"sweep": [rec]}}]
    assert e2e.outputs_vs(runs)["tutti-linker-dynamic@m"]["sweep"]["compared"] == 0
    assert e2e_report.sweep_rows([runs[1]], 1000)[0]["h"] == 0.9


def test_a_run_cut_off_keeps_the_phases_it_finished(tmp_path, monkeypatch):
    """bench/e2e_sglang.py writes the JSON after every phase: a configuration interrupted (the
    time limit's SIGINT) mid-way is in it, marked partial, with its finished phases, beside the
    configurations that had finished."""
    import sys
    mod = e2e_sglang

    def fake_run(args, config, wl, raw, deadline, store_from=""):
        run = {"config": config, "medium": "m", "phases": {}, "summaries": {}}
        mod.record_phase(run, "warm", [{"id": "w", "ttft_s": 0.1, "cached_tokens": 0}])
        if config == "tutti-host":
            raise KeyboardInterrupt
        return run
    monkeypatch.setattr(mod, "run_config", fake_run)
    monkeypatch.setattr(mod, "raw_read_dirs", lambda *a, **k: {"raw_read_GBps": 1.0, "raw_engine_GBps": 1.0})
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["x", "--medium", "m", "--tutti-dirs", str(tmp_path / "a"),
                                      "--one-dir", str(tmp_path / "o"), "--configs", "recompute,tutti-host",
                                      "--contexts", "4096", "--json", str(out), "--out-dir", str(tmp_path / "l")])
    with pytest.raises(KeyboardInterrupt):
        mod.main()
    runs = json.loads(out.read_text())
    assert [(r["config"], r.get("partial", False)) for r in runs] == [("recompute", False), ("tutti-host", True)]
    assert list(runs[1]["phases"]) == ["warm"] and runs[1]["summaries"]["warm"]["requests"] == 1


def test_the_first_configuration_always_starts_and_later_ones_wait_for_time(tmp_path, monkeypatch):
    """--config-s larger than the whole budget: the first configuration still runs (its phases
    are cut by the deadline), a later one is skipped as out of time."""
    import sys
    mod = e2e_sglang
    started = []

    def fake_run(args, config, wl, raw, deadline, store_from=""):
        started.append(config)
        return {"config": config, "medium": "m", "phases": {}, "summaries": {}}
    monkeypatch.setattr(mod, "run_config", fake_run)
    monkeypatch.setattr(mod, "raw_read_dirs", lambda *a, **k: {"raw_read_GBps": 1.0, "raw_engine_GBps": 1.0})
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["x", "--medium", "m", "--tutti-dirs", str(tmp_path / "a"),
                                      "--one-dir", str(tmp_path / "o"), "--configs", "tutti-tiered,dram",
                                      "--contexts", "4096", "--json", str(out), "--out-dir", str(tmp_path / "l"),
                                      "--deadline-s", "100", "--config-s", "380"])
    mod.main()
    runs = json.loads(out.read_text())
    assert started == ["tutti-tiered"]
    assert [(r["config"], r.get("skipped")) for r in runs] == [("tutti-tiered", None), ("dram", "out of time")]


def test_share_linker_store_order(tmp_path, monkeypatch):
    """bench/e2e_sglang.py --share-linker-store: the first linker configuration that warmed writes
    the store; later linker configurations start on it with salts 1, 2, ...; others never share."""
    import sys
    mod = e2e_sglang
    calls = []

    def fake_run(args, config, wl, raw, deadline, store_from=""):
        calls.append((config, store_from, wl.salt))
        return {"config": config, "medium": "m", "phases": {} if store_from else {"warm": []},
                "store_from": store_from or None}
    monkeypatch.setattr(mod, "run_config", fake_run)
    monkeypatch.setattr(mod, "raw_read_dirs", lambda *a, **k: {"raw_read_GBps": 1.0, "raw_engine_GBps": 1.0})
    argv = ["x", "--medium", "m", "--tutti-dirs", str(tmp_path / "a"), "--one-dir", str(tmp_path / "o"),
            "--configs", "dram,tutti-linker,tutti-linker+tutti_threads=4,tutti-linker-dynamic", "--contexts", "4096",
            "--json", str(tmp_path / "out.json"), "--out-dir", str(tmp_path / "logs"), "--share-linker-store"]
    monkeypatch.setattr(sys, "argv", argv)
    mod.main()
    assert calls == [("dram", "", 0), ("tutti-linker", "", 0), ("tutti-linker+tutti_threads=4", "tutti-linker", 1),
                     ("tutti-linker-dynamic", "tutti-linker", 2)]
    calls.clear()
    (tmp_path / "out.json").unlink()
    monkeypatch.setattr(sys, "argv", [a for a in argv if a != "--share-linker-store"])
    mod.main()
    assert all(c[1] == "" and c[2] == 0 for c in calls)


def test_the_io_floor_takes_the_faster_of_the_raw_reads_before_and_after(tmp_path, monkeypatch):
    """The medium's raw read is taken before and after the configurations; every run keeps both
    and raw_read_GBps (the I/O floor's rate) is the faster one."""
    import sys
    mod = e2e_sglang
    reads = iter([5.0, 1.0, 7.0])  # the array before, the one directory, the array after
    at_request = iter([4.0, 3.0])  # tutti's engine in the linker's requests, before and after
    sizes = []

    def raw_read_dirs(dirs, nbytes, threads=8, engine_req=0):
        out = {"raw_read_GBps": next(reads)}
        if engine_req:  # the array's reads ask for it too, the one directory's do not
            sizes.append(engine_req)
            out["raw_engine_GBps"] = next(at_request)
        return out
    monkeypatch.setattr(mod, "raw_read_dirs", raw_read_dirs)
    monkeypatch.setattr(mod, "run_config", lambda args, config, wl, raw, deadline, store_from="":
                        {"config": config, "medium": "m", **raw, "phases": {}})
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["x", "--medium", "m", "--tutti-dirs", str(tmp_path / "a"),
                                      "--one-dir", str(tmp_path / "o"), "--configs", "tutti-linker",
                                      "--contexts", "4096", "--json", str(out), "--out-dir", str(tmp_path / "l")])
    mod.main()
    run, = json.loads(out.read_text())
    assert (run["raw_read_before_GBps"], run["raw_read_after_GBps"], run["raw_read_GBps"]) == (5.0, 7.0, 7.0)
    assert run["raw_read_one_dir_GBps"] == 1.0
    # the default shape's (Llama-3-8B, bf16, page 64) request: K and V of one layer, 2 x 128 KiB
    assert sizes == [256 << 10] * 2 and run["raw_request_bytes"] == 256 << 10
    assert run["raw_request_GBps"] == 4.0
    # a partial run an earlier, killed call left in the JSON keeps its own raw read: the next
    # call's after-read is not this run's (review finding)
    left = {"config": "dram", "medium": "m", "raw_read_GBps": 2.0, "phases": {}}
    out.write_text(json.dumps([left]))
    reads, at_request = iter([5.0, 1.0, 9.0]), iter([4.0, 3.0])
    mod.main()
    old, new = json.loads(out.read_text())
    assert old["raw_read_GBps"] == 2.0 and "raw_read_after_GBps" not in old
    assert new["raw_read_after_GBps"] == 9.0 and new["raw_read_GBps"] == 9.0


def test_a_forward_record_with_a_host_anchor_places_its_layers_on_the_host_clock():
    """last_passed_ns (the host time the GPU passed the last layer's wait) minus the layers'
    spans and the later layers' stalls = when the GPU began layer 0, ms from the load's start."""
    from tutti_hicache.benchmarks import timeline
    rec = {"start_ns": 1_000_000_000, "forward": {
        "stall_ms": [5.0, 1.0, 2.0], "span_ms": [10.0, 10.0], "clock": "gpu",
        "last_passed_ns": 1_050_000_000}}
    s = timeline.summarize(rec)
    assert s["gpu_last_layer_ms"] == 50.0 and s["gpu_layer0_ms"] == pytest.approx(50 - 20 - 3)
    del rec["forward"]["last_passed_ns"]
    assert "gpu_layer0_ms" not in timeline.summarize(rec)


def test_timeline_files_from_before_seq_match_forwards_only_where_no_index_repeats(tmp_path):
    """Loads numbered by `index` alone (it restarts at every reset): two loads with index 0 and
    one forward_of 0 cannot be told apart, so neither gets it; a file whose indices are unique
    still matches."""
    import json
    from tutti_hicache.benchmarks import timeline
    fwd = {"forward_of": 0, "stall_ms": [0.0], "span_ms": [], "clock": "gpu"}
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in [{"index": 0, "start_ns": 1}, {"index": 0, "start_ns": 2}, fwd]))
    assert all("forward" not in r for r in timeline.read([a]))
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(json.dumps(r) for r in [{"index": 0, "start_ns": 1}, {"index": 1, "start_ns": 2}, fwd]))
    assert [("forward" in r) for r in timeline.read([b])] == [True, False]


def test_model_shapes_their_kv_bytes_and_server_flags(tmp_path):
    """configs.MODELS: the issue-33 geometries. Their KV bytes per token (GQA: K and V of the KV
    heads; MLA: one latent of kv_lora_rank + rope dims; fp8: a byte per element), their
    config.json with --layers, and --kv-cache-dtype /
    --attention-backend on every configuration's server."""
    assert configs.kv_bytes_per_token("llama3-8b", 32) == e2e.bytes_per_token(32) == 131072
    assert configs.kv_bytes_per_token("llama3-70b", 80) == 2 * 8 * 128 * 2 * 80
    assert configs.kv_bytes_per_token("qwen3-30b-a3b", 48) == 2 * 4 * 128 * 2 * 48
    assert configs.kv_bytes_per_token("deepseek-v2-lite", 27) == (512 + 64) * 2 * 27
    assert configs.kv_bytes_per_token("llama3-8b", 32, "fp8_e4m3") == 65536
    configs.write_model(str(tmp_path / "ds"), 4, shape="deepseek-v2-lite")
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["kv_lora_rank"] == 512 and cfg["model_type"] == "deepseek_v2"
    with pytest.raises(ValueError, match="model shape"):
        configs.write_model(str(tmp_path / "x"), 4, shape="gpt2")
    args = argparse.Namespace(model=str(tmp_path / "ds"), max_total_tokens=1000, kv_cache_dtype="fp8_e4m3",
                              attention_backend="flashinfer", tutti_dirs=str(tmp_path), capacity_gb=1,
                              out_dir=str(tmp_path), dram_gb=1, host_gb=1, one_dir=str(tmp_path))
    for config in ("recompute", "tutti-linker", "tutti-host"):
        argv, _ = configs.server_cmd(args, config, 30000)
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
        assert argv[argv.index("--attention-backend") + 1] == "flashinfer"
    args.kv_cache_dtype = "auto"
    assert "--kv-cache-dtype" not in configs.server_cmd(args, "recompute", 30000)[0]


@pytest.mark.slow
def test_lmcache_daemon_commands_and_why_it_cannot_start_here(tmp_path):
    import socket
    import sys

    from tutti_hicache.benchmarks import lmcache_daemon as lmc
    one = str(tmp_path / "one")
    dram = lmc.daemon_cmd("lmcache-dram", 35011, 36011, one, 30)
    assert dram[1:4] == ["-m", "lmcache.cli.main", "server"] and "--gds-l1-path" not in dram
    assert dram[dram.index("--l1-size-gb") + 1] == "30" and dram[dram.index("--port") + 1] == "35011"
    assert dram[dram.index("--http-host") + 1] == "127.0.0.1"  # LMCache's default is 0.0.0.0
    ssd = lmc.daemon_cmd("lmcache-ssd", 35012, 36012, one, 30)
    adapter = json.loads(ssd[ssd.index("--l2-adapter") + 1])
    assert adapter == {"type": "fs_native", "base_path": f"{one}/lmc", "num_workers": 16, "use_odirect": True}
    # its L1 stages the L2's restores (one 32K document's prefetch is 4.3 GB), whatever --dram-gb
    assert ssd[ssd.index("--l1-size-gb") + 1] == str(lmc.SSD_L1_GB) == "16"
    # its L1 stages L2 reads: evicted early so a prefetch of a whole 32K document finds room
    assert ssd[ssd.index("--eviction-trigger-watermark") + 1] == "0.25"
    assert ssd[ssd.index("--eviction-ratio") + 1] == "0.8"
    assert "--eviction-ratio" not in dram  # LMCache's defaults where L1 is the cache
    gds = lmc.daemon_cmd("lmcache-gds", 35013, 36013, one, 30)
    assert gds[gds.index("--gds-l1-path") + 1] == f"{one}/lmc-gds"
    with pytest.raises(ValueError, match="unknown LMCache configuration"):
        lmc.daemon_cmd("lmcache", 1, 2, one, 1)
    # who moves the KV: the daemon (LMCache's default) or, with +engine_driven, SGLang's worker;
    # the server is told the same mode
    assert dram[dram.index("--supported-transfer-mode") + 1] == "lmcache_driven"
    mode = configs.lmcache_transfer_mode("lmcache-dram+engine_driven")
    eng = lmc.daemon_cmd("lmcache-dram", 35011, 36011, one, 30, mode)
    assert eng[eng.index("--supported-transfer-mode") + 1] == "engine_driven"
    with pytest.raises(ValueError, match="transfer mode"):
        lmc.daemon_cmd("lmcache-dram", 1, 2, one, 1, "auto")
    assert configs.split_config("lmcache-ssd+engine_driven") == ("lmcache-ssd", {})
    with pytest.raises(ValueError, match="LMCache variant"):
        configs.split_config("tutti-linker+engine_driven")
    sargs = argparse.Namespace(model=str(tmp_path), max_total_tokens=1000, dram_gb=1, host_gb=1, one_dir=one,
                               tutti_dirs=one, capacity_gb=1, out_dir=str(tmp_path))
    for name, want in (("lmcache-dram", "lmcache_driven"), ("lmcache-dram+engine_driven", "engine_driven")):
        assert configs.server_cmd(sargs, name, 30000)[1]["LMCACHE_MP_TRANSFER_MODE"] == want
    # not installed here (CI): the reason names what SGLang needs, and the harness records it
    if __import__("importlib").util.find_spec("lmcache") is None:
        why = lmc.unavailable()
        assert "not installed" in why and "0.5.6" in why
        args = argparse.Namespace(out_dir=str(tmp_path), one_dir=one, dram_gb=4, start_timeout=5)
        from tutti_hicache.benchmarks import e2e_sglang
        run = e2e_sglang.with_lmcache(args, "lmcache-ssd", {"phases": {}}, 30012,
                                      lambda: pytest.fail("no phase runs without LMCache"))
        assert run["skipped"] == why
    # a daemon that dies: its log's last lines in the error; one that listens: ready
    dead = lmc.Daemon([sys.executable, "-c", "import sys; print('cuda_ops: undefined symbol'); sys.exit(3)"],
                      str(tmp_path / "dead.log"), 1)
    with pytest.raises(RuntimeError, match="exited with 3: .*undefined symbol"):
        dead.wait_ready(30)
    dead.stop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
            "time.sleep(60)")
    up = lmc.Daemon([sys.executable, "-c", code], str(tmp_path / "up.log"), port)
    try:
        assert up.wait_ready(30) >= 0
    finally:
        up.stop()
    assert not up.alive()
    with open(lmc.write_client_config(str(tmp_path / "c.yaml"), 35011)) as f:
        assert "mp_port: 35011" in f.read()


def test_lmcache_restore_rate_comes_from_its_daemon_log(tmp_path):
    """LMCache reports no restore rate to SGLang; its daemon logs each retrieve's tokens and
    seconds, which with the model's KV bytes per token give the GB/s the report shows."""
    from tutti_hicache.benchmarks import lmcache_daemon as lmc
    log = tmp_path / "lmcache-lmcache-dram.log"
    log.write_text(
        "\x1b[32;20m[2026-12-04 12:27:41,830] LMCache INFO:\x1b[0m Retrieved 32768 tokens in 0.377 "
        "seconds (lmcache_driven_transfer.py:1100:lmcache.v1.multiprocess.modules.lmcache_driven_transfer)\n"
        "[2026-12-04 12:27:41,900] LMCache INFO: Stored 512 tokens in 0.019 seconds (x.py:834)\n"
        "[2026-12-04 12:27:42,258] LMCache INFO: Retrieved 16384 tokens in 0.125 seconds (x.py:1100)\n"
        "[2026-12-04 12:27:42,300] LMCache INFO: Retrieved 0 tokens in 0.000 seconds (x.py:1100)\n")
    out = lmc.retrieve_summary(str(log), 131072)  # Llama-3-8B: 32 layers x K, V x 8 x 128 x 2 B
    r = out["lmcache_retrieves"]
    assert (r["count"], r["tokens"]) == (2, 49152) and r["seconds"] == pytest.approx(0.502)
    assert out["restore_GBps"] == pytest.approx(49152 * 131072 / 0.502 / 1e9)
    assert r["GBps_min"] == pytest.approx(32768 * 131072 / 0.377 / 1e9) and r["GBps_min"] < r["GBps_max"]
    assert lmc.retrieve_summary(str(tmp_path / "none.log"), 131072) == {}
    (tmp_path / "quiet.log").write_text("LMCache INFO: Stored 512 tokens in 0.019 seconds\n")
    assert lmc.retrieve_summary(str(tmp_path / "quiet.log"), 131072) == {}


def test_lmcache_l2_prefetches_come_from_its_daemon_log(tmp_path):
    """lmcache-ssd restores through L1: its daemon logs each L2 -> L1 prefetch (chunks from L1 and
    from L2, and how long it took) and each prefetch refused L1 room. The summary keeps both, and
    the L2 rate over the prefetches that read any."""
    from tutti_hicache.benchmarks import lmcache_daemon as lmc
    log = tmp_path / "lmcache-lmcache-ssd.log"
    log.write_text(  # lines as LMCache 0.5.6's daemon wrote them on the GPU machine
        "\x1b[33;20m[2026-12-04 14:31:44,684] LMCache WARNING:\x1b[0m prefetch:4: 128 L1 reservations "
        "failed with out-of-memory; L1 may be under memory pressure (prefetch_controller.py:278)\n"
        "[2026-12-04 14:31:45,485] LMCache INFO: Prefetch request completed (L1+L2): 32/128 retained keys "
        "(32 L1, 0 L2) in 1942.1 ms (external_request_id=52e2, prefetch_request_id=5)\n"
        "[2026-12-04 14:31:47,571] LMCache WARNING: prefetch:8: 97 L1 reservations failed with out-of-memory\n"
        "[2026-12-04 14:31:48,638] LMCache INFO: Prefetch request completed (L1+L2): 97/128 retained keys "
        "(0 L1, 97 L2) in 3094.6 ms (external_request_id=89ca, prefetch_request_id=7)\n")
    out = lmc.retrieve_summary(str(log), 131072)
    assert "restore_GBps" not in out  # no retrieve reached SGLang's pool
    p = out["lmcache_prefetches"]
    assert (p["count"], p["chunks_asked"], p["chunks_retained"], p["from_l1"], p["from_l2"]) == \
        (2, 256, 129, 32, 97)
    assert p["l2_seconds"] == pytest.approx(3.0946)
    assert p["l2_GBps"] == pytest.approx(97 * 256 * 131072 / 3.0946 / 1e9)  # ~1.05 GB/s
    assert p["reservations_failed"] == {"prefetches": 2, "chunks": 225}


def test_lmcache_configurations_refuse_a_directory_too_small(tmp_path, monkeypatch):
    """lmcache-gds fallocates its whole L1 in ONE_DIR and lmcache-ssd's L2 keeps every chunk there:
    where the filesystem is too small the harness says so before starting the daemon, naming the
    sizes, instead of a daemon dying with ENOSPC or a run measuring recompute."""
    import shutil
    from tutti_hicache.benchmarks import lmcache_daemon as lmc
    free = shutil.disk_usage(tmp_path).free / 1e9
    assert lmc.room_error("lmcache-dram", str(tmp_path), 1e6, 1e6) is None  # DRAM only
    assert lmc.room_error("lmcache-gds", str(tmp_path), free / 2, 1e6) is None
    why = lmc.room_error("lmcache-gds", str(tmp_path), free * 2, 0)
    assert why and "GDS L1 slab" in why and "ONE_GIB" in why
    assert lmc.room_error("lmcache-ssd", str(tmp_path), 1e6, free / 2) is None  # its L1 is DRAM
    why = lmc.room_error("lmcache-ssd", str(tmp_path), 1, free * 2)
    assert why and "working set" in why and f"{free * 2:.1f} GB" in why


def test_report_shows_the_host_tiers_first_and_later_restores():
    """e2e_report.host_restore_rows: from a run's host_calls (timeline.host_summary), the first
    restore's time, pages, rate and SGLang's hit-query-to-read delay beside the later ones'
    medians, so a slow first restore after a restart says on which side it is slow."""
    from tutti_hicache.benchmarks import e2e_report
    rs = [{"start_ms": 0.0, "ms": 380.0, "calls": 5, "pages": 516, "GBps": 11.4, "exists_to_get_ms": 120.0},
          {"start_ms": 900.0, "ms": 250.0, "calls": 5, "pages": 516, "GBps": 17.3, "exists_to_get_ms": 2.0},
          {"start_ms": 1500.0, "ms": 260.0, "calls": 5, "pages": 516, "GBps": 16.6, "exists_to_get_ms": 4.0}]
    run = {"config": "tutti-host-readme", "medium": "array-8",
           "host_calls": {"restores": rs, "exists": {"calls": 3, "ms_p50": 0.2, "ms_max": 0.9}}}
    (row,) = e2e_report.host_restore_rows([run, {"config": "dram", "medium": "array-8"}])
    assert (row["restores"], row["first_ms"], row["first_exists_to_get_ms"]) == (3, 380.0, 120.0)
    assert row["later_ms"] == 255.0 and row["later_exists_to_get_ms"] == 3.0
    md = e2e_report.report_markdown([run], 131072)
    assert "| array-8 | tutti-host-readme | 3 | 380.0 / 516 / 11.40 / 120.0 | 255.0 / 16.95 / 3.0 | - / - | 0 | 0.20 / 0.90 |" in md
    for r, inside in zip(rs, (300.0, 240.0, 250.0)):  # files with the gets' own time
        r["in_calls_ms"], r["sets_during"] = inside, 1
    md = e2e_report.report_markdown([run], 131072)
    assert "| 255.0 / 16.95 / 3.0 | 300.0 / 245.0 | 3 | 0.20 / 0.90 |" in md


def test_report_splits_a_host_tier_requests_ttft_around_its_reads():
    """e2e_report.host_split_rows: a request of the harness's own client (send and first token on
    CLOCK_MONOTONIC) joined with the host-tier restore that began between them: before SGLang's
    hit query, the query to the first read, the reads, and after them; a request with no restore
    inside its span (a device hit) has no row."""
    from tutti_hicache.benchmarks import e2e_report
    ms = 1_000_000
    restores = [{"t0_ns": 1130 * ms, "t1_ns": 1380 * ms, "exists_ns": 1010 * ms, "ms": 250.0, "pages": 516,
                 "GBps": 17.0, "exists_to_get_ms": 120.0, "start_ms": 0.0, "calls": 5}]
    run = {"config": "tutti-host-readme", "medium": "array-8", "host_calls": {"restores": restores},
           "phases": {"first": [{"id": "first/32768", "sent_ns": 1000 * ms, "first_token_ns": 1470 * ms}],
                      "sweep": [{"id": "sweep/32768/0.99", "sent_ns": 5000 * ms, "first_token_ns": 5100 * ms}]}}
    (row,) = e2e_report.host_split_rows([run])
    assert row["id"] == "first/32768" and row["ttft_ms"] == 470.0
    assert (row["before_ms"], row["queue_ms"], row["reads_ms"], row["after_ms"]) == (10.0, 120.0, 250.0, 90.0)
    assert "| array-8 | tutti-host-readme | first/32768 | 470 | 516 | 10.0 | 120.0 | 250.0 | 90.0 |" in \
        e2e_report.report_markdown([run], 131072)


def test_nixl_missing_is_named_before_a_server_starts(tmp_path, monkeypatch):
    """SGLang's nixl backend imports NIXL only when the server attaches it (a minute in); the
    harness finds a missing NIXL first and says what to carry."""
    from tutti_hicache.benchmarks import e2e_sglang
    if __import__("importlib").util.find_spec("nixl") is None:
        why = e2e_sglang.nixl_unavailable()
        assert "NIXL is not installed" in why and "build_nixl_payload.sh" in why
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert e2e_sglang.nixl_unavailable() is None


def test_runs_of_two_models_stay_apart_in_the_report_and_the_output_check():
    """Two files of two models (or KV dtypes) given together: merge_runs keeps both linker runs,
    the sweep table gets a model column with one row each, recompute ratios and outputs come
    only from the same model's recompute: an fp8 linker is never held against bf16 outputs."""
    runs, bpt, cached = _runs()

    def as_model(run, shape, kv="auto"):
        return dict(run, model_shape=shape, layers=12, kv_cache_dtype=kv, weights="seeded", page_size=64,
                    page_bytes=bpt * 64)
    a = [as_model(r, "qwen3-30b-a3b") for r in runs]
    b = [as_model(r, "llama3-70b", "fp8_e4m3") for r in runs if r["config"] == "tutti-linker"]
    merged = e2e_report.merge_runs(a + b)
    assert sorted((r["config"], r["model_shape"]) for r in merged) == [
        ("dram", "qwen3-30b-a3b"), ("recompute", "qwen3-30b-a3b"),
        ("tutti-linker", "llama3-70b"), ("tutti-linker", "qwen3-30b-a3b")]
    rows = [r for r in e2e_report.sweep_rows(merged, bpt) if r["config"] == "tutti-linker"]
    by = {r["model"]: r for r in rows}
    assert set(by) == {"qwen3-30b-a3b/12/auto", "llama3-70b/12/fp8_e4m3"}
    assert by["qwen3-30b-a3b/12/auto"]["vs_recompute"] == pytest.approx(0.25)
    assert by["llama3-70b/12/fp8_e4m3"]["vs_recompute"] is None  # no fp8 recompute given
    table = e2e_report.sweep_pivot(e2e_report.sweep_rows(merged, bpt))
    assert table.splitlines()[0].startswith("| model | medium |") and len(table.splitlines()) == 4
    eq_fp8 = e2e.outputs_vs([r for r in merged if r["model_shape"] == "qwen3-30b-a3b" and
                             r["config"] == "recompute"] + b)
    assert eq_fp8[e2e.run_key(b[0])]["sweep"]["compared"] == 0
    lin_a = next(r for r in a if r["config"] == "tutti-linker")
    eq_same = e2e.outputs_vs(a)
    assert eq_same[e2e.run_key(lin_a)]["sweep"]["compared"] == 2


def test_two_models_keep_an_output_check_each_in_one_report():
    """Two models' linker runs on one medium, each beside its own model's recompute: the output
    check of each is filed under its own key (config@medium alone made the second overwrite the
    first), and the report's output table lists both with a model column."""
    runs, bpt, _ = _runs()

    def as_model(run, shape):
        return dict(copy.deepcopy(run), model_shape=shape, layers=12, kv_cache_dtype="auto", weights="seeded",
                    page_size=64, page_bytes=bpt * 64)
    a = [as_model(r, "qwen3-30b-a3b") for r in runs if r["config"] in ("recompute", "tutti-linker")]
    b = [as_model(r, "llama3-70b") for r in runs if r["config"] in ("recompute", "tutti-linker")]
    b_lin = next(r for r in b if r["config"] == "tutti-linker")
    for rec in b_lin["phases"]["sweep"]:  # model b's linker matches its recompute everywhere
        ref = next(x for x in next(r for r in b if r["config"] == "recompute")["phases"]["sweep"]
                   if x["id"] == rec["id"])
        rec["output_ids"] = list(ref["output_ids"]) if ref.get("output_ids") is not None else rec.get("output_ids")
    eq = e2e.outputs_vs(a + b)
    lin_a = next(r for r in a if r["config"] == "tutti-linker")
    assert e2e.run_key(lin_a) != e2e.run_key(b_lin)
    assert eq[e2e.run_key(lin_a)]["sweep"]["mismatches"] == ["sweep/4096/0.9/l1"]
    assert eq[e2e.run_key(b_lin)]["sweep"]["mismatches"] == []
    rows = e2e_report.output_rows(a + b)
    assert sorted((r["model"], r["equal"], r["compared"]) for r in rows if r["config"] == "tutti-linker") == [
        ("llama3-70b/12/auto", 2, 2), ("qwen3-30b-a3b/12/auto", 1, 2)]
    text = e2e_report.report_markdown(a + b, bpt)
    assert "| model | medium | config | phase |" in text


def test_a_partial_hit_is_marked_in_the_sweep_tables():
    """A sweep request for which SGLang reported fewer cached tokens than the prefix the store
    holds recomputed part of it: its row carries the hit share and its TTFT cell says so."""
    runs, bpt, cached = _runs()
    lin = next(r for r in runs if r["config"] == "tutti-linker")
    full = dict(lin, phases={"sweep": [dict(x, cached_tokens=x["cached"]) for x in lin["phases"]["sweep"]]})
    part = dict(lin, phases={"sweep": [dict(x, cached_tokens=x["cached"] // 2) for x in lin["phases"]["sweep"]]})
    (row,) = [r for r in e2e_report.sweep_rows([full], bpt) if r["config"] == "tutti-linker"]
    assert row["hit_share"] == 1.0 and "(hit" not in e2e_report.sweep_pivot([row])
    (row,) = [r for r in e2e_report.sweep_rows([part], bpt) if r["config"] == "tutti-linker"]
    assert row["hit_share"] == pytest.approx(0.5)
    assert "(hit 50%)" in e2e_report.sweep_pivot([row])
    assert e2e_report.hit_share({"cached": 100}) is None  # SGLang's count unknown: not flagged


def test_the_floor_plus_sglang_time_is_given_for_io_bound_rows_only():
    """split_rows' floor_ms (I/O floor + before + after) is the bound of a row whose I/O floor is
    at least its twin's compute-only time; a compute-bound row leaves it out."""
    run = {"config": "tutti-linker", "medium": "m", "raw_read_GBps": 10.0, "phases": {"sweep": [
        {"id": "sweep/4096/0.9", "sent_ns": 1_000_000_000, "first_token_ns": 1_300_000_000, "cached": 1000},
        {"id": "sweep/4096/0.9/l1", "ttft_s": 0.05}]},
        "timeline": [{"start_ns": 1_030_000_000, "finish_ns": 1_280_000_000, "reads_ms": 240.0}]}
    (row,) = e2e_report.split_rows([run], 1000)  # floor 0.1 ms < the twin's 50 ms: compute-bound
    assert row["floor_ms"] is None
    (row,) = e2e_report.split_rows([run], 10_000_000)  # floor 1000 ms > 50 ms: I/O-bound
    assert row["floor_ms"] == pytest.approx(1000 + 30 + 20)


def test_restore_rate_counts_only_the_pages_the_ssd_served():
    """restore_summary: the linker's loads' SSD pages (load_ssd_pages) over their time, not the
    DRAM tier's or copied pages; stats from before the counter keep every page of a load."""
    from tutti_hicache.benchmarks.e2e_sglang import restore_summary
    page = 2 << 20
    tiered = {"linker": {"load_pages": 100, "load_ssd_pages": 25, "load_bytes": 100 * page, "load_seconds": 0.01}}
    assert restore_summary([tiered])["restore_GBps"] == pytest.approx(25 * page / 0.01 / 1e9)
    old = {"linker": {"load_pages": 100, "load_bytes": 100 * page, "load_seconds": 0.01}}
    assert restore_summary([old])["restore_GBps"] == pytest.approx(100 * page / 0.01 / 1e9)
    none = {"linker": {"load_pages": 50, "load_ssd_pages": 0, "load_bytes": 50 * page, "load_seconds": 0.01}}
    assert restore_summary([none])["restore_GBps"] == 0
