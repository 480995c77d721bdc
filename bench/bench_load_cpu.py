"""One layer-wise load's edges on the CPU, no forward: when layer 0 is handed over (the fill
before which nothing computes) and how long `finish` returns after the last chunk landed (the
last layer's copy), and each layer's hand-over after its last read (the loader's reaction),
for tutti settings side by side in one run (A/B variants).

The pool is a CPU tensor, so a chunk's "copy" is the loader's host scatter (a memcpy), where
the GPU machine runs an H2D copy and a scatter kernel: the times are this machine's, the
ratios between variants show the mechanism, not the GPU's figures. With --busy, a Python thread
spins beside the load as SGLang's scheduler thread launching a forward does (the GIL). With
--calls, the loader's steps are timed too (wall time inside each, per load).

  python bench/bench_load_cpu.py --dir /dev/shm/tl --pages 506 --layers 32 \
      --variants "tutti_edge_chunks=1;tutti_edge_chunks=4" --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time

import torch

from tutti_hicache.benchmarks.e2e import tutti_settings
from tutti_hicache.config import TuttiConfig
from tutti_hicache.layerwise import LayerwiseKV
from tutti_hicache.layout import PageGeometry

PAGE, KV_HEADS, HEAD_DIM = 64, 8, 128  # Llama-3-8B's KV shape, bf16


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


# --calls: the loader's steps timed per load (wall time inside each, summed): where a load's
# setup and hand-overs spend their time, e.g. under --busy
CALLS = {"plan": ("tutti_hicache.layer_reads", "LayerReads", "plan"),
         "destinations": ("tutti_hicache.layerwise.loader", "Loader", "_destinations"),
         "requests": ("tutti_hicache.layer_reads", "LayerReads", "_requests"),
         "stream.allow": ("tutti_hicache.layer_reads", "LayerStream", "allow"),
         "stream.wait": ("tutti_hicache.layer_reads", "LayerStream", "wait_whole", "wait"),
         "copy_chunk": ("tutti_hicache.layerwise.loader", "Loader", "_copy_chunk"),
         "counter.complete": ("tutti_hicache.layerwise.counter", "LayerCounter", "complete")}


def time_calls() -> dict:
    """Wrap CALLS with timers (the first of a step's method names the code has); returns
    {name: [seconds, calls]}, filled as loads run."""
    import functools
    import importlib
    totals = {}
    for name, (mod, cls, *meths) in CALLS.items():
        owner = getattr(importlib.import_module(mod), cls)
        meth = next((m for m in meths if hasattr(owner, m)), None)
        if meth is None:  # an older loader without that step
            continue
        f, acc = getattr(owner, meth), totals.setdefault(name, [0.0, 0])

        @functools.wraps(f)
        def timed(*a, _f=f, _acc=acc, **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                _acc[0] += time.perf_counter() - t
                _acc[1] += 1
        setattr(owner, meth, timed)
    return totals


def run_variant(args, over: dict, k: list, v: list) -> list:
    root = os.path.join(args.dir, "store")
    shutil.rmtree(root, ignore_errors=True)
    geom = PageGeometry("mha", args.layers, PAGE, KV_HEADS * HEAD_DIM * 2, KV_HEADS * HEAD_DIM * 2)
    dirs = [os.path.join(root, f"d{i}") for i in range(args.dirs)]
    tl = os.path.join(args.dir, "timeline.jsonl")
    if os.path.exists(tl):
        os.remove(tl)
    need_gb = args.pages * geom.page_nbytes / 1e9
    cfg = TuttiConfig.from_sources({"tutti_dirs": dirs, "tutti_capacity_gb": need_gb * 1.3 + 0.5,
                                    "tutti_timeline_file": tl, **over}, env={})
    lw = LayerwiseKV(cfg, geom, {"t": "bench-load-cpu"}, k, v, PAGE)
    keys = [f"p{i:063d}" for i in range(args.pages)]
    ids = torch.arange(PAGE, PAGE * (args.pages + 1))
    try:
        assert lw.offload(keys, ids, [])
        while lw.num_completed() < 1:
            time.sleep(0.01)
        if not lw.pop_completed():
            raise SystemExit("the offload failed")
        stop = threading.Event()
        if args.busy:
            threading.Thread(target=spin, args=(stop,), daemon=True).start()
        try:
            for rep in range(args.repeats):
                n = lw.lookup(keys)
                assert n == args.pages and lw.load(f"r{rep}", keys, ids)
                idx = lw.start()
                lw.counter.set_consumer(idx)
                for layer in range(args.layers):
                    lw.counter.wait_until(layer)
                if not lw.finish(idx):
                    raise SystemExit("a load failed")
        finally:
            stop.set()
    finally:
        lw.close()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    with open(tl) as f:
        recs = [json.loads(line) for line in f]
    for r in recs:
        if "start_ns" not in r:
            continue
        t0, done = r["start_ns"], r["chunk_done_ns"]
        last = {}  # layer -> its last chunk's read final
        for layer, d in zip(r["chunk_layers"], done):
            last[layer] = max(last.get(layer, 0), d)
        react = [(r["complete_ns"][layer] - d) / 1e6 for layer, d in last.items()]
        rows.append({"opened_ms": (r["opened_ns"] - t0) / 1e6,
                     "first_chunk_ms": (min(done) - t0) / 1e6,
                     "layer0_handed_ms": (r["complete_ns"][0] - t0) / 1e6,
                     "reads_ms": (max(done) - t0) / 1e6,
                     "tail_ms": (r["finish_ns"][1] - max(done)) / 1e6,
                     "finish_ms": (r["finish_ns"][1] - t0) / 1e6,
                     "react_ms_p50": statistics.median(react), "react_ms_max": max(react),
                     "chunks": len(done)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a scratch directory (the store is made under it)")
    ap.add_argument("--dirs", type=int, default=8, help="store directories under --dir")
    ap.add_argument("--pages", type=int, default=506)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="tutti_edge_chunks=1;tutti_edge_chunks=4",
                    help="';'-separated, each tutti_KEY=VALUE[+tutti_KEY=VALUE]")
    ap.add_argument("--busy", action="store_true", help="a spinning Python thread beside the loads")
    ap.add_argument("--calls", action="store_true", help="also time the loader's steps (per load)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    totals = time_calls() if args.calls else None
    rows_n = (args.pages + 1) * PAGE
    k = [torch.randn(rows_n, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(args.layers)]
    v = [torch.randn(rows_n, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(args.layers)]
    out = {"pages": args.pages, "layers": args.layers, "busy": args.busy, "dir": args.dir,
           "variants": []}
    for text in args.variants.split(";"):
        if totals is not None:
            for acc in totals.values():
                acc[0], acc[1] = 0.0, 0
        loads = run_variant(args, tutti_settings(text.split("+") if text else [], text), k, v)
        med = {key: statistics.median(r[key] for r in loads) for key in loads[0]}
        out["variants"].append({"variant": text, "loads": loads, "median": med})
        if totals is not None:
            out["variants"][-1]["calls_ms_per_load"] = {
                name: {"ms": acc[0] * 1e3 / len(loads), "calls": acc[1] / len(loads)}
                for name, acc in totals.items()}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    cols = ["opened_ms", "first_chunk_ms", "layer0_handed_ms", "reads_ms", "tail_ms", "finish_ms",
            "react_ms_p50", "react_ms_max", "chunks"]
    print("| variant | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for var in out["variants"]:
        print(f"| {var['variant']} | " + " | ".join(f"{var['median'][c]:.1f}" for c in cols) + " |")
    for var in out["variants"]:
        if "calls_ms_per_load" in var:
            print(f"{var['variant']}, per load: " + ", ".join(
                f"{name} {c['ms']:.1f} ms ({c['calls']:.0f} calls)" for name, c in var["calls_ms_per_load"].items()))


if __name__ == "__main__":
    main()
