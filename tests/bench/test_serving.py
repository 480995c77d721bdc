"""bench_serving as the e2e harness's client (tutti_hicache/benchmarks/serving.py and
e2e_sglang.serving_config): its command line, its report turned into the harness's records, the
rate sweep's breaking point, the tokenizer the model directory gets, SGLang's own data set
generator (where its optional imports exist), and the phases a configuration runs, with the
server and the client process faked (the real run needs a GPU: bench/gpu.sh e2e ...)."""

import json
import math
import os
import re

import pytest

from tutti_hicache.benchmarks import configs, e2e, e2e_report, e2e_sglang, serving


SHAPE = serving.Shape(groups=3, per_group=1, system=1000, question=50, output=8, seed=1)


def test_shape_checks_and_counts():
    assert SHAPE.requests == 3 and SHAPE.with_(per_group=4).requests == 12
    for bad in (dict(groups=0), dict(question=0), dict(zipf=-1.0), dict(zipf=math.nan)):
        with pytest.raises(ValueError):
            SHAPE.with_(**bad)


def test_argv_is_bench_serving_with_the_shape_and_no_warmup():
    cmd = serving.argv(SHAPE.with_(per_group=4, zipf=0.8), "http://127.0.0.1:30005", "/m", "/o.jsonl",
                       rate=2.0, concurrency=8, flush=True, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.benchmark.serving"]
    opts = dict(zip(cmd[3::1], cmd[4::1]))
    assert opts["--host"] == "127.0.0.1" and opts["--port"] == "30005"
    assert opts["--dataset-name"] == "generated-shared-prefix" and opts["--tokenizer"] == "/m"
    assert opts["--gsp-num-groups"] == "3" and opts["--gsp-prompts-per-group"] == "4"
    assert opts["--gsp-system-prompt-len"] == "1000" and opts["--gsp-question-len"] == "50"
    assert opts["--num-prompts"] == "12" and opts["--request-rate"] == "2"
    assert opts["--max-concurrency"] == "8" and opts["--warmup-requests"] == "0"
    assert opts["--gsp-group-distribution"] == "zipf" and opts["--gsp-zipf-alpha"] == "0.8"
    for flag in ("--tokenize-prompt", "--gsp-ordered", "--cache-report", "--output-details", "--flush-cache"):
        assert flag in cmd
    plain = serving.argv(SHAPE, "http://h:1", "/m", "/o")
    assert "--flush-cache" not in plain and "--gsp-group-distribution" not in plain
    assert plain[plain.index("--request-rate") + 1] == "inf"


def _result(n, ttft=0.2, errors=None, lens=None):
    """A JSON line as bench_serving writes it with --output-details --cache-report."""
    return {"completed": n - len([e for e in (errors or []) if e]), "mean_ttft_ms": ttft * 1e3,
            "median_ttft_ms": ttft * 1e3, "p99_ttft_ms": ttft * 1e3, "mean_itl_ms": 9.0,
            "request_throughput": 1.5, "duration": 4.0, "input_lens": lens or [1050] * n,
            "ttfts": [ttft if not (errors and errors[i]) else 0.0 for i in range(n)],
            "itls": [[0.01] * 7] * n, "errors": errors or [""] * n, "cached_tokens": [1024] * n,
            "cached_tokens_details": [{"device": 0, "host": 0, "storage": 1024}] * n,
            "cache_report": {"cache_hit_rate_pct": 97.5}}


def test_records_follow_the_report_in_sending_order():
    prompts = [[1] * 1050] * 3
    recs = serving.records(_result(3, errors=["", "boom", ""]), prompts, ["a", "b", "c"], [1024] * 3)
    assert [r["id"] for r in recs] == ["a", "b", "c"]
    assert recs[0]["ttft_s"] == 0.2 and recs[0]["itl_s"] == [0.01] * 7
    assert recs[0]["details"]["storage"] == 1024 and recs[0]["cached"] == 1024
    assert recs[1]["ttft_s"] is None and recs[1]["error"] == "boom"
    s = e2e.summarize(recs, 4.0)
    assert s["requests"] == 3 and s["failed"] == 1 and s["ttft_mean_ms"] == pytest.approx(200)
    with pytest.raises(ValueError, match="reported 3 requests"):
        serving.records(_result(3), prompts[:2], ["a", "b"], [0, 0])
    with pytest.raises(ValueError, match="other prompts"):
        serving.records(_result(3, lens=[1050, 1049, 1050]), prompts, ["a", "b", "c"], [0] * 3)
    summ = serving.summary(_result(3))
    assert summ["mean_ttft_ms"] == 200 and summ["cache_report"]["cache_hit_rate_pct"] == 97.5
    assert "ttfts" not in summ


def test_highest_rate_is_the_last_point_before_the_sweep_breaks():
    assert serving.highest_rate({0.5: 0.3, 1: 0.6, 2: 1.4}) == 1
    assert serving.highest_rate({2: 1.4, 0.5: 0.3}) == 0.5
    assert serving.highest_rate({0.5: 1.2}) is None
    assert serving.highest_rate({0.5: 0.3, 1: None, 2: 0.5}) == 0.5  # a failed point breaks it
    assert serving.highest_rate({1: 0.99}, slo_s=1.0) == 1 and serving.highest_rate({1: 1.0}) is None


def test_ids_and_the_check_requests():
    assert serving.gsp_ids("warm", SHAPE) == ["warm/1000/0", "warm/1000/1", "warm/1000/2"]
    assert serving.gsp_ids("r", SHAPE.with_(per_group=2))[:3] == ["r/1000/0", "r/1000/0.1", "r/1000/1"]
    assert serving.gsp_ids("cap", SHAPE.with_(zipf=1.0)) == ["cap/1000/0", "cap/1000/1", "cap/1000/2"]
    reqs = serving.check_requests(SHAPE, [[7] * 1050, [8] * 1050, [9] * 1050])
    assert [r.id for r in reqs] == ["gsp/1000/0", "gsp/1000/1", "gsp/1000/2"]
    assert all(r.cached == 1024 and r.cached % e2e.PAGE == 0 for r in reqs)
    assert serving.check_requests(SHAPE, [[7] * 1024])[0].cached == 960  # the last token is computed


def test_the_model_directory_gets_a_tokenizer_the_server_and_client_load(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    serving.write_tokenizer(str(tmp_path), 1000)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert sorted(tok.get_vocab().values()) == list(range(1000))
    assert tok.decode([5, 6, 999]).split() == ["t5", "t6", "t999"]


def test_write_model_writes_the_tokenizer_and_the_server_streams_text(tmp_path):
    pytest.importorskip("tokenizers")
    configs.write_model(str(tmp_path), 2)
    assert os.path.exists(tmp_path / "tokenizer.json")
    args = type("A", (), dict(model=str(tmp_path), max_total_tokens=1000))()
    assert "--skip-tokenizer-init" not in configs.server_cmd(args, "recompute", 30000)[0]
    args.model = str(tmp_path / "none")  # a model directory without one: ids only, as before
    assert "--skip-tokenizer-init" in configs.server_cmd(args, "recompute", 30000)[0]


def test_sglangs_generator_shares_documents_across_shapes(tmp_path, monkeypatch):
    """Where bench_serving's optional imports exist (HF datasets and pandas; the GPU machine has
    them): documents depend on (seed, groups, system) only, slot 0 of each document is the same
    question whatever per_group, and a zipf shape draws from the same documents."""
    pytest.importorskip("datasets")
    pytest.importorskip("tokenizers")
    try:
        import sglang.benchmark.datasets.generated_shared_prefix  # noqa: F401
    except ImportError as e:
        pytest.skip(f"SGLang's benchmark data sets do not import here: {e}")
    monkeypatch.setenv("HOME", str(tmp_path))  # SGLang caches the sets under ~/.cache
    serving.write_tokenizer(str(tmp_path / "m"), 5000)
    one = serving.prompts(SHAPE, str(tmp_path / "m"))
    four = serving.prompts(SHAPE.with_(per_group=4), str(tmp_path / "m"))
    assert len(one) == 3 and len(four) == 12 and all(len(p) == 1050 for p in one + four)
    docs = [p[:1000] for p in one]
    assert len({tuple(d) for d in docs}) == 3
    assert [p[:1000] for p in four[::4]] == docs and four[0] == one[0]
    assert four[1][1000:] != four[0][1000:]
    zipf = serving.prompts(SHAPE.with_(per_group=4, zipf=1.0), str(tmp_path / "m"))
    assert all(p[:1000] in docs for p in zipf)
    assert serving.prompts(SHAPE, str(tmp_path / "m")) == one  # from SGLang's cache, the same


class FakeServer:
    """Stands for benchmarks.server.Server: records starts and stops."""
    starts = []

    def __init__(self, cmd, env, log, port, top_logprobs=0):
        self.url = f"http://127.0.0.1:{port}"
        self.top_logprobs = top_logprobs
        FakeServer.starts.append(cmd)

    def wait_ready(self, timeout):
        return 1.0

    def alive(self):
        return True

    def stop(self):
        pass


def _args(tmp_path, **kw):
    base = dict(model=str(tmp_path / "m"), docs=2, contexts="4096", question_tokens=64, max_new=4,
                serving_seed=0, rates=[0.5, 1.0, 2.0, 4.0], rate_requests=4, rate_concurrency=8, slo_s=1.0,
                rates_through=0.0,
                capacity_context=2048, capacity_requests=6, capacity_concurrency=2, zipf_alpha=0.8,
                start_timeout=10, top_logprobs=0, out_dir=str(tmp_path), tutti_dirs=str(tmp_path / "t"),
                one_dir=str(tmp_path / "o"), nixl_dirs="", capacity_gb=1.0, medium="m", bpt=1024,
                one_dir_note="", cuda_graph_max_bs=0, prefill_graphs=False, weights="dummy",
                dram_gb=1, host_gb=1, capacity_configs="tutti-linker", max_total_tokens=10000,
                client="bench-serving", fractions=[0.9], layers=2,
                phases="warm,reuse,check,again,rates,capacity", no_restart=False,
                model_shape="llama3-8b", kv_cache_dtype="auto", attention_backend="triton", page_size=64)
    base.update(kw)
    return type("Args", (), base)()


@pytest.fixture
def faked(monkeypatch):
    calls = []
    ttft_by_rate = {0.5: 0.3, 1.0: 0.7, 2.0: 1.6, 4.0: 0.2}

    def fake_prompts(shape, tokenizer_dir, tokenizer=None):
        return [[g] * shape.system + [100 + k] * shape.question
                for k, g in enumerate(i % shape.groups for i in range(shape.requests))]

    def fake_run(srv, shape, tokenizer_dir, out_file, rate=math.inf, concurrency=1, flush=False,
                 timeout_s=900.0, log_path=None, client=None):
        calls.append((os.path.basename(out_file), rate, concurrency, flush, shape))
        n = shape.requests
        return _result(n, ttft=ttft_by_rate.get(rate, 0.25), lens=[shape.system + shape.question] * n)

    monkeypatch.setattr(serving, "prompts", fake_prompts)
    monkeypatch.setattr(serving, "run", fake_run)
    monkeypatch.setattr(e2e_sglang, "Server", FakeServer)
    monkeypatch.setattr(e2e_sglang, "settle", lambda *a, **k: 0.0)
    monkeypatch.setattr(e2e_sglang, "drop_caches", lambda: "dropped")
    monkeypatch.setattr(e2e_sglang, "scrape_metrics", lambda url: [])
    monkeypatch.setattr(e2e_sglang, "run_sequential",
                        lambda srv, reqs, max_new, flush=False: [
                            {"id": r.id, "ttft_s": 0.1, "cached_tokens": r.cached, "flushed": flush} for r in reqs])
    monkeypatch.setattr(e2e_sglang, "warm_batch_kernels",
                        lambda srv, page_size: calls.append(("kernel-warmup", page_size)) or {"ok": True})
    FakeServer.starts = []
    return calls


def test_a_storage_configuration_warms_restarts_reuses_checks_and_sweeps_rates(tmp_path, faked):
    args = _args(tmp_path)
    run = e2e_sglang.run_config(args, "tutti-linker", e2e.Workload([4096], 2), {"raw_read_GBps": 1.0},
                                float("inf"))
    assert "error" not in run, run.get("error")
    assert list(run["phases"]) == ["warm", "reuse", "check", "again", "rate0.5", "rate1", "rate2", "capwarm",
                                   "capacity"]
    assert len(FakeServer.starts) == 2  # the restart between warm and reuse
    names = [c[0] for c in faked]
    assert names[:3] == ["bs-tutti-linker-warm.jsonl", "bs-tutti-linker-reuse.jsonl", "bs-tutti-linker-again.jsonl"]
    # once, before the first concurrent phase: multi-sequence kernels compile outside any measurement
    assert names.count("kernel-warmup") == 1 and names[3] == "kernel-warmup" and run["kernel_warmup"]["ok"]
    assert faked[2][3]  # again: the device cache flushed first
    rate_calls = [c for c in faked if c[0].startswith("bs-tutti-linker-rate")]
    assert [c[1] for c in rate_calls] == [0.5, 1.0, 2.0]  # stops at the first rate over the SLO
    assert all(c[3] and c[2] == 8 and c[4].requests == 4 for c in rate_calls)  # flushed, paced
    assert run["rate_sweep"]["highest_rate_under_slo"] == 1.0
    assert run["rate_sweep"]["mean_ttft_s"] == {"0.5": 0.3, "1": 0.7, "2": 1.6}
    cap = [c for c in faked if c[0].endswith("-capacity.jsonl")][0]
    assert cap[4].zipf == 0.8 and cap[2] == 2 and cap[4].requests >= args.capacity_requests
    capwarm = [c for c in faked if c[0].endswith("-capwarm.jsonl")][0][4]
    assert capwarm.groups == cap[4].groups and capwarm.seed != faked[0][4].seed  # other documents
    assert all(r["flushed"] for r in run["phases"]["check"])
    assert [r["id"] for r in run["phases"]["check"]] == ["gsp/4096/0", "gsp/4096/1"]
    assert run["serving"]["reuse"]["mean_ttft_ms"] == 250 and run["serving"]["rate1"]["rate"] == 1.0
    reuse = run["phases"]["reuse"]
    assert [r["cached"] for r in reuse] == [(4096 + 64 - 1) // e2e.PAGE * e2e.PAGE] * 2
    row = e2e_report.serving_rows([run])[0]
    assert row["warm_first_ms"] == 250 and row["reuse_first_ms"] == 250 and row["highest_rate"] == 1.0
    assert row["whole_hits"] == 0  # the fake report cached 1024 of 4160 tokens: not whole
    md = e2e_report.report_markdown([run], 1024)
    assert "### bench_serving phases" in md and "| m | tutti-linker | 250 | 250 | 250 |" in md


def test_rates_through_goes_past_the_slo_to_a_comparison_rate(tmp_path, faked):
    """--rates-through 4: the sweep goes on past its breaking point (2 req/s) up to 4 req/s, so the
    paper's comparison rate has a point; the highest rate under the SLO is still the breaking
    point's, not 4 (whose fake TTFT is under the SLO again)."""
    run = e2e_sglang.run_config(_args(tmp_path, rates_through=4.0, phases="warm,rates"), "tutti-linker",
                                e2e.Workload([4096], 2), {}, float("inf"))
    assert [c[1] for c in faked if "-rate" in c[0]] == [0.5, 1.0, 2.0, 4.0]
    assert run["rate_sweep"]["mean_ttft_s"]["4"] == 0.2
    assert run["rate_sweep"]["highest_rate_under_slo"] == 1.0


def test_kernel_warmup_sends_a_batch_then_the_batch_extending_its_prefixes(generate_stub):
    """What warm_batch_kernels sends a real server: one /generate holding two new prompts, then one
    holding the same prompts a page longer (a two-sequence extend over cached prefixes)."""
    from tutti_hicache.benchmarks import server as srv_mod
    with generate_stub(answer=b"[]") as (fake, bodies):
        out = srv_mod.warm_batch_kernels(fake, 64)
    assert out["ok"] and len(bodies) == 2
    first, second = (b["input_ids"] for b in bodies)
    assert len(first) == len(second) == 2 and first[0] != first[1]
    assert all(b[:len(a)] == a and len(b) == len(a) + 64 for a, b in zip(first, second))
    assert all(b["sampling_params"]["max_new_tokens"] == 4 for b in bodies)


def test_identity_restart_reads_the_store_under_other_settings_last(tmp_path, faked, monkeypatch):
    """--identity-restart: after every other phase, the server restarts on its store with the KV
    dtype changed and the reuse requests go again; the run says what the restarted server still
    found cached, and the report calls any of it a read across identities."""
    real_run = serving.run

    def run_identity_misses(srv, shape, tokenizer_dir, out_file, **kw):
        res = real_run(srv, shape, tokenizer_dir, out_file, **kw)  # the fixture's fake
        if out_file.endswith("-identity.jsonl"):  # the store misses: nothing cached
            res.update(cached_tokens=[0] * len(res["ttfts"]),
                       cached_tokens_details=[{"device": 0, "host": 0, "storage": 0}] * len(res["ttfts"]))
        return res
    monkeypatch.setattr(serving, "run", run_identity_misses)
    args = _args(tmp_path, rates=[], identity_restart="kv-cache-dtype=fp8_e4m3,page-size=32",
                 phases="warm,reuse,capacity")
    run = e2e_sglang.run_config(args, "tutti-linker", e2e.Workload([4096], 2), {}, float("inf"))
    assert "error" not in run, run.get("error")
    assert list(run["phases"])[-1] == "identity" and len(FakeServer.starts) == 3
    first, last = FakeServer.starts[0], FakeServer.starts[-1]
    assert last[last.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert last[last.index("--page-size") + 1] == "32" and first[first.index("--page-size") + 1] == "64"
    ident = run["identity"]
    assert ident["requests"] == 2 and ident["cached_tokens"] == 0 and ident["cached_by_tier"]["storage"] == 0
    md = e2e_report.report_markdown([run], 1024)
    assert "### Identity" in md and "kv-cache-dtype auto, page-size 64" in md and "all misses" in md
    run["identity"]["cached_tokens"] = 5  # a store read across identities is called that
    assert "**read across identities**" in e2e_report.report_markdown([run], 1024)
    # non-storage configurations have no store to read: no identity phase
    FakeServer.starts = []
    dram = e2e_sglang.run_config(args, "dram", e2e.Workload([4096], 2), {}, float("inf"))
    assert "identity" not in dram["phases"] and len(FakeServer.starts) == 1


def test_identity_changes_name_what_is_wrong():
    assert configs.identity_changes("kv-cache-dtype=fp8_e5m2") == {"--kv-cache-dtype": "fp8_e5m2"}
    assert configs.identity_changes("--page-size=16, kv-cache-dtype=auto") == {"--page-size": "16",
                                                                              "--kv-cache-dtype": "auto"}
    for bad, msg in (("model=x", "FLAG=VALUE with FLAG one of"), ("kv-cache-dtype=fp4", "must be one of"),
                     ("page-size=0", "positive integer"), ("page-size", "FLAG=VALUE"), (" , ", "no FLAG")):
        with pytest.raises(ValueError, match=msg):
            configs.identity_changes(bad)
    cmd = ["x", "--page-size", "64"]
    assert configs.with_flags(cmd, {"--page-size": "32", "--kv-cache-dtype": "fp8_e4m3"}) == \
        ["x", "--page-size", "32", "--kv-cache-dtype", "fp8_e4m3"]
    assert cmd == ["x", "--page-size", "64"]  # a copy


def test_dram_and_recompute_never_restart_and_dram_never_flushes(tmp_path, faked):
    args = _args(tmp_path, rates=[1.0])
    for config in ("dram", "recompute"):
        FakeServer.starts = []
        run = e2e_sglang.run_config(args, config, e2e.Workload([4096], 2), {}, float("inf"))
        assert "error" not in run and len(FakeServer.starts) == 1
        assert list(run["phases"])[:4] == ["warm", "reuse", "check", "again"]
        if config == "dram":  # a flush would empty its host tier
            assert not any(r["flushed"] for r in run["phases"]["check"])
    assert not [c for c in faked if "rate" in c[0] and c[3]]  # neither flushes before a rate phase


def test_a_misplace_variant_swaps_between_warm_and_restart(tmp_path, faked, monkeypatch):
    seen = {}

    def fake_misplace(docs, page, dirs, cap, requests, keys=None, page_size=64):
        seen.update(docs=docs, page=page, ids=[r.id for r in requests], page_size=page_size)
        return {"swapped": 1, "affected": [r.id for r in requests]}
    monkeypatch.setattr(e2e_sglang.misplace, "misplace_docs", fake_misplace)
    run = e2e_sglang.run_config(_args(tmp_path, rates=[]), "tutti-linker+misplace",
                                e2e.Workload([4096], 2), {}, float("inf"))
    assert run["misplaced"]["swapped"] == 1 and run["misplaced"]["context"] == 4096
    assert seen["page"] == 4096 // e2e.PAGE // 2 and seen["ids"] == ["gsp/4096/0", "gsp/4096/1"]
    assert seen["docs"][0][:4096] != seen["docs"][1][:4096]


def test_the_readme_host_command_is_the_harness_configuration():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        readme = f.read()
    block = re.search(r"sglang serve --model-path M.*?extra-config", readme, re.S).group(0)
    flags = block.replace("\\", " ").split()
    want = configs.README_HOST_FLAGS
    pairs = {(a, b) for a, b in zip(flags, flags[1:])}
    for i in range(0, len(want)):
        if want[i].startswith("--") and i + 1 < len(want) and not want[i + 1].startswith("--"):
            assert (want[i], want[i + 1]) in pairs, want[i]
        else:
            assert want[i] in flags


def test_no_restart_keeps_the_server_for_the_hot_set(tmp_path, faked):
    run = e2e_sglang.run_config(_args(tmp_path, rates=[], no_restart=True), "tutti-tiered",
                                e2e.Workload([4096], 2), {}, float("inf"))
    assert "error" not in run and len(FakeServer.starts) == 1
    assert list(run["phases"])[:4] == ["warm", "reuse", "check", "again"]


# ------------------------------------------------------------------ one bench_serving process
FAKE_WORKER = '''
import json, os, sys, time
fd = int(sys.argv[1])
os.write(fd, b"ready\\n")
for line in sys.stdin:
    if not line.strip():
        break
    args = json.loads(line)
    out = args[args.index("--output-file") + 1]
    if "--seed" in args and args[args.index("--seed") + 1] == "99":
        time.sleep(30)  # a phase that hangs
    n = int(args[args.index("--num-prompts") + 1])
    with open(out, "a") as f:
        f.write(json.dumps({"completed": n, "ttfts": [0.1] * n, "pid": os.getpid()}) + "\\n")
    os.write(fd, b"0\\n")
'''


class _Srv:
    url = "http://127.0.0.1:1"

    def __init__(self):
        self.up = True

    def alive(self):
        return self.up


@pytest.mark.slow
def test_one_client_process_serves_every_phase_and_dies_with_the_server(tmp_path):
    (tmp_path / "fakeworker.py").write_text(FAKE_WORKER)
    client = serving.Client(str(tmp_path / "bs.log"), cwd=str(tmp_path), module="fakeworker")
    client.start()
    srv = _Srv()
    a = serving.run(srv, SHAPE, "/m", str(tmp_path / "a.jsonl"), client=client)
    b = serving.run(srv, SHAPE.with_(per_group=2), "/m", str(tmp_path / "b.jsonl"), client=client)
    assert a["completed"] == 3 and b["completed"] == 6 and a["pid"] == b["pid"]  # one process
    with pytest.raises(RuntimeError, match="out of time"):  # a phase past its limit: killed
        serving.run(srv, SHAPE.with_(seed=99), "/m", str(tmp_path / "c.jsonl"), client=client,
                    timeout_s=1.0)
    assert client.proc is None
    c = serving.run(srv, SHAPE, "/m", str(tmp_path / "d.jsonl"), client=client)  # a new process
    assert c["pid"] != a["pid"]
    srv.up = False
    with pytest.raises(RuntimeError, match="server process died"):
        serving.run(srv, SHAPE.with_(seed=99), "/m", str(tmp_path / "e.jsonl"), client=client)
    client.close()


def test_the_worker_runs_bench_serving_once_per_line(monkeypatch, tmp_path):
    """serving_worker.main: SGLang's cli_main per line on its own argv, the tokenizer loaded once
    per path, an exit code per run (a failed run does not end the worker)."""
    import io
    import os
    import sys
    import types

    from tutti_hicache.benchmarks import serving_worker
    seen, loads = [], []
    fake = types.ModuleType("sglang.benchmark.serving")

    def get_tokenizer(path):
        loads.append(path)
        return object()

    def cli_main():
        fake.get_tokenizer("/m")
        seen.append(list(sys.argv[1:]))
        if "--boom" in sys.argv:
            raise SystemExit(2)
    fake.get_tokenizer, fake.cli_main = get_tokenizer, cli_main
    monkeypatch.setitem(sys.modules, "sglang.benchmark.serving", fake)
    monkeypatch.setattr(sys, "stdin", io.StringIO('["--a", "1"]\n["--boom"]\n["--b"]\n\n'))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    r, w = os.pipe()
    assert serving_worker.main([str(w)]) == 0
    os.close(w)
    assert os.read(r, 100).decode().split() == ["ready", "0", "2", "0"]
    assert seen == [["--a", "1"], ["--boom"], ["--b"]] and loads == ["/m"]


def test_a_page_size_reaches_the_servers_and_the_cached_prefixes(tmp_path, faked):
    """--page-size 32: every server runs with it, and a prompt's cached share is counted in its
    pages (the whole prompt short of its last token, cut to 32-token pages)."""
    args = _args(tmp_path, rates=[], page_size=32, question_tokens=80)
    run = e2e_sglang.run_config(args, "tutti-linker", e2e.Workload([4096], 2), {}, float("inf"))
    assert "error" not in run and run["page_size"] == 32
    assert all(cmd[cmd.index("--page-size") + 1] == "32" for cmd in FakeServer.starts)
    assert [r["cached"] for r in run["phases"]["reuse"]] == [(4096 + 80 - 1) // 32 * 32] * 2 == [4160] * 2
    assert [r.cached for r in serving.check_requests(SHAPE, [[1] * 1070], 32)] == [1056]
    assert [r.cached for r in serving.check_requests(SHAPE, [[1] * 1070])] == [1024]  # 64-token pages


def test_baseline_rows_compare_tutti_at_the_reference_rate_and_by_slo_rate():
    """The paper's comparison (issue 34): at the rate where lmcache-dram last met the SLO, each
    LMCache run's mean TTFT over that of tutti's best configuration there; and tutti's best
    highest-rate-under-the-SLO over the baseline's. A baseline that never met the SLO has no
    rate ratio; another medium is its own group."""
    def run(config, points, medium="array-8"):
        return {"config": config, "medium": medium, "rate_sweep": {
            "slo_s": 1.0, "mean_ttft_s": {f"{r:g}": t for r, t in points.items()},
            "highest_rate_under_slo": serving.highest_rate(points, 1.0)}}
    runs = [run("lmcache-dram", {0.5: 0.6, 1: 0.9, 1.5: 2.8}),
            run("lmcache-ssd", {0.5: 3.0}),
            run("lmcache-gds", {0.5: 0.8, 1: 1.4}),
            run("tutti-linker", {0.5: 0.3, 1: 0.45, 1.5: 0.6, 2: 1.2}),
            run("tutti-tiered", {0.5: 0.2, 1: 0.3, 1.5: 0.5, 2: 0.8, 4: 1.5}),
            run("dram", {1: 0.1}),  # not a baseline here, not tutti
            run("lmcache-dram", {0.5: 0.5}, medium="disk")]
    rows = {(r["medium"], r["baseline"]): r for r in e2e_report.baseline_rows(runs)}
    dram = rows[("array-8", "lmcache-dram")]
    assert dram["at_rate"] == 1 and dram["tutti"] == "tutti-tiered" and dram["tutti_ttft_s"] == 0.3
    assert dram["ttft_ratio"] == pytest.approx(3.0) and dram["rate_ratio"] == pytest.approx(2.0)
    ssd = rows[("array-8", "lmcache-ssd")]
    # over the SLO at its only rate (0.5): compared there, and its SLO rate is below 0.5
    assert ssd["at_rate"] == 0.5 and ssd["baseline_ttft_s"] == 3.0 and ssd["tutti_ttft_s"] == 0.2
    assert ssd["ttft_ratio"] == pytest.approx(15.0)
    assert ssd["baseline_slo_rate"] is None and ssd["baseline_below_rate"] == 0.5
    assert ssd["rate_ratio"] == pytest.approx(4.0)
    assert rows[("array-8", "lmcache-gds")]["rate_ratio"] == pytest.approx(4.0)
    disk = rows[("disk", "lmcache-dram")]  # no tutti run on that medium
    assert disk["tutti"] is None and disk["ttft_ratio"] is None and disk["rate_ratio"] is None
    md = e2e_report.report_markdown(runs, 1024)
    assert "| array-8 | lmcache-dram | 1 | 0.90 | tutti-tiered | 0.30 | 3.00 | 1 / 2 | 2.00 |" in md
    assert "| array-8 | lmcache-ssd | 0.5 | 3.00 | tutti-tiered | 0.20 | 15.00 | <0.5 / 2 | >4.00 |" in md
    # a tutti sweep cut short (out of time at 0.5 req/s, under the SLO): its rate is a lower bound
    short = [runs[0], run("tutti-linker", {0.5: 0.19})]
    row = e2e_report.baseline_rows(short)[0]
    assert row["tutti_slo_rate_bound"] and not row["baseline_slo_rate_bound"] and row["tutti_ttft_s"] is None
    assert "| 1 / >=0.5 | >=0.50 |" in e2e_report.report_markdown(short, 1024)
    # two tutti runs at the same highest rate: the one whose sweep never broke decides, a bound
    tied = [run("lmcache-dram", {1.5: 0.25, 4: 0.39, 8: 2.18}),
            run("tutti-linker", {1.5: 0.18, 4: 0.23, 8: 0.76, 16: 1.06}),
            run("tutti-tiered", {1.5: 0.12, 4: 0.12, 8: 0.18})]
    row = e2e_report.baseline_rows(tied)[0]
    assert row["tutti_slo_rate"] == 8 and row["tutti_slo_rate_bound"] and row["tutti"] == "tutti-tiered"
    assert "| 4 / >=8 | >=2.00 |" in e2e_report.report_markdown(tied, 1024)


def test_a_rate_sweep_split_over_two_calls_is_merged_when_its_shape_is_the_same():
    """merge_runs (plot_e2e's several files): the later call's run, plus the earlier call's rate
    points it lacks where the model, settings and rate-phase shape are the same; the highest rate
    under the SLO over the merged points. Another shape or another setting: the later run alone."""
    def run(points, docs=4, pool=30, config="lmcache-dram"):
        shape = {"groups": docs, "per_group": 3, "system": 32768}
        return {"config": config, "medium": "array-8", "model_shape": "llama3-8b", "layers": 32,
                "host_pool_gb": pool,
                "phases": {f"rate{r:g}": [{"id": f"rate{r:g}/0", "ttft_s": t}] for r, t in points.items()},
                "summaries": {f"rate{r:g}": {"ttft_mean_ms": t * 1e3} for r, t in points.items()},
                "serving": {f"rate{r:g}": {"rate": r, "shape": shape} for r in points},
                "rate_sweep": {"slo_s": 1.0, "mean_ttft_s": {f"{r:g}": t for r, t in points.items()},
                               "highest_rate_under_slo": serving.highest_rate(points, 1.0)}}
    first, second = run({0.5: 0.23, 4: 0.39}), run({8: 2.18})
    assert second["rate_sweep"]["highest_rate_under_slo"] is None  # alone: broke at its only rate
    (merged,) = e2e_report.merge_runs([first, second])
    assert merged["rate_sweep"]["mean_ttft_s"] == {"8": 2.18, "0.5": 0.23, "4": 0.39}
    assert merged["rate_sweep"]["highest_rate_under_slo"] == 4
    assert set(merged["phases"]) == set(merged["summaries"]) == {"rate0.5", "rate4", "rate8"}
    assert merged["merged_rates_from_earlier_call"] == ["0.5", "4"]
    assert "rate0.5" not in second["phases"]  # the inputs are left as they were
    for other in (run({8: 2.18}, docs=2), run({8: 2.18}, pool=10)):
        (alone,) = e2e_report.merge_runs([first, other])
        assert alone is other and alone["rate_sweep"]["highest_rate_under_slo"] is None
    both = e2e_report.merge_runs([first, run({1: 0.2}, config="tutti-linker"), second])
    assert sorted(r["config"] for r in both) == ["lmcache-dram", "tutti-linker"]
    # a later call where the configuration did not start (an error, no phase) leaves the earlier run
    failed = {**{k: first[k] for k in ("config", "medium", "model_shape", "layers")}, "phases": {},
              "error": "daemon exited"}  # the harness records the model from the start
    (kept,) = e2e_report.merge_runs([first, failed])
    assert kept is first
    (only,) = e2e_report.merge_runs([failed])
    assert only is failed


def test_the_own_client_sweeps_at_a_page_size_of_16(tmp_path, faked, monkeypatch):
    """--client own --page-size 16 (the issue's page sizes, with the compute-only twin): the
    servers run page 16, the sweep's points and twins keep 16-token-aligned prefixes, and the
    warm-up extends behind a head of two 16-token pages."""
    heads = []
    monkeypatch.setattr(e2e_sglang, "warm_extend_sizes",
                        lambda srv, sizes, page_size, seed=11: heads.append(page_size) or {"ok": True})
    args = _args(tmp_path, client="own", page_size=16, rates=[], fractions=[0.9, 0.99], capacity_configs="")
    wl = e2e.Workload([4096], 2, page=16)
    run = e2e_sglang.run_config(args, "tutti-linker", wl, {}, float("inf"))
    assert "error" not in run and run["page_size"] == 16 and heads == [16]
    assert all(cmd[cmd.index("--page-size") + 1] == "16" for cmd in FakeServer.starts)
    cached = {r["id"]: r["cached_tokens"] for r in run["phases"]["sweep"]}
    assert cached == {"sweep/4096/0.9": 3680, "sweep/4096/0.9/l1": 3680,
                      "sweep/4096/0.99": 4048, "sweep/4096/0.99/l1": 4048}  # 64-token pages: 3648, 4032
