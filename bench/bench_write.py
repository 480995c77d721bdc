"""Writes beside the raw medium: tutti's host-tier and linker writes against raw O_DIRECT writes of
the same bytes on the same medium, in one run, into fresh (fallocated) space and as overwrites.

    python bench/bench_write.py --medium ram=DIR[,DIR...] [--medium disk=DIR] --depths auto,32,1024
        --geometry llama3-8b --pages 128 --json out.json

Per medium (several comma-separated directories = an array, one store directory each):
  raw        O_DIRECT pwritev of 8 MiB requests, 8 writers per directory, distinct source memory:
             a pass into posix_fallocate'd space (unwritten extents, as a new segment is), then a
             pass over the same written space; measured before and after the tutti phases (the
             ratios use their mean: the medium drifts on a shared machine).
  host       SGLang's real _page_backup -> TuttiStorage.batch_set_v1 of `pages` pages (128-page
             batches) into a store of exactly `pages` slots: the first keys land in fresh
             segments ("prealloc"), a second set of keys evicts every slot ("overwrite":
             tombstone, payload, header over written space); then a verified restore
             (_page_transfer), compared byte for byte.
  linker     LayerwiseKV.offload of the same number of pages from per-layer KV tensors (CPU
             tensors here, the torch reference gather; CUDA tensors on a GPU), prealloc then
             overwrite as above.
  Each tutti phase runs at every --depths value ("auto": derived from the device queues,
  tutti_hicache/iodepth.py; N: tutti_queue_depth=N; "window": depth 1024 with the earlier
  one-window write chunks, the ablation of full-queue chunks).
Per-stage timers (wall seconds on the writer thread, from wrappers installed on this run's
objects only): reserve, grow, checksum (beside the payload writes, on a helper thread), tombstones,
payload, headers, gate_wait, index; linker: gather and d2h_and_staging (on the staging thread,
beside the previous chunk's writes).
Writes JSON (--json) and prints a table. No assertion on any time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from tutti_hicache import iodepth
from tutti_hicache.benchmarks.rawio import raw_write_dirs
from tutti_hicache.benchmarks.store import GEOMETRIES, fast_fill, make_pool, pages_equal
from tutti_hicache.config import TuttiConfig
from tutti_hicache.layout import PageGeometry, SlotLayout
from tutti_hicache.testing import sglang as H


from tutti_hicache.testing import controller as HC
class Stages:
    """Wall seconds per stage, from wrappers set on object attributes (undone by restore())."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._undo: list = []

    def wrap(self, obj, attr: str, name: str) -> None:
        orig = getattr(obj, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        own = attr in vars(obj)  # a module's function or an instance's own attribute
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, own, orig))

    def store(self, store) -> None:
        w, io = store._writes, store._io
        # write_pages = begin (reserve, tombstones) + land (payloads) + publish (headers,
        # index); the linker calls the steps itself: one begin and one publish per offload
        for obj, attr, name in ((w, "write_pages", "write_pages"), (w, "_reserve", "reserve"),
                                (store._rows, "claim_next", "grow"), (w, "begin", "begin"),
                                (w, "land", "land"),
                                (w, "publish", "publish"), (io, "headers", "io_headers"),
                                (io, "checksums", "checksum"),
                                (io, "tombstones", "tombstones"), (io, "write_payloads", "payload"),
                                (io, "write_headers", "headers"), (io, "sync", "sync"),
                                (io, "_gated", "gated"),
                                (store.gate, "_wait_chunk", "gate_wait")):
            self.wrap(obj, attr, name)

    def take(self) -> dict:
        s = dict(self.seconds)
        if "publish" in s:
            s["index"] = s.pop("publish") - s.get("io_headers", 0.0)  # under the index lock
        s.pop("io_headers", None)
        self.seconds.clear()
        return s

    def restore(self) -> None:
        for obj, attr, own, orig in reversed(self._undo):
            if own:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)  # the class's method shows through again
        self._undo.clear()


EXTRA: dict = {}  # --set tutti_KEY=VALUE, for every store of the run


def depth_settings(depth: str) -> dict:
    q = {"auto": 0, "window": 1024}.get(depth)
    return {"tutti_queue_depth": int(depth) if q is None else q, **EXTRA}


def set_chunks(store, depth: str) -> None:
    """depth "window": the earlier write chunks (one default window of bandwidth, one page at
    least; no idle_chunk) at queue depth 1024, the ablation of the full-queue chunks."""
    if depth == "window":
        store.gate.policy.idle_chunk = 0


def capacity_gb(geometry: PageGeometry, pages: int) -> float:
    slot = SlotLayout(geometry).slot_nbytes
    return (pages * slot + slot // 2) / (1 << 30)  # exactly `pages` slots


# ------------------------------------------------------------------------------ host tier
def host_tier(dirs, pool, hm, pages: int, depth: str, threads: int, seed: int) -> dict:
    from tutti_hicache.storage import TuttiStorage
    p = pool.page_size
    nbytes = pages * hm.geometry.page_nbytes
    stores = [os.path.join(d, f"host-{depth}") for d in dirs]
    extra = {"tutti_dirs": stores, "tutti_capacity_gb": capacity_gb(hm.geometry, pages),
             "tutti_threads": threads, **depth_settings(depth)}
    sc = H.make_storage_config(is_mla=False, is_page_first_layout=False,
                               model_name="bench-write", extra_config=extra)
    st = TuttiStorage(sc, {})
    ctrl = HC.make_controller(st, pool, p, sc, zero_copy=True)
    set_chunks(st.store, depth)
    stages = Stages()
    stages.store(st.store)
    src, dst = pool.alloc(pages * p), pool.alloc(pages * p)
    out: dict = {}
    try:
        for phase, s in (("prealloc", seed), ("overwrite", seed + 1)):
            keys = H.make_page_keys(pages, s)
            t0 = time.perf_counter()
            written = HC.controller_backup(ctrl, keys, src)
            wall = time.perf_counter() - t0
            out[phase] = {"GBps": nbytes / wall / 1e9, "seconds": wall, "pages": written,
                          "stages": stages.take()}
        out["evictions"] = st.store.stats()["evictions"]
        t0 = time.perf_counter()
        done = HC.controller_transfer(ctrl, keys, dst)
        wall = time.perf_counter() - t0
        out["read"] = {"GBps": nbytes / wall / 1e9, "seconds": wall,
                       "bytes_equal": done == pages * p and pages_equal(pool, src, dst)}
    finally:
        stages.restore()
        st.close()
        pool.free(src)
        pool.free(dst)
        for d in stores:
            shutil.rmtree(d, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------- linker
def make_kv(geometry: str, pages: int, device: str):
    _, layers, heads, dim, page, dtype = GEOMETRIES[geometry]
    rows = (pages + 1) * page
    g = torch.Generator().manual_seed(3)
    mk = lambda: torch.randn(rows, heads, dim, generator=g).to(getattr(torch, dtype)).to(device)
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


def linker(dirs, kv, geometry: str, pages: int, depth: str, threads: int, seed: int,
           writers: int = 0) -> dict:
    """The linker's offload of `pages` pages (prealloc, then overwrite); writers > 0 sets
    tutti_offload_writers (the chunk writes in flight) for this arm only."""
    import tutti_kernels as tk
    from tutti_hicache.layerwise import LayerwiseKV
    _, layers, heads, dim, page, dtype = GEOMETRIES[geometry]
    tb = heads * dim * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    g = PageGeometry("mha", layers, page, tb, tb)
    stores = [os.path.join(d, f"linker-{depth}") for d in dirs]
    cfg = TuttiConfig.from_sources({"tutti_dirs": stores, "tutti_threads": threads, "tutti_host_gb": 0,
                                    "tutti_capacity_gb": capacity_gb(g, pages),
                                    "tutti_stage_depth": 2, **depth_settings(depth),
                                    **({"tutti_offload_writers": writers} if writers else {})},
                                   env={})
    k, v = kv
    lw = LayerwiseKV(cfg, g, {"bench": "write"}, k, v, page)
    set_chunks(lw.store, depth)
    stages = Stages()
    stages.store(lw.store)
    stages.wrap(tk, "gather_pages_ref", "gather")  # CPU: the torch reference gather
    stages.wrap(lw._offloader, "gather", "gather")  # CUDA: the Triton gather (launch)
    stages.wrap(lw._offloader, "_gather_chunk", "stage")  # gather + D2H, beside the writes
    rows = torch.arange(page, page * (pages + 1), device=k[0].device)
    nbytes = pages * g.page_nbytes
    out: dict = {}
    try:
        for phase, s in (("prealloc", seed + 10), ("overwrite", seed + 11)):
            keys = H.make_page_keys(pages, s)
            t0 = time.perf_counter()
            assert lw.offload(keys, rows, []), "offload refused"
            while lw.num_completed() < 1:
                time.sleep(0.002)
            ok = lw.pop_completed()
            wall = time.perf_counter() - t0
            st = stages.take()
            st["d2h_and_staging"] = st.pop("stage", 0.0) - st.get("gather", 0.0)
            out[phase] = {"GBps": nbytes / wall / 1e9, "seconds": wall, "ok": bool(ok),
                          "stages": st}
    finally:
        stages.restore()
        lw.close()
        for d in stores:
            shutil.rmtree(d, ignore_errors=True)
    return out


# ------------------------------------------------------------------------ raw, tutti's engine
def raw_engine(dirs, nbytes: int, depth: str, req: int = 8 << 20, batch: int = 128) -> dict:
    """The raw writes of raw_write_dirs through tutti's engine at this depth (no store): batches
    of `batch` requests of `req` bytes, files striped as the store's slots are."""
    from tutti_hicache.benchmarks.rawio import _source
    from tutti_hicache.engine import inflight_for, open_engine
    cfg = TuttiConfig.from_sources({"tutti_dirs": list(dirs), "tutti_host_gb": 0, **depth_settings(depth)},
                                   env={})
    q, rd, wr = inflight_for(cfg)
    eng = open_engine(cfg.engine, q, cfg.threads, rd, wr)
    per = max(req, nbytes // len(dirs) // req * req)
    paths = [os.path.join(d, "raw-engine.bin") for d in dirs]
    src = _source(per * len(dirs))
    base = np.frombuffer(src, dtype=np.uint8).ctypes.data
    out = {}
    try:
        for p in paths:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(fd, 0, per)
            os.close(fd)
        files = np.array([eng.open_file(p, True, True) for p in paths], dtype=np.int64)
        n = per // req * len(dirs)
        f = files[np.arange(n) % len(dirs)]
        off = (np.arange(n) // len(dirs)) * req
        addrs = (base + (np.arange(n) * req) % (len(src) // req * req)).astype(np.uint64)
        for phase in ("prealloc", "overwrite"):
            t0 = time.perf_counter()
            for b0 in range(0, n, batch):
                sl = slice(b0, b0 + batch)
                res = eng.submit("write", f[sl], off[sl], np.full(len(f[sl]), req, np.int64), addrs[sl])
                assert (res == req).all(), f"raw engine write failed: {res[res != req][:4]}"
            out[f"{phase}_GBps"] = n * req / (time.perf_counter() - t0) / 1e9
    finally:
        eng.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return out


# ---------------------------------------------------------------------------------- driver
def run_medium(name: str, dirs: list, a) -> dict:
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    work = [tempfile.mkdtemp(prefix="tutti-bench-write-", dir=d) for d in dirs]
    try:
        pool = make_pool(a.geometry, "layer_first", 2 * a.pages + 1)
        fast_fill(pool, a.seed)
        from tutti_hicache.hostmap import HostMap
        hm = HostMap.from_pool(pool)
        nbytes = a.pages * hm.geometry.page_nbytes
        depth = iodepth.derive(work)
        res = {"medium": name, "dirs": dirs, "geometry": a.geometry, "pages": a.pages,
               "bytes": nbytes, "cores": depth.cores,
               "auto": {"read_bytes": depth.read_bytes, "write_bytes": depth.write_bytes,
                        "reason": depth.reason, **depth.detail,
                        "devices": [q and {"name": q.name, "nr_requests": q.nr_requests,
                                           "request_bytes": q.request_bytes}
                                    for q in depth.devices]}}
        raws = [raw_write_dirs(work, nbytes)]
        kv = make_kv(a.geometry, a.pages, a.device) if a.linker else None
        res["runs"] = []
        for d in a.depths:
            r = {"depth": d, "raw_engine": raw_engine(work, nbytes, d),
                 "host": host_tier(work, pool, hm, a.pages, d, a.threads, a.seed)}
            if kv is not None:  # one linker arm per --writers value, side by side (the first is "linker")
                arms = {w: linker(work, kv, a.geometry, a.pages, d, a.threads, a.seed, w)
                        for w in a.writers}
                r["linker"] = arms[a.writers[0]]
                if len(arms) > 1:
                    r["linker_writers"] = arms
            res["runs"].append(r)
            print(f"  {name} depth {d}: host {r['host']['prealloc']['GBps']:.2f} / "
                  f"{r['host']['overwrite']['GBps']:.2f} GB/s", file=sys.stderr)
        raws.append(raw_write_dirs(work, nbytes))
        res["raw_runs"] = raws
        res["raw_prealloc_GBps"] = float(np.mean([r["raw_prealloc_GBps"] for r in raws]))
        res["raw_overwrite_GBps"] = float(np.mean([r["raw_overwrite_GBps"] for r in raws]))
        for r in res["runs"]:
            for part in [r.get("host"), *(r.get("linker_writers") or {"": r.get("linker")}).values()]:
                for ph in ("prealloc", "overwrite"):
                    if part:
                        part[ph]["pct_of_raw"] = 100 * part[ph]["GBps"] / res[f"raw_{ph}_GBps"]
        return res
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)


def table(results: list) -> str:
    lines = []
    for r in results:
        lines.append(f"== {r['medium']} ({', '.join(r['dirs'])}), {r['geometry']} x {r['pages']} "
                     f"pages = {r['bytes'] / 2**30:.2f} GiB, {r['cores']} cores")
        lines.append(f"raw O_DIRECT write GB/s: prealloc {r['raw_prealloc_GBps']:.2f}, overwrite "
                     f"{r['raw_overwrite_GBps']:.2f}  (runs: " + ", ".join(
                         f"{x['raw_prealloc_GBps']:.2f}/{x['raw_overwrite_GBps']:.2f}"
                         for x in r["raw_runs"]) + ")")
        lines.append(f"auto in flight: {r['auto']['write_bytes'] >> 20} MiB ({r['auto']['reason']})")
        hdr = ["depth", "engine pre / over", "host pre GB/s", "% raw", "host over GB/s", "% raw", "restore GB/s",
               "linker pre GB/s", "% raw", "linker over GB/s", "% raw"]
        rows = []
        for x in r["runs"]:
            h, lk = x["host"], x.get("linker")
            e = x["raw_engine"]
            row = [x["depth"], f"{e['prealloc_GBps']:.2f} / {e['overwrite_GBps']:.2f}", h["prealloc"]["GBps"], h["prealloc"]["pct_of_raw"],
                   h["overwrite"]["GBps"], h["overwrite"]["pct_of_raw"], h["read"]["GBps"]]
            row += ([lk["prealloc"]["GBps"], lk["prealloc"]["pct_of_raw"], lk["overwrite"]["GBps"],
                     lk["overwrite"]["pct_of_raw"]] if lk else ["-"] * 4)
            rows.append([f"{c:.2f}" if isinstance(c, float) else str(c) for c in row])
        w = [max(len(hdr[i]), *(len(rw[i]) for rw in rows)) for i in range(len(hdr))]
        lines.append("  ".join(h.rjust(w[i]) for i, h in enumerate(hdr)))
        lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(rw)) for rw in rows]
        for x in r["runs"]:
            for w, lk in (x.get("linker_writers") or {}).items():
                lines.append(f"  depth {x['depth']} linker, tutti_offload_writers={w}: prealloc "
                             f"{lk['prealloc']['GBps']:.2f} GB/s ({lk['prealloc']['pct_of_raw']:.0f}%), "
                             f"overwrite {lk['overwrite']['GBps']:.2f} ({lk['overwrite']['pct_of_raw']:.0f}%)")
            for path in ("host", "linker"):
                for ph in ("prealloc", "overwrite"):
                    if path in x:
                        p = x[path][ph]
                        st = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(
                            p["stages"].items(), key=lambda kv: -kv[1]) if k != "write_pages")
                        lines.append(f"  stages ms, depth {x['depth']} {path} {ph} (wall "
                                     f"{p['seconds'] * 1e3:.0f}, write_pages "
                                     f"{p['stages'].get('write_pages', 0) * 1e3:.0f}): {st}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medium", action="append", required=True, help="NAME=DIR[,DIR...] (repeatable)")
    ap.add_argument("--geometry", default="llama3-8b", choices=[g for g, v in GEOMETRIES.items() if v[0] == "mha"])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--depths", default="auto,32,1024", help="auto and/or tutti_queue_depth values")
    ap.add_argument("--threads", type=int, default=8, help="tutti_threads")
    ap.add_argument("--no-linker", dest="linker", action="store_false")
    ap.add_argument("--writers", default="0",
                    help="tutti_offload_writers of the linker arms, comma-separated (0: the default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="tutti_KEY=VALUE",
                    help="a tutti setting for every store of the run (repeatable)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    EXTRA.update(kv.split("=", 1) for kv in a.set)
    a.depths = a.depths.split(",")
    a.writers = [int(w) for w in a.writers.split(",")]
    H.ensure_sglang()
    results = []
    for m in a.medium:
        name, _, dirs = m.rpartition("=")
        results.append(run_medium(name or dirs, [d for d in dirs.split(",") if d], a))
    with open(a.json, "w") as f:
        json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
