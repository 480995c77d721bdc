"""Layer-wise prefix restore behind a real forward pass: TTFT and GPU bubble time.

A Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads x 128, MLP 14336,
bf16, random weights; SDPA attention over the paged KV pool, real MLP GEMMs) prefills one
request of context C whose first h*C tokens are a cached prefix, calling the counter's
wait_until(l) before layer l's attention exactly as SGLang's KV pool does. Configurations:
  recompute     no cache (h = 0)
  compute-only  the prefix is already in the device pool (lower bound)
  dram          prefix KV in pinned host memory, copied layer by layer (HiCache L2 best case)
  tutti:<medium> LayerwiseKV (the TuttiLinker pipeline) restoring from the store on <medium>
  tutti-tiered:<medium>  the same with its DRAM tier (--host-gb): the prefix restored from DRAM
Reported per (medium, C, h): TTFT, bubble (time the forward waits in wait_until, from CUDA
events), I/O-only restore time and bandwidth, engine syscalls and CPU seconds per request, and
the medium's raw O_DIRECT read (same run), and per run the load's own times from its trace
(layerwise.timeline.Trace, summarized as tutti_hicache/benchmarks/timeline.py does a timeline
file): its reads' end, each layer's hand-over after its reads, the last layer's, and what the
request took beyond its reads. --read-ahead 1,3 measures every point with each value (one
pipeline per value, tutti_read_ahead, on the store the first one wrote), --repeats N runs every
point N times ("arms" in the JSON holds the medians). --dry-run: tiny shapes on CPU (pipeline
check only).

  python bench/bench_prefill.py --medium array-4=/mnt/a0,/mnt/a1,/mnt/a2,/mnt/a3 \
      --contexts 16384,32768,65536 --hits 0.5,0.75,0.9,0.95,0.99 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time

import torch

from tutti_hicache.benchmarks.model import Model, prefill, sync
from tutti_hicache.benchmarks.offload import OffloadStream
from tutti_hicache.benchmarks.timeline import summarize
from tutti_hicache.config import TuttiConfig
from tutti_hicache.layerwise import LayerCounter, LayerwiseKV
from tutti_hicache.layerwise.timeline import Trace
from tutti_hicache.layout import PageGeometry

ENGINE, VERIFY, STAGE_DEPTH, THREADS = "auto", True, TuttiConfig().stage_depth, 16
LLAMA = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, page=64)
TINY = dict(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512, page=16)


class DramTier:
    """Prefix KV in pinned host memory, copied layer by layer on a side stream (HiCache L2)."""

    def __init__(self, model: Model, prefix_rows: int):
        self.m = model
        page = model.s["page"]
        pin = torch.cuda.is_available()
        self.k = [b[page:page + prefix_rows].to("cpu").pin_memory() if pin else b[page:page + prefix_rows].clone()
                  for b in model.k]
        self.v = [b[page:page + prefix_rows].to("cpu").pin_memory() if pin else b[page:page + prefix_rows].clone()
                  for b in model.v]
        self.counter = LayerCounter(len(model.k))
        self.stream = torch.cuda.Stream() if pin else None

    def start(self, rows: int) -> int:
        idx = self.counter.update_producer()
        page = self.m.s["page"]
        for l in range(len(self.m.k)):
            if self.stream is None:
                self.m.k[l][page:page + rows].copy_(self.k[l][:rows])
                self.m.v[l][page:page + rows].copy_(self.v[l][:rows])
                self.counter.complete(idx, l)
                continue
            with torch.cuda.stream(self.stream):
                self.m.k[l][page:page + rows].copy_(self.k[l][:rows], non_blocking=True)
                self.m.v[l][page:page + rows].copy_(self.v[l][:rows], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            self.counter.complete(idx, l, ev)
        return idx


def fill_prefix(model, rows: int) -> None:
    g = torch.Generator(device=model.device).manual_seed(1)
    page = model.s["page"]
    for b in model.k + model.v:
        b[page:page + rows] = torch.randn(b[page:page + rows].shape, generator=g, device=model.device).to(b.dtype)


def make_tutti(model, dirs, cap_gb: float, read_ahead: int, observer=None,
               host_gb: float = 0) -> LayerwiseKV:
    s = model.s
    kb = s["kv_heads"] * s["head_dim"] * 2
    g = PageGeometry("mha", s["layers"], s["page"], kb, kb)
    cfg = TuttiConfig.from_sources({"tutti_dirs": list(dirs), "tutti_capacity_gb": cap_gb,
                                    "tutti_threads": THREADS, "tutti_queue_depth": 1024,
                                    "tutti_engine": ENGINE, "tutti_verify": VERIFY,
                                    "tutti_stage_depth": STAGE_DEPTH, "tutti_read_ahead": read_ahead,
                                    "tutti_host_gb": host_gb})  # 0: the SSD path alone
    ident = {"bench": "llama-shaped", "layers": s["layers"], "page": s["page"]}
    # every point measures a restore from the medium: back-to-back restores of one prefix with no
    # decode between them would otherwise copy the pages the last one restored (loader.py)
    return LayerwiseKV(cfg, g, ident, model.k, model.v, s["page"], observer=observer,
                       copy_recent=False)


def write_prefix(lw: LayerwiseKV, model, keys: list, pages: int) -> float:
    """Offload pages 1..pages of the pool under keys (the GPU gather -> pinned -> write path)."""
    page = model.s["page"]
    idx = torch.arange(page, page * (pages + 1), device=model.device)
    t0 = time.perf_counter()
    for c in range(0, pages, 256):
        lw.offload(keys[c:c + 256], idx[c * page:(c + 256) * page], [])
    while lw.num_completed() < math.ceil(pages / 256):
        time.sleep(0.01)
    oks = [lw.pop_completed() for _ in range(math.ceil(pages / 256))]
    assert all(oks), "offload failed"
    return time.perf_counter() - t0


def restore_fn(lw: LayerwiseKV, model, keys: list, pages: int):
    page = model.s["page"]
    idx = torch.arange(page, page * (pages + 1), device=model.device)

    def start():
        assert lw.load("r", keys[:pages], idx[: pages * page])
        return lw.start()
    return start


def io_only(lw, model, keys, pages) -> tuple[float, dict]:
    c0, cpu0 = lw.store.engine.counters(), time.process_time()
    sync()
    t0 = time.perf_counter()
    index = restore_fn(lw, model, keys, pages)()
    ok = lw.finish(index)
    sync()
    dt = time.perf_counter() - t0
    c1 = lw.store.engine.counters()
    assert ok, "restore failed"
    return dt, {"enter_calls": c1["enter_calls"] - c0["enter_calls"],
                "submissions": c1["submissions"] - c0["submissions"],
                "cpu_s": time.process_time() - cpu0}


def raw_read(dirs, nbytes: int) -> dict:
    """Raw O_DIRECT read of a same-size file per directory, all directories at once (8 readers
    each, distinct pre-faulted memory): the sum of the per-directory rates."""
    from tutti_hicache.benchmarks.rawio import raw_read_dirs
    return raw_read_dirs(dirs, nbytes)  # tutti's per-layer request (K+V of a page), and 8 MiB


def run(args) -> dict:
    shape = TINY if args.dry_run else LLAMA
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    hits = [float(h) for h in args.hits.split(",")]
    page = shape["page"]
    max_pages = max(contexts) // page
    model = Model(shape, (max_pages + 2) * page, device)
    fill_prefix(model, max_pages * page)
    out = {"shape": shape, "device": str(device), "results": [], "media": {}}
    if args.baselines:
        dram = DramTier(model, max_pages * page)
        for c in contexts:
            prefill(model, c, 0)  # warm-up
            rec = prefill(model, c, 0)[0]
            for h in hits:
                pages = int(c * h) // page
                comp = prefill(model, c, pages * page)[0]
                ttft, bub = prefill(model, c, pages * page, lambda p=pages: dram.start(p * page), dram.counter)
                out["results"] += [dict(config="recompute", C=c, h=h, ttft_s=rec),
                                   dict(config="compute-only", C=c, h=h, ttft_s=comp),
                                   dict(config="dram", C=c, h=h, ttft_s=ttft, bubble_s=bub)]
                print(f"C={c} h={h}: recompute {rec:.3f}s compute-only {comp:.3f}s dram {ttft:.3f}s", flush=True)
    for spec in args.medium:
        name, dirs = spec.split("=", 1)
        dirs = dirs.split(",")
        fill_prefix(model, max_pages * page)  # forwards overwrite rows past their prefix
        snapshot = [(k.clone(), v.clone()) for k, v in zip(model.k, model.v)] if args.dry_run else None
        out["media"][name] = bench_medium(args, model, name, dirs, contexts, hits, max_pages, snapshot)
    return out


def load_trace(rec: dict, ttft: float) -> dict:
    """The load's own times from its trace record (ms from its start): the first and the last
    chunk's reads final, each layer handed over after its last read (median, max), the last
    layer handed over, and what the request took beyond its reads."""
    s = summarize(rec)
    out = {k: s[k] for k in ("first_read_ms", "reads_ms", "react_ms_p50", "react_ms_max",
                             "handed_ms") if k in s}
    if "reads_ms" in out:
        out["beyond_reads_ms"] = ttft * 1e3 - out["reads_ms"]
    return out


def run_point(lw: LayerwiseKV, trace: Trace, model, keys: list, c: int, h: float, prefix_kv) -> dict:
    """One run at (C, h): the I/O-only restore, then the prefill behind it, traced."""
    page = model.s["page"]
    pages = int(c * h) // page
    page_bytes = lw.store.layout.geometry.page_nbytes
    t_io, cnt = io_only(lw, model, keys, pages)
    if prefix_kv is not None:  # dry run: the restored prefix must equal what was written
        for l, (k, v) in enumerate(prefix_kv):
            rows = slice(page, page * (pages + 1))
            assert torch.equal(model.k[l][rows], k[rows]) and torch.equal(model.v[l][rows], v[rows])
    cpu0 = time.process_time()
    ttft, bub = prefill(model, c, pages * page, restore_fn(lw, model, keys, pages), lw.counter)
    cpu_s = time.process_time() - cpu0
    lw.drain_loads()
    return dict(C=c, h=h, ttft_s=ttft, bubble_s=bub, io_only_s=t_io,
                restore_GBps=pages * page_bytes / t_io / 1e9, read_ahead=lw.read_ahead,
                prefill_cpu_s=cpu_s, trace=load_trace(trace.loads[-1], ttft), **cnt)


def bench_medium(args, model, name, dirs, contexts, hits, max_pages, prefix_kv) -> dict:
    """Every point with each read-ahead value: one pipeline per value, each on the store the
    first one wrote (a restart's view of it)."""
    page = model.s["page"]
    page_bytes = model.s["layers"] * 2 * page * model.s["kv_heads"] * model.s["head_dim"] * 2
    slack = 64 + args.offload_stream * 2
    cap_gb = (max_pages + slack) * (page_bytes + 4096 * 65) / 2**30
    keys = [f"{i:064x}" for i in range(max_pages)]
    grid = [(c, h) for c in contexts for h in hits if int(c * h) // page > 0]
    for c in (args.crossover_context,) if args.crossover_context else ():
        grid += [(c, h) for h in (0.96, 0.97, 0.975, 0.98, 0.985, 0.99, 0.995) if (c, h) not in grid]
    info = {"dirs": dirs, "runs": []}
    for arm, read_ahead in enumerate(args.read_ahead):
        trace = Trace()
        lw = make_tutti(model, dirs, cap_gb, read_ahead, trace)
        if arm == 0:
            write_s = write_prefix(lw, model, keys, max_pages)
            raw = raw_read(dirs, min(max_pages * page_bytes, 4 << 30))
            info.update(raw, write_GBps=max_pages * page_bytes / write_s / 1e9)
            print(f"[{name}] wrote {max_pages} pages at {info['write_GBps']:.2f} GB/s; raw read {raw}",
                  flush=True)
        io_only(lw, model, keys, max(1, min(max_pages // 2, 64)))  # the I/O path's first use
        info["runs"] += run_grid(args, lw, trace, model, keys, grid, max_pages, prefix_kv,
                                 f"tutti:{name}", name)
        if arm + 1 == len(args.read_ahead):
            if args.offload_stream:
                c = max(contexts)
                info["offload_stream"] = offload_stream(lw, model, keys, c, int(c * 0.9) // page,
                                                        args.offload_stream, dirs)
            info["write_windows"] = lw.windows.snapshot()
        lw.close()
    info["arms"] = arm_medians(info["runs"])
    if args.host_gb:
        info.update(bench_tiered(args, model, name, dirs, cap_gb, keys, grid, max_pages, prefix_kv))
    return info


def run_grid(args, lw: LayerwiseKV, trace: Trace, model, keys: list, grid: list, max_pages: int,
             prefix_kv, config: str, label: str) -> list:
    """One warm-up prefill behind a restore (first use: kernel compiles, cuBLAS/SDPA setup),
    then every (C, h) point --repeats times, each printed; the runs, tagged `config`."""
    page = model.s["page"]
    warm = max(1, min(max_pages // 2, 64))
    prefill(model, warm * page * 2, warm * page, restore_fn(lw, model, keys, warm), lw.counter)
    runs = []
    for c, h in grid:
        for rep in range(args.repeats):
            r = dict(config=config, repeat=rep, **run_point(lw, trace, model, keys, c, h, prefix_kv))
            runs.append(r)
            print_run(label, r)
    return runs


def bench_tiered(args, model, name, dirs, cap_gb, keys, grid, max_pages, prefix_kv) -> dict:
    """The linker with its DRAM tier (tutti_host_gb) over the store the arms wrote: the prefix
    read twice from the SSD (the second read copies it up: hosttier.py's 2Q), then every point
    restored from DRAM. Its runs are `tutti-tiered:<medium>`."""
    trace = Trace()
    lw = make_tutti(model, dirs, cap_gb, args.read_ahead[-1], trace, host_gb=args.host_gb)
    out = {"tiered_runs": []}
    try:
        if lw.host is None or not lw.host.online.wait(300):
            return {"tiered_error": "the DRAM tier did not come up"}
        for _ in range(2):
            io_only(lw, model, keys, max_pages)
            lw.drain_loads()
        out["tiered_resident_pages"] = lw.host.stats()["host_resident_pages"]
        print(f"[{name}] DRAM tier: {out['tiered_resident_pages']} of {max_pages} pages resident",
              flush=True)
        out["tiered_runs"] = run_grid(args, lw, trace, model, keys, grid, max_pages, prefix_kv,
                                      f"tutti-tiered:{name}", name + " tiered")
        out["tiered_stats"] = {k: v for k, v in lw.stats()["linker"].items() if k.startswith(("host", "load"))}
    finally:
        lw.close()
    out["tiered_arms"] = arm_medians(out["tiered_runs"])
    return out


def print_run(name: str, r: dict) -> None:
    t, nan = r["trace"], float("nan")
    print(f"[{name}] C={r['C']} h={r['h']} read-ahead {r['read_ahead']}: TTFT {r['ttft_s']:.3f}s "
          f"bubble {r['bubble_s']:.3f}s io-only {r['io_only_s']:.3f}s ({r['restore_GBps']:.2f} GB/s, "
          f"{r['enter_calls']} enters, {r['cpu_s']:.3f} CPU s/restore); reads done at "
          f"{t.get('reads_ms', nan):.1f} ms, each layer handed over {t.get('react_ms_p50', nan):.2f} ms "
          f"after its reads (p50), the last at {t.get('handed_ms', nan):.1f} ms, "
          f"{t.get('beyond_reads_ms', nan):.1f} ms beyond the reads", flush=True)


def arm_medians(runs: list) -> list:
    """Per (C, h, read-ahead): the medians over the repeats of TTFT, bubble, I/O-only time and
    the load's own times (load_trace)."""
    import statistics
    arms: dict = {}
    for r in runs:
        arms.setdefault((r["C"], r["h"], r["read_ahead"]), []).append(r)
    out = []
    for (c, h, ra), rs in arms.items():
        row = dict(C=c, h=h, read_ahead=ra, n=len(rs))
        for key in ("ttft_s", "bubble_s", "io_only_s", "restore_GBps"):
            row[key] = statistics.median(r[key] for r in rs)
        for key in ("reads_ms", "react_ms_p50", "handed_ms", "beyond_reads_ms"):
            vals = [r["trace"][key] for r in rs if key in r["trace"]]
            row[key] = statistics.median(vals) if vals else None
        out.append(row)
    return out


def offload_stream(lw: LayerwiseKV, model, keys: list, c: int, pages: int, limit: int,
                   dirs: list) -> dict:
    """TTFT at (C, h=0.9) with a continuous offload stream: scheduler off; on without write windows;
    on with the windows learned online (alternating, same process and media); and the stream's
    write rate with no prefill running, beside the raw O_DIRECT write of as many bytes on the same
    directories right after (fallocated and overwritten; the stream's pages mostly reuse evicted
    slots, so overwrite is its extent state). The online windows start from nothing (no slack
    table): they learn from the forwards of the points above."""
    from tutti_hicache.benchmarks.rawio import raw_write_dirs
    page = model.s["page"]
    page_bytes = lw.store.layout.geometry.page_nbytes
    stream = OffloadStream(lw, model, limit)
    restore = restore_fn(lw, model, keys, pages)
    alone = [prefill(model, c, pages * page, restore, lw.counter) for _ in range(2)]
    modes = [("off", False, "off"), ("on", True, "off"), ("online", True, "online")]
    runs = []
    for name, enabled, windows in modes * 2:
        lw.drain_loads()  # the last restore has released its read hold before the switch
        lw.store.gate.enabled, lw.windows.mode = enabled, windows
        opened = lw.windows_opened
        (ttft, bub), written, secs = stream.during(lambda: prefill(model, c, pages * page, restore, lw.counter))
        runs.append(dict(mode=name, scheduler=enabled, windows=windows, ttft_s=ttft, bubble_s=bub,
                         written_pages=written, write_GBps=written * page_bytes / secs / 1e9,
                         windows_opened=lw.windows_opened - opened))
        print(f"  {name:6s}: TTFT {ttft:.3f}s, {written} pages written in {secs:.1f}s, "
              f"{runs[-1]['windows_opened']} windows", flush=True)
    lw.store.gate.enabled, lw.windows.mode = True, "online"
    lw.drain_loads()
    _, idle_pages, idle_s = stream.during(lambda: time.sleep(1.0))
    out = {"C": c, "h": 0.9, "ttft_alone_s": min(t for t, _ in alone), "runs": runs,
           "refused_offloads": stream.refused, "idle_write_GBps": idle_pages * page_bytes / idle_s / 1e9,
           "windows": lw.windows.snapshot()}
    out.update(raw_write_dirs(dirs, max(idle_pages * page_bytes, 1 << 30)))
    for state in ("prealloc", "overwrite"):
        out[f"idle_pct_of_raw_{state}"] = 100 * out["idle_write_GBps"] / out[f"raw_{state}_GBps"]
    for name, _, _ in modes:
        sel = [r for r in runs if r["mode"] == name]
        out[f"ttft_{name}_s"] = min(r["ttft_s"] for r in sel)
        out[f"vs_alone_{name}"] = out[f"ttft_{name}_s"] / out["ttft_alone_s"]
        out[f"write_GBps_{name}"] = sum(r["write_GBps"] for r in sel) / len(sel)
    print(f"  offload stream C={c} h=0.9: alone {out['ttft_alone_s']:.3f}s; " + ", ".join(
        f"{n} {out[f'ttft_{n}_s']:.3f}s ({out[f'vs_alone_{n}']:.2f}x, {out[f'write_GBps_{n}']:.2f} GB/s)"
        for n, _, _ in modes) + f"; no prefill {out['idle_write_GBps']:.2f} GB/s (raw O_DIRECT write "
        f"{out['raw_prealloc_GBps']:.2f} fallocated, {out['raw_overwrite_GBps']:.2f} overwrite: "
        f"{out['idle_pct_of_raw_prealloc']:.0f}% / {out['idle_pct_of_raw_overwrite']:.0f}%); "
        f"windows {out['windows']}",
        flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medium", action="append", default=[], help="NAME=dir[,dir...] (repeatable)")
    ap.add_argument("--contexts", default="16384,32768,65536")
    ap.add_argument("--hits", default="0.5,0.75,0.9,0.95,0.99")
    ap.add_argument("--crossover-context", type=int, default=0, help="search h finely at this C")
    ap.add_argument("--baselines", action="store_true", help="also recompute / compute-only / dram")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--threads", type=int, default=16, help="tutti_threads (checksum workers)")
    ap.add_argument("--read-ahead", type=lambda v: [int(x) for x in v.split(",")],
                    default=[TuttiConfig().read_ahead],
                    help="tutti_read_ahead; a list (e.g. 1,3) measures every point with each")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every arm at every point; the JSON's arms hold the medians")
    ap.add_argument("--offload-stream", type=int, default=0, metavar="PAGES",
                    help="also TTFT at the largest C, h=0.9 with a continuous offload stream (at most PAGES "
                         "pages per request): scheduler off, on, on with online write windows")
    ap.add_argument("--host-gb", type=float, default=0,
                    help="also every point through the linker's DRAM tier of this many GiB "
                         "(tutti-tiered: the prefix copied up after two SSD reads, then restored "
                         "from DRAM), beside --baselines' dram")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    global ENGINE, VERIFY, STAGE_DEPTH, THREADS
    ENGINE, VERIFY, THREADS = args.engine, not args.no_verify, args.threads
    STAGE_DEPTH = max(TuttiConfig().stage_depth, max(args.read_ahead) + 1)
    if args.dry_run and not args.medium:
        args.medium = [f"tmp={tempfile.mkdtemp(prefix='tutti-prefill-')}"]
    res = run(args)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
