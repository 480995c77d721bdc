"""The end-to-end run behind bench/e2e_sglang.py (whose docstring, its --help, says what it
measures and how): per configuration a real SGLang server started, the workload's phases sent
(tutti_hicache/benchmarks/e2e.py), the storage tier settled and cleared, and the JSON written after
every phase.

At a glance:
    main(description)           the command: its arguments, the configurations in order, the JSON
    run_config(args, config, wl, raw, deadline, store_from="") -> run    one configuration: its
        Session (the server across restarts) runs own_phases (the harness's client) or, with
        --client bench-serving, serving_phases (SGLang's bench_serving; serving.py)
    run_cluster(args, config, wl, raw) -> run                            tutti-mooncake's two servers
    misplace_control(args, wl) -> dict  a +misplace variant's swapped page, before its restart
    record_phase(run, name, records)    a phase's records and summary into the run and the JSON

Needs a GPU and SGLang 0.5.17 to 0.5.23; main's bookkeeping is tested on CPU with run_config faked.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import time
from typing import Optional

from tutti_hicache.benchmarks import configs, e2e, e2e_report, lmcache_daemon, misplace, serving, timeline
from tutti_hicache.benchmarks.hostmem import GUARD
from tutti_hicache.benchmarks.rawio import raw_read_dirs
from tutti_hicache.benchmarks.server import (Server, config_files, drop_caches, one_request, run_rate,
                                             run_sequential, tutti_stats, warm_batch_kernels,
                                             warm_extend_sizes)

# ------------------------------------------------------------------ storage bookkeeping
def written_bytes(args, config: str) -> int:
    if config.startswith("tutti"):
        return sum(s.get("write_bytes", 0) for s in tutti_stats(args.out_dir, config))
    total = 0
    roots = [os.path.join(d, config) for d in [args.one_dir] + [x for x in args.nixl_dirs.split(",") if x]]
    lmc = lmcache_daemon.data_dir(configs.split_config(config)[0], args.one_dir)
    roots += [lmc] if lmc else []
    for root, _, files in (w for r in roots for w in os.walk(r)):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def settle(args, config: str, quiet_s: float = 3.0, limit_s: float = 120.0) -> float:
    """Wait until the storage tier stops growing (SGLang writes back asynchronously)."""
    t0 = last_change = time.time()
    last = written_bytes(args, config)
    while time.time() - last_change < quiet_s and time.time() - t0 < limit_s:
        time.sleep(0.5)
        now = written_bytes(args, config)
        if now != last:
            last, last_change = now, time.time()
    return time.time() - t0


def clear_storage(args, config: str, keep_tutti: bool = False, tutti_names=("tutti",)) -> None:
    """Empty the configuration's storage and its stats/timeline files; tutti_names: the tutti
    directory in each of args.tutti_dirs (tutti-mooncake: one per server)."""
    for d in args.tutti_dirs.split(",") if not keep_tutti else ():
        for name in tutti_names:
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
    for d in [args.one_dir] + [x for x in args.nixl_dirs.split(",") if x]:
        for name in ("file", "nixl", *lmcache_daemon.DIRS.values()):
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
    for d in args.tutti_dirs.split(","):
        for name in tutti_names:
            os.makedirs(os.path.join(d, name), exist_ok=True)
    base = configs.split_config(config)[0]
    os.makedirs(os.path.join(args.one_dir, base if base in ("file", "nixl") else "."), exist_ok=True)
    for kind in ("stats", "timeline"):
        for path in config_files(args.out_dir, kind, config):
            os.unlink(path)


# ------------------------------------------------------------------ one configuration
PARTIAL: dict = {"json": None, "done": []}  # main's output and its finished runs


def save_partial(run: dict) -> None:
    """The JSON so far, with this unfinished run in it (marked "partial"), so a run cut off by a
    time limit keeps every phase it finished; the finished run replaces it in main."""
    if PARTIAL["json"]:
        with open(PARTIAL["json"], "w") as f:
            json.dump(PARTIAL["done"] + [{**run, "partial": True}], f, default=str)


def record_phase(run: dict, name: str, records: list, seconds=None) -> None:
    """A phase's records and summary into the run (and the JSON so far), the summary on stdout."""
    run["phases"][name] = records
    run["summaries"][name] = e2e.summarize(records, seconds)
    run.setdefault("host_available_low_gb", {})[name] = GUARD.take_low()  # hostmem.py
    print(f"  {run['config']:22s} {name:10s} " + json.dumps(
        {k: v for k, v in run["summaries"][name].items() if k != "cached_by_tier_mean"}), flush=True)
    save_partial(run)


def run_config(args, config: str, wl: e2e.Workload, raw: dict, deadline: float,
               store_from: str = "") -> dict:
    """One configuration's phases. store_from: a linker configuration that wrote the store this
    one starts on (--share-linker-store): no warm phase and no first server, and the workload
    salted so nothing past the documents is already stored."""
    base = configs.split_config(config)[0]  # a variant (+tutti_KEY=VALUE) runs as its base
    port = 30000 + configs.CONFIGS.index(base)
    clear_storage(args, config, keep_tutti=bool(store_from))
    GUARD.reset()
    run = {"config": config, "medium": args.medium, **raw, "layers": args.layers,
           "page_size": args.page_size, "page_bytes": args.bpt * args.page_size,
           "model_shape": args.model_shape, "kv_cache_dtype": args.kv_cache_dtype,
           "attention_backend": args.attention_backend,
           "one_dir": args.one_dir_note, "cuda_graph_max_bs": args.cuda_graph_max_bs,
           "prefill_graphs": args.prefill_graphs, "weights": args.weights, "top_logprobs": args.top_logprobs,
           "phases": {}, "summaries": {}, "start_s": [], "store_from": store_from or None, "salt": wl.salt,
           "host_pool_gb": args.dram_gb if base == "dram" else (args.host_gb if base in
                                                                ("file", "nixl", "tutti-host") else 0)}
    if base == "tutti-tiered":  # the linker's DRAM tier (tutti_host_gb)
        run["host_pool_gb"] = args.dram_gb
    if base in ("tutti-host-readme", "tutti-host-defaults"):
        run["host_pool_gb"] = None  # SGLang's --hicache-ratio 2: twice the device pool
    if base in configs.LMCACHE:  # the daemon's L1 (lmcache_daemon.daemon_cmd)
        run["host_pool_gb"] = lmcache_daemon.SSD_L1_GB if base == "lmcache-ssd" else args.dram_gb
    log = os.path.join(args.out_dir, f"server-{config}.log")
    cmd, env = configs.server_cmd(args, config, port)
    capacity = config in args.capacity_configs.split(",")
    cap_docs = max(1, round(3 * args.dram_gb * 1e9 / (args.capacity_context * args.bpt)))
    run["capacity_working_set_gb"] = cap_docs * args.capacity_context * args.bpt / 1e9 if capacity else None

    if store_from:
        run["page_cache"] = drop_caches()
    sess = Session(args, config, run, (cmd, env, log, port))
    if args.client == "bench-serving":
        phases = lambda: sess.run(lambda: serving_phases(args, sess, deadline, store_from, capacity, cap_docs))
    else:
        phases = lambda: sess.run(lambda: own_phases(args, sess, wl, deadline, store_from, capacity, cap_docs))
    if base in configs.LMCACHE:
        return with_lmcache(args, config, run, port, phases)
    why = nixl_unavailable() if base == "nixl" else None
    if why:  # found before a server start, not 60 s into one
        print(f"skipped {config}: {why}", flush=True)
        run["skipped"] = why
        return finish_run(args, config, run)
    return phases()


def nixl_unavailable() -> Optional[str]:
    """None where SGLang's `nixl` backend can import NIXL here, else why not (one line)."""
    try:
        if importlib.util.find_spec("nixl") is None:
            return "NIXL is not installed: SGLang's nixl backend imports it (on the GPU machine carry " \
                   ".nixl/nixl.tar.xz, built by bench/build_nixl_payload.sh .nixl)"
    except Exception as e:  # noqa: BLE001 - a broken install is a reason too
        return f"nixl does not import: {e!r}"
    return None


def with_lmcache(args, config: str, run: dict, port: int, phases) -> dict:
    """An LMCache configuration's phases with its daemon running beside the server (started
    first, outliving the server's restarts, stopped last), or the reason it cannot start here
    in run["skipped"] (not installed) or run["error"] (the daemon exited: its log's last lines).
    Its restore rate comes from its own log (retrieve_summary)."""
    base = configs.split_config(config)[0]
    why = lmcache_daemon.unavailable()
    if why:
        print(f"skipped {config}: {why}", flush=True)
        run["skipped"] = why
        return finish_run(args, config, run)
    d_port = configs.lmcache_port(port)
    data = lmcache_daemon.data_dir(base, args.one_dir)
    if data:
        os.makedirs(data, exist_ok=True)
    working_set_gb = max(args.docs * sum(int(c) for c in args.contexts.split(",")) * args.bpt / 1e9,
                         run.get("capacity_working_set_gb") or 0)
    why = lmcache_daemon.room_error(base, args.one_dir, args.dram_gb, working_set_gb)
    if why:
        print(f"  {config}: {why}", flush=True)
        run["error"] = why
        return finish_run(args, config, run)
    cmd = lmcache_daemon.daemon_cmd(base, d_port, d_port + 1000, args.one_dir, args.dram_gb,
                                    configs.lmcache_transfer_mode(config))
    log = os.path.join(args.out_dir, f"lmcache-{config}.log")
    daemon = lmcache_daemon.Daemon(cmd, log, d_port)
    try:
        run["lmcache_daemon_start_s"] = daemon.wait_ready(args.start_timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"  {config}: {e}", flush=True)
        run["error"] = str(e)
        daemon.stop()
        return finish_run(args, config, run)
    try:
        return phases()
    finally:
        daemon.stop()
        run.update(lmcache_daemon.retrieve_summary(log, args.bpt))  # its restore GB/s, as it logs them


class Session:
    """A configuration's server across its restarts: run(phases) starts it, runs the phases,
    keeps what they measured when one fails, stops it and adds the server's own records."""

    def __init__(self, args, config: str, run: dict, server: tuple):
        self.args, self.config, self.out, self.server = args, config, run, server
        self.srv: Optional[Server] = None

    def start(self) -> Server:
        self.srv = Server(*self.server, self.args.top_logprobs)
        self.out["start_s"].append(self.srv.wait_ready(self.args.start_timeout))
        return self.srv

    def restart(self, wl: Optional[e2e.Workload], changes: Optional[dict] = None) -> Server:
        """The tier settled, the server stopped, the page cache dropped, the server started again
        on its store. After a warm phase (changes None) a +misplace variant's page is swapped
        while it is down; the identity phase passes SGLang flags to change (configs.with_flags)."""
        self.out["settle_s"] = settle(self.args, self.config)
        self.srv.stop()
        if changes:
            cmd, env, log, port = self.server
            self.server = (configs.with_flags(cmd, changes), env, log, port)
        elif configs.misplaced(self.config):
            self.out["misplaced"] = misplace_control(self.args, wl)
        self.out["page_cache"] = drop_caches()
        return self.start()

    def run(self, phases) -> dict:
        try:
            self.start()
            phases()
            self.out["metrics"] = scrape_metrics(self.srv.url)
        except Exception as e:  # keep what this configuration measured so far
            self.out["error"] = repr(e)
            print(f"  {self.config}: {e!r}", flush=True)
        finally:
            if self.srv is not None:
                self.srv.stop()
        return finish_run(self.args, self.config, self.out)


def own_phases(args, sess: Session, wl: e2e.Workload, deadline: float, store_from: str,
               capacity: bool, cap_docs: int) -> None:
    """The harness's own client (--client own): warm, [restart], first, sweep, rates, capacity."""
    run, base = sess.out, configs.split_config(sess.config)[0]
    srv = sess.srv
    if base != "recompute" and not store_from:
        record_phase(run, "warm", run_sequential(srv, wl.warm(), args.max_new))
    if base in configs.PERSISTENT and not store_from and not args.no_restart:
        srv = sess.restart(wl)
    record_phase(run, "first", [one_request(srv, wl.first(), args.max_new)])
    sweep = e2e.sweep_requests(wl, args.fractions)
    # the sweep's extend sizes compiled first: else a size's first compile falls on its restore
    # and not on the compute-only twin after it (0.7-0.9 s on the MoE models)
    # (salted like the workload: a server sharing another's store must compute them, not restore them)
    run["sweep_warmup"] = warm_extend_sizes(srv, e2e.extend_sizes(sweep), args.page_size, seed=11 + wl.salt)
    if base != "dram":  # what the warm-up stored is written before the first point
        run["sweep_warmup"]["settle_s"] = settle(args, sess.config, quiet_s=1.0, limit_s=30.0)
    record_phase(run, "sweep", run_sequential(srv, sweep, args.max_new, flush=base != "dram"))
    for rate in args.rates:
        if time.time() > deadline - 20:
            run["skipped"] = f"rates from {rate} on: out of time"
            break
        if base != "dram":
            srv.flush()
        recs, secs = run_rate(srv, wl.rates(rate, args.rate_requests), rate, args.max_new)
        record_phase(run, f"rate{rate:g}", recs, secs)
    if capacity and time.time() < deadline - 60:
        # last: its working set (3x the DRAM tier) would evict dram's documents before the sweep
        ctx = args.capacity_context
        record_phase(run, "capwarm", run_sequential(srv, wl.capacity_warm(cap_docs, ctx), args.max_new))
        record_phase(run, "capacity", run_sequential(
            srv, wl.capacity_reuse(cap_docs, ctx, args.capacity_requests), args.max_new))


def host_memory_into(run: dict) -> None:
    """Where the host-memory guard killed this configuration's processes (hostmem.py): its
    trips in the run and the first one's reason ahead of the error it caused."""
    if GUARD.trips:
        run["host_memory_trips"] = list(GUARD.trips)
        first = GUARD.trips[0]["reason"]
        run["error"] = first + (f"; then {run['error']}" if run.get("error") else "")


def finish_run(args, config: str, run: dict) -> dict:
    """The server's own records into the run: tutti's stats and timeline, restore and wear."""
    host_memory_into(run)
    run["tutti_stats"] = tutti_stats(args.out_dir, config)
    files = config_files(args.out_dir, "timeline", config)
    run["timeline"] = [timeline.summarize(r) for r in timeline.read(files)]
    host = timeline.host_summary(files, args.bpt * args.page_size) if files else {}  # host tier's calls
    if host:
        run["host_calls"] = host
    run.update(restore_summary(run["tutti_stats"]))
    run.update(wear_summary(run["tutti_stats"]))
    return run


def main_shape(args) -> serving.Shape:
    """bench_serving's data set for the warm, reuse and rate phases: --docs documents of the
    largest context, questions of --question-tokens, --max-new new tokens."""
    return serving.Shape(groups=args.docs, per_group=1, system=max(int(c) for c in args.contexts.split(",")),
                         question=args.question_tokens, output=args.max_new, seed=args.serving_seed)


def cached_pages(prompt_tokens: int, page: int = e2e.PAGE) -> int:
    """The most of a prompt SGLang can take from a cache: its whole pages short of the last token
    (which the prefill must compute to sample from)."""
    return (prompt_tokens - 1) // page * page


def serving_phase(args, run: dict, srv: Server, name: str, shape: serving.Shape, prefix: str,
                  cached: list, rate: float = math.inf, concurrency: int = 1, flush: bool = False) -> dict:
    """One phase sent by bench_serving: its records (the harness's summary) and its own report
    (run["serving"][name])."""
    sent = serving.prompts(shape, args.model)
    t0 = time.time()
    result = serving.run(srv, shape, args.model, os.path.join(args.out_dir, f"bs-{run['config']}-{name}.jsonl"),
                         rate=rate, concurrency=concurrency, flush=flush,
                         log_path=os.path.join(args.out_dir, f"bs-{run['config']}.log"),
                         client=getattr(args, "bs_client", None))
    run.setdefault("serving", {})[name] = {"rate": None if math.isinf(rate) else rate,
                                           "max_concurrency": concurrency, "flush": flush,
                                           "shape": dataclasses.asdict(shape), **serving.summary(result)}
    record_phase(run, name, serving.records(result, sent, serving.gsp_ids(prefix, shape), cached),
                 result.get("duration") or time.time() - t0)
    return result


def serving_phases(args, sess: Session, deadline: float, store_from: str, capacity: bool,
                   cap_docs: int) -> None:
    """run_config's phases with bench_serving as the client (--client bench-serving):
    `warm`: each document once, one at a time (its first request: the first on an empty store);
    storage configurations then restart on a dropped page cache; `reuse`: the same requests again
    (the first restore after the start, then the later ones); `check`: the same prompts from the
    harness's own client with top-k logprobs, device cache flushed before each (not `dram`), for
    the output check; `again`: the reuse requests a third time, device cache flushed first (the
    tiered linker's pages read twice from the SSD now come from DRAM); `rate<R>` for each --rates,
    ascending, new questions on the documents at R/s
    after a flush, until the mean TTFT reaches --slo-s; `capwarm` + `capacity`: a working set of
    3x --dram-gb written, then Zipf(--zipf-alpha) reuse --capacity-concurrency at a time (one
    `capacity<alpha>` phase per alpha when --zipf-alpha lists several); with --identity-restart,
    last, `identity` (identity_phase). Before the first concurrent phase, SGLang's kernels for
    multi-sequence batches are compiled (warm_batch_kernels). --phases picks among them."""
    run, base, srv = sess.out, configs.split_config(sess.config)[0], sess.srv
    shape = main_shape(args)
    ps = args.page_size
    pages = [cached_pages(shape.system + shape.question, ps)] * shape.requests
    want = set(args.phases.split(","))
    if not store_from and "warm" in want:
        serving_phase(args, run, srv, "warm", shape, "warm", [0] * shape.requests)
        if base in configs.PERSISTENT and not args.no_restart:
            srv = sess.restart(None)
    if "reuse" in want:
        serving_phase(args, run, srv, "reuse", shape, "reuse", pages)
    if "check" in want:
        checks = serving.check_requests(shape, serving.prompts(shape, args.model), ps)
        record_phase(run, "check", run_sequential(srv, checks, args.max_new, flush=base != "dram"))
    if "again" in want:  # a third pass: the tiered linker's pages read twice are now in DRAM
        serving_phase(args, run, srv, "again", shape, "again", pages, flush=base not in ("dram", "recompute"))
    points = {}
    concurrent = bool(args.rates) and "rates" in want or capacity and "capacity" in want
    if concurrent:  # kernels for batches of several sequences compile here, not in a measured request
        run["kernel_warmup"] = warm_batch_kernels(srv, ps)
    for rate in sorted(args.rates) if "rates" in want else ():
        if time.time() > deadline - 30:
            run["skipped"] = f"rates from {rate:g} on: out of time"
            break
        rshape = shape.with_(per_group=max(1, -(-args.rate_requests // shape.groups)))
        doc_pages = shape.system // ps * ps  # a new question on a stored document
        res = serving_phase(args, run, srv, f"rate{rate:g}", rshape, f"rate{rate:g}",
                            [doc_pages] * rshape.requests, rate=rate, concurrency=args.rate_concurrency,
                            flush=base not in ("dram", "recompute"))
        ok = res.get("completed", 0) == rshape.requests
        points[rate] = res.get("mean_ttft_ms", 0) / 1e3 if ok else None
        broken = points[rate] is None or points[rate] >= args.slo_s
        if broken and (points[rate] is None or rate >= args.rates_through):
            break  # higher rates only queue more (--rates-through: past the SLO up to a comparison rate)
    if points:
        run["rate_sweep"] = {"slo_s": args.slo_s, "mean_ttft_s": {f"{r:g}": t for r, t in points.items()},
                             "highest_rate_under_slo": serving.highest_rate(points, args.slo_s)}
    if capacity and "capacity" in want and time.time() < deadline - 60:
        cshape = serving.Shape(groups=cap_docs, per_group=1, system=args.capacity_context,
                               question=args.question_tokens, output=args.max_new,
                               seed=args.serving_seed + 1)
        cpages = cached_pages(args.capacity_context + args.question_tokens, ps)
        serving_phase(args, run, srv, "capwarm", cshape, "capwarm", [0] * cshape.requests)
        alphas = zipf_alphas(args.zipf_alpha)
        for alpha in alphas:  # one after another on the same server and store
            name = capacity_phase(alpha, alphas)
            if name != "capacity" and time.time() > deadline - 30:
                run["skipped"] = f"{name}: out of time"
                break
            zshape = cshape.with_(per_group=max(1, -(-args.capacity_requests // cap_docs)), zipf=alpha)
            serving_phase(args, run, srv, name, zshape, "cap", [cpages] * zshape.requests,
                          concurrency=args.capacity_concurrency)
    if getattr(args, "identity_restart", "") and base in configs.PERSISTENT and \
            ("warm" in run["phases"] or store_from):
        identity_phase(args, sess, shape)


def identity_phase(args, sess: Session, shape: serving.Shape) -> None:
    """Last: the server restarts on its store with --identity-restart's flags changed (another KV
    dtype, page size), and the reuse requests are sent again. A store written under one identity
    must not be read under another: every prompt token is recomputed (run["identity"]: the
    tokens the server still found cached, which must be 0, by tier)."""
    run = sess.out
    changes = configs.identity_changes(args.identity_restart)
    srv = sess.restart(None, changes)
    serving_phase(args, run, srv, "identity", shape, "identity", [0] * shape.requests)
    recs, s = run["phases"]["identity"], run["summaries"]["identity"]
    done = s["requests"] - s["failed"]
    run["identity"] = {"changed": changes, "requests": s["requests"], "failed": s["failed"],
                       "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in recs),
                       "cached_tokens": sum(r.get("cached_tokens") or 0 for r in recs),
                       "cached_by_tier": {k: round(v * done) for k, v in s["cached_by_tier_mean"].items()}}


def zipf_alphas(value) -> list:
    """--zipf-alpha: a number, or several comma-separated."""
    return [float(x) for x in str(value).split(",") if x.strip()]


def capacity_phase(alpha: float, alphas: list) -> str:
    """The capacity phase's name: `capacity`, or `capacity<alpha>` when a call runs several."""
    return "capacity" if len(alphas) == 1 else f"capacity{alpha:g}"


def misplace_control(args, wl: Optional[e2e.Workload]) -> dict:
    """A +misplace variant, between the warm phase and the restart (no server attached): a page of
    one warmed document rewritten under another's key (misplace.py); wl None: bench_serving's
    documents 0 and 1, the page in the middle of the document. The run's JSON keeps what
    was swapped and which requests must now differ from recompute; a failure is recorded there
    and the run goes on (the report then says the control did not run)."""
    dirs = [os.path.join(d, "tutti") for d in args.tutti_dirs.split(",")]
    try:
        if wl is None:  # bench_serving's documents 0 and 1; the check phase's requests
            shape = main_shape(args)
            sent = serving.prompts(shape, args.model)
            ps = args.page_size
            out = {"context": shape.system, "documents": [0, 1],
                   **misplace.misplace_docs(sent[:2], shape.system // ps // 2, dirs, args.capacity_gb,
                                            serving.check_requests(shape, sent, ps), page_size=ps)}
        else:
            later = [wl.first(), *e2e.sweep_requests(wl, args.fractions),
                     *(r for rate in args.rates for r in wl.rates(rate, args.rate_requests))]
            out = misplace.misplace(wl, dirs, args.capacity_gb, later)
    except Exception as e:  # noqa: BLE001 - the control failing must not end the run
        out = {"error": repr(e)}
    print("  misplaced page:", json.dumps({k: v for k, v in out.items() if k != "affected"}), flush=True)
    return out


def run_cluster(args, config: str, wl: e2e.Workload, raw: dict) -> dict:
    """tutti-mooncake, remote hits between two servers on this GPU: a mooncake_master on loopback;
    server A (its own tutti directories, publishing every page into its Mooncake segment) answers
    the warm phase; then server B (its own empty directories, promotion and publishing off, so
    every sweep point is a remote hit) answers `first` and the sweep, flushing its device and
    host caches before each point. A stays up until B is done: a Mooncake client's objects go
    with it. Loopback TCP, not a cluster network (docs/cluster.md)."""
    from tutti_hicache.testing.cluster import Master, mooncake_extra
    clear_storage(args, config, tutti_names=("tutti-a", "tutti-b"))
    GUARD.reset()
    run = {"config": config, "medium": args.medium, **raw, "layers": args.layers,
           "cuda_graph_max_bs": args.cuda_graph_max_bs, "prefill_graphs": args.prefill_graphs,
           # what e2e.model_key matches its outputs and rows on, as run_config records them
           "model_shape": args.model_shape, "kv_cache_dtype": args.kv_cache_dtype,
           "weights": args.weights, "page_size": getattr(args, "page_size", e2e.PAGE),
           "page_bytes": args.bpt * getattr(args, "page_size", e2e.PAGE), "phases": {}, "summaries": {},
           "start_s": [],
           "host_pool_gb": args.host_gb, "store_from": None, "salt": wl.salt,
           "note": "B's hits come from A's Mooncake segment over loopback TCP"}

    master = Master(log_path=os.path.join(args.out_dir, "mooncake-master.log")).start()
    port = 30000 + configs.CONFIGS.index(configs.CLUSTER)
    servers = []
    try:
        for node, extra in (("a", mooncake_extra(master, int(args.mooncake_segment_gb * 1024),
                                                 tutti_cluster_publish="all", tutti_cluster_promote=False)),
                            ("b", mooncake_extra(master, 64, tutti_cluster_publish="off",
                                                 tutti_cluster_promote=False))):
            node_port = port + (node == "b") * 50
            cmd, env = configs.server_cmd(args, config, node_port, node, extra)
            srv = Server(cmd, env, os.path.join(args.out_dir, f"server-{config}-{node}.log"), node_port,
                         args.top_logprobs)
            servers.append(srv)
            run["start_s"].append(srv.wait_ready(args.start_timeout))
            if node == "a":
                record_phase(run, "warm", run_sequential(srv, wl.warm(), args.max_new))
                run["settle_s"] = settle(args, f"{config}-a")
        srv = servers[-1]
        record_phase(run, "first", [one_request(srv, wl.first(), args.max_new)])
        sweep = e2e.sweep_requests(wl, args.fractions)
        run["sweep_warmup"] = warm_extend_sizes(srv, e2e.extend_sizes(sweep), args.page_size)
        run["sweep_warmup"]["settle_s"] = settle(args, f"{config}-b", quiet_s=1.0, limit_s=30.0)
        record_phase(run, "sweep", run_sequential(srv, sweep, args.max_new, flush=True))
        run["metrics"] = scrape_metrics(srv.url)
    except Exception as e:  # keep what it measured so far
        run["error"] = repr(e)
        print(f"  {config}: {e!r}", flush=True)
    finally:
        for srv in reversed(servers):
            srv.stop()
        master.stop()
    host_memory_into(run)
    run["tutti_stats"] = tutti_stats(args.out_dir, config)
    run.update(restore_summary(tutti_stats(args.out_dir, f"{config}-b")))
    run.update(wear_summary(run["tutti_stats"]))
    return run


def restore_summary(stats: list) -> dict:
    """Restore GB/s from tutti's stats files: the linker's loads, else the host tier's reads. The
    linker's counts the pages its loads read from the SSD (load_ssd_pages), not those its DRAM
    tier or a copy in the pool served, over the loads' whole time (a lower bound where DRAM
    pages shared a load); stats from before that counter count every page of a load."""
    lk = [s.get("linker", {}) for s in stats]
    lb = sum(k.get("load_bytes", 0) if "load_ssd_pages" not in k or not k.get("load_pages")
             else k["load_bytes"] // k["load_pages"] * k["load_ssd_pages"] for k in lk)
    ls = sum(k.get("load_seconds", 0.0) for k in lk)
    rb = sum(s.get("read_bytes", 0) for s in stats)
    rs = sum(s.get("read_seconds", 0.0) for s in stats)
    out = {"checksum_failures": sum(s.get("checksum_failures", 0) for s in stats)} if stats else {}
    if ls:
        out["restore_GBps"] = lb / ls / 1e9
        out["first_load_s"] = [s["linker"].get("first_load_seconds") for s in stats if "linker" in s]
        out["warmup_s"] = [s["linker"].get("warmup_seconds") for s in stats if "linker" in s]
    elif rs:
        out["restore_GBps"] = rb / rs / 1e9
    return out


def wear_summary(stats: list) -> dict:
    """Bytes tutti handed the drives over every server process of a run (each stats file holds one
    process's session), the KV bytes stored, and their ratio: the write amplification."""
    w = [s["wear"] for s in stats if "wear" in s]
    if not w:
        return {}
    phys, logical = sum(x["physical_bytes"] for x in w), sum(x["logical_bytes"] for x in w)
    return {"ssd_written_bytes": phys, "kv_stored_bytes": logical,
            "write_amplification": phys / logical if logical else None}


def scrape_metrics(url: str) -> list:
    import requests
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException as e:
        return [f"unavailable: {e}"]
    keys = ("prefetch", "backup", "cached_tokens", "hicache", "cache_hit", "tutti_")
    return [ln for ln in text.splitlines() if not ln.startswith("#") and any(k in ln for k in keys)]


def main(description: str = __doc__):
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8")
    ap.add_argument("--write-model", action="store_true", help="write the model directory (--weights) first")
    ap.add_argument("--weights", choices=configs.WEIGHTS, default="dummy",
                    help="dummy: SGLang's --load-format dummy (outputs barely depend on the KV); seeded: "
                         "a safetensors checkpoint of seeded HF-style random weights that the server "
                         "loads (written by --write-model), so the output check can fail")
    ap.add_argument("--weights-seed", type=int, default=0, help="the seed of --weights seeded")
    ap.add_argument("--top-logprobs", type=int, default=5,
                    help="k: every request asks for its output positions' top-k logprobs, compared "
                         "with recompute's (0: greedy ids only)")
    ap.add_argument("--logprob-tol", type=float, default=e2e.LOGPROB_TOL,
                    help="largest top-k logprob difference from recompute still counted equal")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model-shape", choices=tuple(configs.MODELS), default="llama3-8b",
                    help="the model's geometry (configs.MODELS); --layers of it")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *configs.FP8_KV),
                    help="SGLang's --kv-cache-dtype, every configuration")
    ap.add_argument("--attention-backend", default="triton", help="SGLang's --attention-backend")
    ap.add_argument("--page-size", type=int, default=e2e.PAGE,
                    help="SGLang's --page-size, every configuration (both clients cut cached prefixes to it)")
    ap.add_argument("--medium", required=True, help="name of the medium, for the report")
    ap.add_argument("--tutti-dirs", required=True, help="comma-separated: tutti stripes over them")
    ap.add_argument("--one-dir", required=True, help="one directory on the same devices, for file / nixl")
    ap.add_argument("--one-dir-note", default="", help="what --one-dir is, for the report")
    ap.add_argument("--nixl-dirs", default="", help="comma-separated, for nixl (default: --one-dir)")
    ap.add_argument("--configs", default="recompute,tutti-linker")
    ap.add_argument("--contexts", default="16384,32768,65536")
    ap.add_argument("--docs", type=int, default=2, help="documents per context")
    ap.add_argument("--fractions", default="0.5,0.9,0.95,0.99")
    ap.add_argument("--rates", default="0.5,1,2")
    ap.add_argument("--rate-requests", type=int, default=5)
    ap.add_argument("--capacity-configs", default="dram,tutti-linker")
    ap.add_argument("--capacity-context", type=int, default=32768)
    ap.add_argument("--capacity-requests", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=150000, help="device pool, every configuration")
    ap.add_argument("--dram-gb", type=int, default=14, help="dram's host pool (holds every prefix)")
    ap.add_argument("--host-gb", type=int, default=6, help="host pool of the storage configurations")
    ap.add_argument("--capacity-gb", type=float, default=60.0, help="tutti_capacity_gb")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=0,
                    help="decode CUDA graphs for batches up to this size, prefill graphs off, in "
                         "every configuration (0: none, --disable-cuda-graph, the default)")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="with --cuda-graph-max-bs: leave SGLang's prefill graphs on, as it picks them")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--deadline-s", type=float, default=0, help="skip configurations that would not finish")
    ap.add_argument("--config-s", type=float, default=200,
                    help="time one configuration needs: a later one that would not finish before "
                         "--deadline-s is skipped (the first always starts)")
    ap.add_argument("--share-linker-store", action="store_true",
                    help="linker configurations after the first start on the store it wrote (no warm "
                         "phase, no first server), with salted questions and new tokens")
    ap.add_argument("--mooncake-segment-gb", type=float, default=8.0,
                    help="tutti-mooncake: server A's Mooncake segment (holds every warmed page)")
    ap.add_argument("--client", choices=("own", "bench-serving"), default="own",
                    help="own: the harness's client and the Workload's phases (warm, first, sweep, "
                         "rates, capacity); bench-serving: SGLang's bench_serving sends the warm, "
                         "reuse, rate and capacity phases (generated-shared-prefix, --tokenize-prompt) "
                         "and the harness's client only the output check (serving_config)")
    ap.add_argument("--no-restart", action="store_true",
                    help="storage configurations keep their server after the warm phase (the DRAM "
                         "tiers stay warm: the hot-set figure); default: restart on a dropped page cache")
    ap.add_argument("--phases", default="warm,reuse,check,again,rates,capacity",
                    help="bench-serving: the phases to run, in their fixed order (a configuration "
                         "that restarts does so only after a warm phase)")
    ap.add_argument("--question-tokens", type=int, default=256,
                    help="bench-serving: tokens after each document (its question)")
    ap.add_argument("--serving-seed", type=int, default=0, help="bench-serving: the data set's seed")
    ap.add_argument("--rate-concurrency", type=int, default=64,
                    help="bench-serving: most requests in flight during a rate phase")
    ap.add_argument("--slo-s", type=float, default=1.0,
                    help="bench-serving: the rate sweep stops at the first rate whose mean TTFT "
                         "reaches this; the report gives the highest rate under it")
    ap.add_argument("--rates-through", type=float, default=0,
                    help="bench-serving: go on past the SLO's breaking point up to this rate, so "
                         "every configuration has a point at a comparison rate (the paper compares "
                         "at LMCache-DRAM's SLO rate); the highest rate under the SLO is unchanged")
    ap.add_argument("--zipf-alpha", default="0.8",
                    help="bench-serving: the capacity phase's document popularity; comma-separated: "
                         "one capacity phase per alpha, in order, on the same server (capacity<alpha>)")
    ap.add_argument("--capacity-concurrency", type=int, default=2,
                    help="bench-serving: requests in flight during the capacity phase")
    ap.add_argument("--identity-restart", default="",
                    help="bench-serving: a last phase for storage configurations: restart on the "
                         "store with these SGLang flags changed (kv-cache-dtype=fp8_e4m3, "
                         "page-size=32, comma-separated) and send the reuse requests again; the "
                         "store must answer every one with a miss (run['identity'])")
    ap.add_argument("--reference", default="",
                    help="a JSON of an earlier run whose recompute configuration's outputs the "
                         "output check compares with (when this run has no recompute)")
    ap.add_argument("--host-mem-floor-gb", type=float, default=None,
                    help="kill the servers (and record why) when the host's available memory falls "
                         "under this; default max(2 GiB, 4%% of the machine's memory) (hostmem.py)")
    ap.add_argument("--out-dir", default="/tmp/tutti-e2e")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",")]
    if args.identity_restart:
        try:
            configs.identity_changes(args.identity_restart)
        except ValueError as e:
            ap.error(str(e))
    args.rates = [float(x) for x in args.rates.split(",") if x]
    alphas = zipf_alphas(args.zipf_alpha)
    if not alphas or min(alphas) <= 0:
        ap.error("--zipf-alpha: one or more positive numbers, comma-separated")
    if args.page_size < 1:
        ap.error("--page-size: a positive number of tokens")
    args.bpt = configs.kv_bytes_per_token(args.model_shape, args.layers, args.kv_cache_dtype)
    for config in args.configs.split(","):
        configs.split_config(config)  # an unknown configuration or a bad variant fails here, not later
    if args.docs < 2 and any(configs.misplaced(c) for c in args.configs.split(",")):
        ap.error("+misplace swaps a page between two documents: --docs 2 or more")
    os.makedirs(args.out_dir, exist_ok=True)
    GUARD.start(args.host_mem_floor_gb)
    print(f"host-memory guard: floor {GUARD.floor / 2**30:.1f} GiB of {GUARD.total / 2**30:.1f}", flush=True)
    t_start = time.time()  # the deadline counts the model's writing (--weights seeded: seconds)
    if args.write_model:
        configs.write_model(args.model, args.layers, args.weights, args.weights_seed, args.model_shape)
    deadline = t_start + args.deadline_s if args.deadline_s else float("inf")
    wl = e2e.Workload([int(c) for c in args.contexts.split(",")], args.docs, page=args.page_size)
    args.bs_client = None
    if args.client == "bench-serving":  # its imports run while the media are read and servers start
        args.bs_client = serving.Client(os.path.join(args.out_dir, "bench-serving.log"), cwd=args.out_dir)
        args.bs_client.start()
    # also through tutti's engine at the linker's own request size (one layer of one page): below
    # 256 KiB (MLA's 72 KiB latents) the medium's rate per request may set the restore's pace
    dirs = args.tutti_dirs.split(",")
    request = configs.layer_request_bytes(args.model_shape, args.page_size, args.kv_cache_dtype)
    before = raw_read_dirs(dirs, 4 << 30, engine_req=request)
    raw = {"raw_read_GBps": before["raw_read_GBps"],
           "raw_request_bytes": request, "raw_request_GBps": before["raw_engine_GBps"],
           "raw_read_one_dir_GBps": raw_read_dirs([args.one_dir], 4 << 30, threads=16)["raw_read_GBps"]}
    print("raw O_DIRECT read:", json.dumps(raw), flush=True)
    results = []
    if os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
    earlier = len(results)  # runs of an earlier call: their raw reads are that call's, not this one's
    PARTIAL.update(json=args.json, done=results)
    writer = ""  # the linker configuration whose store later ones share (--share-linker-store)
    ran = 0  # configurations this call started: the first always starts, its phases cut by the deadline
    for config in args.configs.split(","):
        if ran and time.time() + args.config_s > deadline:
            print(f"skipped {config}: out of time", flush=True)
            results.append({"config": config, "medium": args.medium, "skipped": "out of time"})
            continue
        base = configs.split_config(config)[0]
        shared = args.share_linker_store and writer and base in configs.LINKERS and not configs.misplaced(config)
        salt = sum(r.get("store_from") is not None for r in results) + 1 if shared else 0
        if base == configs.CLUSTER:
            run = run_cluster(args, config, wl, raw)
        else:
            run = run_config(args, config, e2e.Workload(wl.contexts, wl.docs, salt=salt, page=wl.page) if shared else wl,
                             raw, deadline, writer if shared else "")
        results.append(run)
        ran += 1
        if args.share_linker_store and not writer and base in configs.LINKERS and "warm" in run["phases"] \
                and "error" not in run and not configs.misplaced(config):
            writer = config
        with open(args.json, "w") as f:
            json.dump(results, f, default=str)
    # the medium's rate moves between and within calls: read it again after the configurations,
    # and set the I/O floor by the faster of the two reads (the stricter bar)
    again = raw_read_dirs(dirs, 4 << 30, engine_req=request)
    after, after_req = again["raw_read_GBps"], again["raw_engine_GBps"]
    print(f"raw O_DIRECT read after the configurations: {after:.2f} GB/s "
          f"({after_req:.2f} through tutti's engine in {request >> 10} KiB requests)", flush=True)
    for run in results[earlier:]:
        if "raw_read_GBps" in run and "raw_read_after_GBps" not in run:
            run["raw_read_before_GBps"], run["raw_read_after_GBps"] = run["raw_read_GBps"], after
            run["raw_read_GBps"] = max(run["raw_read_GBps"], after)
            run["raw_request_GBps"] = max(run.get("raw_request_GBps") or 0, after_req)
    refs = []
    if args.reference and not any(r.get("config") == "recompute" for r in results):
        with open(args.reference) as f:
            refs = [r for r in json.load(f) if r.get("config") == "recompute"]
    if args.bs_client is not None:
        args.bs_client.close()
    GUARD.stop()  # no server left to watch
    eq = e2e.outputs_vs(results + refs, tol=args.logprob_tol)
    for run in results:  # the output check, in the JSON beside each run
        run["outputs_vs_recompute"] = eq.get(e2e.run_key(run))
        run["logprob_tol"] = args.logprob_tol
    with open(args.json, "w") as f:
        json.dump(results, f, default=str)
    print(e2e_report.report_markdown(results, args.bpt, tol=args.logprob_tol, refs=refs), flush=True)


if __name__ == "__main__":
    main()
