"""Read/write interference on a medium: reads alone, with a write backlog and the scheduler off
(free mixing), and with the scheduler on.

A reader restores batches of pages (ObjectStore.read_pages, verification on) arriving at random
(exponential gaps) at a rate that keeps the medium about `--read-load` busy when alone; a writer
keeps a backlog of new pages flowing (write_pages, eviction at full capacity). Per scenario:
read GB/s, p50/p99 read-batch latency, write GB/s.

  python bench/bench_interference.py --medium ram=/mnt/tutti-media/ram --seconds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry
from tutti_hicache.store import ObjectStore

GEOM = PageGeometry("mha", 8, 64, 8 * 128 * 2, 8 * 128 * 2)  # "small": 2 MiB pages


class Pages:
    def __init__(self, n: int, seed: int):
        m = len(GEOM.object_nbytes)
        obj = GEOM.object_nbytes[0]
        self.buf = extension().AlignedBuffer(n * m * obj)
        a = np.frombuffer(self.buf, dtype=np.uint8)
        a[:] = np.random.default_rng(seed).integers(1, 256, a.size, dtype=np.uint8)
        self.addrs = (self.buf.address + np.arange(n * m, dtype=np.uint64) * obj).reshape(n, m)


def open_store(dirs, read_pages: int, scheduler: bool, **settings) -> ObjectStore:
    cap = (read_pages + 256) * (GEOM.page_nbytes + 4096) / 2**30
    cfg = TuttiConfig.from_sources({"tutti_dirs": dirs, "tutti_capacity_gb": cap,
                                    "tutti_scheduler": scheduler, "tutti_threads": 8,
                                    **{f"tutti_{k}": v for k, v in settings.items() if v is not None}}, env={})
    return ObjectStore(cfg, GEOM, {"bench": "interference"})


def reader(store, keys, batch, dst, gap_s, stop, out):
    rng = np.random.default_rng(1)
    lat, nbytes, misses = [], 0, 0
    while not stop.is_set():
        time.sleep(rng.exponential(gap_s))
        i = rng.integers(0, len(keys) - batch)
        t0 = time.perf_counter()
        ok = store.read_pages(keys[i:i + batch], dst.addrs[:batch], True)
        lat.append(time.perf_counter() - t0)
        nbytes += int(ok.sum()) * GEOM.page_nbytes
        misses += int((~ok).sum())
    out.update(lat=lat, bytes=nbytes, misses=misses)


def writer(store, batch, src, stop, out):
    """A write backlog that never evicts the read set: each batch's keys are dropped again once
    written, so their slots are reused (tombstone, payload, header: real writes)."""
    n, k = 0, 0
    while not stop.is_set():
        keys = [f"w{k:012d}-{j:04d}".ljust(64, "0") for j in range(batch)]
        k += 1
        n += int(store.write_pages(keys, src.addrs[:batch], True).sum())
        store.forget(keys)
    out.update(bytes=n * GEOM.page_nbytes)


def scenario(store, keys, args, dst, src, with_writes: bool, gap_s: float) -> dict:
    stop, r, w = threading.Event(), {}, {}
    ts = [threading.Thread(target=reader, args=(store, keys, args.batch, dst, gap_s, stop, r))]
    if with_writes:
        ts.append(threading.Thread(target=writer, args=(store, args.batch, src, stop, w)))
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    lat = np.array(r["lat"]) * 1e3
    assert r["misses"] == 0, f"{r['misses']} read misses: the benchmark must not evict its read set"
    return {"read_GBps": r["bytes"] / dt / 1e9, "read_batches": len(lat),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "write_GBps": w.get("bytes", 0) / dt / 1e9}


def bench_medium(name: str, dirs: list, args) -> dict:
    store = open_store(dirs, args.pages, scheduler=True, write_window_ms=args.write_window_ms)
    src, dst = Pages(args.batch, 2), Pages(args.batch, 3)
    keys = [f"r{i:063d}" for i in range(args.pages)]
    fill = Pages(args.pages, 4)
    for i in range(0, args.pages, args.batch):
        store.write_pages(keys[i:i + args.batch], fill.addrs[i:i + args.batch], True)
    t0 = time.perf_counter()  # batch service time alone -> arrival gap for the target load
    for _ in range(8):
        store.read_pages(keys[: args.batch], dst.addrs, True)
    service = (time.perf_counter() - t0) / 8
    gap = service * (1 - args.read_load) / args.read_load
    res = {"dirs": dirs, "batch_service_ms": service * 1e3, "read_load": args.read_load}
    res["alone"] = scenario(store, keys, args, dst, src, False, gap)
    store.gate.enabled = False
    res["mixed_scheduler_off"] = scenario(store, keys, args, dst, src, True, gap)
    store.gate.enabled = True
    res["mixed_scheduler_on"] = scenario(store, keys, args, dst, src, True, gap)
    res["scheduler_stats"] = {k: v for k, v in store.stats().items() if k.startswith("sched_")}
    store.close()
    a = res["alone"]
    for k in ("mixed_scheduler_off", "mixed_scheduler_on"):
        res[k]["read_vs_alone"] = res[k]["read_GBps"] / a["read_GBps"]
        res[k]["p99_vs_alone"] = res[k]["p99_ms"] / a["p99_ms"]
    print(f"[{name}] batch {args.batch} pages, service {service * 1e3:.1f} ms, load {args.read_load:.0%}")
    for k in ("alone", "mixed_scheduler_off", "mixed_scheduler_on"):
        r = res[k]
        extra = "" if k == "alone" else f"  read {r['read_vs_alone']:.2f}x, p99 {r['p99_vs_alone']:.2f}x of alone"
        print(f"  {k:<20} read {r['read_GBps']:.2f} GB/s  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms"
              f"  write {r['write_GBps']:.2f} GB/s{extra}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medium", action="append", required=True, help="NAME=dir[,dir...]")
    ap.add_argument("--seconds", type=float, default=15.0, help="per scenario")
    ap.add_argument("--pages", type=int, default=512, help="read set (2 MiB pages)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--read-load", type=float, default=0.6, help="reader busy fraction when alone")
    ap.add_argument("--write-window-ms", type=float, help="tutti_write_window_ms (default: the setting's)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    out = {}
    for spec in args.medium:
        name, dirs = spec.split("=", 1)
        out[name] = bench_medium(name, dirs.split(","), args)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
