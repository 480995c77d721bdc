"""Lookup latency while the store grows: does batch_exists wait behind segment growth?

One thread times store.prefix_len (what TuttiStorage.batch_exists and the linker's lookup call)
over keys that are present, every --interval-us; another writes new pages until the store is
full, so it creates, fallocates, flocks and scans every segment row on the way. Prints and
writes p50 / p99 / p99.9 / max of the lookup latency, with and without the writer, and how many
lookups took over 1 ms and over 10 ms (CPython hands the GIL over every 5 ms, so waits between
those two are the GIL; longer ones are a lock held over I/O, or a cyclic-GC pause).

  python bench/bench_lock.py --dir /var/tmp/tutti-lock --json lock.json

Uses only the store's public API, so the same script measures any version of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import threading
import time

import numpy as np

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry, SlotLayout
from tutti_hicache.store import ObjectStore

GEOM = PageGeometry("mha", 4, 16, 256, 256)  # 8 objects of 4 KiB: 36 KiB slots


def keys_of(n: int, tag: str) -> list[str]:
    return [f"{tag}{i:012d}".ljust(64, "0") for i in range(n)]


def pages(n: int):
    m = len(GEOM.object_nbytes)
    buf = extension().AlignedBuffer(n * m * 4096)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(0).integers(1, 255, n * m * 4096,
                                                                       dtype=np.uint8)
    return buf, (buf.address + np.arange(n * m, dtype=np.uint64) * 4096).reshape(n, m)


def lookups(store, keys, interval_s: float, stop: threading.Event) -> list[float]:
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        n = store.prefix_len(keys)
        lat.append(time.perf_counter() - t0)
        assert n == len(keys)
        time.sleep(interval_s)
    return lat


def summary(lat: list[float]) -> dict:
    us = np.array(lat) * 1e6
    return {"lookups": len(us), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "p999_us": float(np.percentile(us, 99.9)),
            "max_us": float(us.max()), "over_1ms": int((us > 1e3).sum()),
            "over_10ms": int((us > 1e4).sum())}


def run(a) -> dict:
    shutil.rmtree(a.dir, ignore_errors=True)
    cfg = TuttiConfig.from_sources({"tutti_dirs": [os.path.join(a.dir, f"d{i}") for i in range(a.dirs)],
                                    "tutti_capacity_gb": a.capacity_gb,
                                    "tutti_segment_gb": a.segment_gb, "tutti_engine": a.engine},
                                   env={})
    store = ObjectStore(cfg, GEOM, {"bench": "lock"})
    try:
        _, addrs = pages(a.batch)
        probe = keys_of(a.lookup_keys, "probe")
        assert store.write_pages(probe, addrs[:a.lookup_keys], True).all()
        stop, out = threading.Event(), {}
        t = threading.Thread(target=lambda: out.update(lat=lookups(store, probe, a.interval_us / 1e6, stop)))
        t.start()
        time.sleep(a.idle_s)  # the baseline: lookups with nothing else running
        stop.set()
        t.join()
        idle = out["lat"]
        capacity = store.capacity_slots
        stop.clear()
        t = threading.Thread(target=lambda: out.update(lat=lookups(store, probe, a.interval_us / 1e6, stop)))
        t.start()
        t0, written, batch = time.perf_counter(), 0, 0
        while written < capacity - a.lookup_keys:
            ok = store.write_pages(keys_of(a.batch, f"w{batch:06d}-"), addrs, True)
            written += int(ok.sum())
            batch += 1
        grow_s = time.perf_counter() - t0
        stop.set()
        t.join()
        st = store.stats()
        return {"idle": summary(idle), "growing": summary(out["lat"]),
                "grow_s": grow_s, "pages_written": written, "rows": st["owned_rows"],
                "capacity_slots": capacity, "slot_nbytes": SlotLayout(GEOM).slot_nbytes,
                "evictions": st["evictions"], "args": vars(a)}
    finally:
        store.close()
        shutil.rmtree(a.dir, ignore_errors=True)


def provenance() -> dict:
    """The commit of the tutti_hicache that was measured (empty outside a git checkout)."""
    import tutti_hicache
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(tutti_hicache.__file__)).stdout.strip()
    except OSError:
        commit = ""
    return {"commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"{platform.system()} {platform.release()}", "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="scratch directory on the medium (removed)")
    ap.add_argument("--dirs", type=int, default=1, help="store directories under --dir")
    ap.add_argument("--capacity-gb", type=float, default=2.0)
    ap.add_argument("--segment-gb", type=float, default=1 / 16, help="64 MiB: 32 rows to grow")
    ap.add_argument("--batch", type=int, default=128, help="pages per write (SGLang's batch)")
    ap.add_argument("--lookup-keys", type=int, default=64)
    ap.add_argument("--interval-us", type=float, default=200.0, help="pause between lookups")
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--note", default="", help="stored with the result (what was measured)")
    a = ap.parse_args(argv)
    res = {**run(a), **provenance(), "note": a.note}
    for phase in ("idle", "growing"):
        s = res[phase]
        print(f"{phase:>8}: {s['lookups']:6d} lookups  p50 {s['p50_us']:8.1f} us  p99 "
              f"{s['p99_us']:8.1f} us  p99.9 {s['p999_us']:8.1f} us  max {s['max_us']:8.1f} us  "
              f"> 1 ms: {s['over_1ms']}  > 10 ms: {s['over_10ms']}")
    print(f"grew {res['rows']} rows ({res['pages_written']} pages) in {res['grow_s']:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
