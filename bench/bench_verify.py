"""What verification costs a restore, by object size: the linker's loader (LayerwiseKV, its thread,
read stream and checksum pool) and the host tier's page read (ObjectStore.read_pages, what
TuttiStorage's get runs) restoring the same bytes with tutti_verify on and off,
for an MLA geometry (DeepSeek-V2-Lite's: 27 layers, one 72 KiB object per layer and page) and an
MHA one with the same page bytes in 648 KiB layer requests. Side by side in one process, arms
interleaved; the figure is each geometry's verify-on / verify-off ratio (absolute GB/s hold only
on the machine that made them). The scatter into the paged pool (a GPU kernel in a server) is left
out: what is timed is the read path from the store to the staging buffers, checksums included.

  python bench/bench_verify.py --dir /dev/shm/bv --pages 256 --reps 7 --json out.json

Pages are written by this process, so tutti_verify=false skips their checksums (a page another
process wrote is always verified); the verify-on store reads the same pages as a restart would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layerwise import LayerwiseKV
from tutti_hicache.layerwise import loader as loader_mod
from tutti_hicache.layout import PageGeometry, strided

# name: geometry, per-token K shape (heads, dim), V shape (None: MLA's one latent)
GEOMS = {
    "mla27": (PageGeometry("mla", 27, 64, 1152, 0), (1, 576), None),
    "mha3": (PageGeometry("mha", 3, 64, 5184, 5184), (81, 32), (81, 32)),
}


def make(root: str, name: str, pages: int, verify: bool, threads: int):
    geom, kshape, vshape = GEOMS[name]
    d = os.path.join(root, f"{name}-{'v' if verify else 'nv'}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    rows = (pages + 1) * geom.page_size
    g = torch.Generator().manual_seed(1)

    def pool(shape):
        return [torch.randint(-100, 100, (rows, *shape), generator=g, dtype=torch.int16).view(torch.bfloat16)
                for _ in range(geom.num_layers)]

    cap = (pages + 8) * geom.page_nbytes * 1.3 / 2**30 + 0.1
    cfg = TuttiConfig.from_sources({"tutti_dirs": [d], "tutti_capacity_gb": cap, "tutti_verify": verify,
                                    "tutti_host_gb": 0, "tutti_scheduler": False,
                                    "tutti_threads": threads}, env={})
    lw = LayerwiseKV(cfg, geom, {"t": name}, pool(kshape), None if vshape is None else pool(vshape),
                     geom.page_size)
    keys = [f"{name}-{i:058d}" for i in range(pages)]
    idx = torch.arange(geom.page_size, geom.page_size * (pages + 1))
    assert lw.offload(keys, idx, [])
    end = time.time() + 300
    while lw.num_completed() < 1 and time.time() < end:
        time.sleep(0.01)
    assert lw.pop_completed(), "the pages were not written"
    return lw, keys, idx, pages * geom.page_nbytes


def restore(lw, keys, idx) -> None:
    """One load as the forward drives it: load, start, wait for every layer, finish."""
    assert lw.load("r", keys, idx)
    i = lw.start()
    lw.counter.set_consumer(i)
    for layer in range(lw.num_layers):
        lw.counter.wait_until(layer)
    assert lw.finish(i), "the restore failed"
    lw.counter.set_consumer(-1)  # as a decode batch: the next load reads the store again
    lw.drain_loads()


def host_read(lw, keys, buf) -> None:
    """The host tier's read (TuttiStorage's get): whole pages into host memory, one group per
    checksum unit (a layer's objects), as SGLang's host pool receives them."""
    lay = lw.store.layout
    addrs = lay.staged_objects(strided(buf.address, len(keys), lay.payload_nbytes))
    assert lw.store.read_pages(keys, addrs, aligned=True).all(), "a host read failed"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm/bench-verify", help="the medium (O_DIRECT)")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=8, help="tutti_threads (the checksum pool)")
    ap.add_argument("--paths", default="linker,host", help="which restores: linker, host")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    scatter = loader_mod.Loader._scatter
    loader_mod.Loader._scatter = lambda self, staging, layer, page_ids: None  # a GPU kernel there
    try:
        run(a)
    finally:  # the class is the process's: a caller (a test) gets its scatter back
        loader_mod.Loader._scatter = scatter


def run(a) -> None:
    rigs = {(nm, v): make(a.dir, nm, a.pages, v, a.threads) for nm in GEOMS for v in (True, False)}
    host = extension().AlignedBuffer(max(lw.store.layout.payload_nbytes * len(keys)
                                         for lw, keys, _, _ in rigs.values()))
    paths = {"linker": lambda lw, keys, idx: restore(lw, keys, idx),
             "host": lambda lw, keys, idx: host_read(lw, keys, host)}
    paths = {p: paths[p] for p in a.paths.split(",")}
    gbps = {f"{path}/{nm}/{'on' if v else 'off'}": [] for path in paths for nm, v in rigs}
    for _ in range(a.reps):
        for path, fn in paths.items():
            for (nm, v), (lw, keys, idx, nbytes) in rigs.items():
                t0 = time.perf_counter()
                fn(lw, keys, idx)
                gbps[f"{path}/{nm}/{'on' if v else 'off'}"].append(nbytes / (time.perf_counter() - t0) / 1e9)
    med = {k: statistics.median(v) for k, v in gbps.items()}
    print(f"GB/s, median of {a.reps}; verify on / off")
    print("| path | geometry | verify on | verify off | on / off |\n| --- | --- | --- | --- | --- |")
    ratios = {}
    for path in paths:
        for nm in GEOMS:
            on, off = med[f"{path}/{nm}/on"], med[f"{path}/{nm}/off"]
            ratios[f"{path}/{nm}"] = on / off
            print(f"| {path} | {nm} | {on:.2f} | {off:.2f} | {on / off:.2f} |")
    for lw, *_ in rigs.values():
        lw.close()
    shutil.rmtree(a.dir, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"pages": a.pages, "reps": a.reps, "threads": a.threads, "GBps": gbps,
                       "median_GBps": med, "on_over_off": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
