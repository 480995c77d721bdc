"""How long opening a full store takes (the index is rebuilt from every slot header).

A 1 TB store of Llama-3-8B pages (8 MiB + 4 KiB slots) holds 131072 slots; the rebuild reads one
4 KiB header per slot whatever the payload size, so this fills 131072 small slots (4 KiB objects)
and times ObjectStore() over them, on each given directory.

  python bench/bench_open.py --dir /var/tmp/tutti-open --slots 131072 --json out.json
"""

import argparse
import json
import os
import shutil
import time

import numpy as np

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry, SlotLayout
from tutti_hicache.store import ObjectStore

GEOM = PageGeometry("mla", 1, 16, 256, 0)  # one 4 KiB object: an 8 KiB slot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", action="append", required=True)
    ap.add_argument("--slots", type=int, default=131072)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    out = {}
    slot = SlotLayout(GEOM).slot_nbytes
    for d in a.dir:
        shutil.rmtree(d, ignore_errors=True)
        cfg = TuttiConfig.from_sources({"tutti_dirs": [d], "tutti_capacity_gb": a.slots * slot / 2**30,
                                        "tutti_segment_gb": 1.0}, env={})
        s = ObjectStore(cfg, GEOM, {"bench": "open"})
        buf = extension().AlignedBuffer(4096 * 4096)
        np.frombuffer(buf, np.uint8)[:] = 7
        addrs = (buf.address + np.arange(4096, dtype=np.uint64) * 4096).reshape(4096, 1)
        t0 = time.perf_counter()
        for i in range(0, a.slots, 4096):
            n = min(4096, a.slots - i)
            s.write_pages([f"{j:064x}" for j in range(i, i + n)], addrs[:n], True)
        fill = time.perf_counter() - t0
        s.close()
        os.sync()
        t0 = time.perf_counter()
        s = ObjectStore(cfg, GEOM, {"bench": "open"})
        open_s = time.perf_counter() - t0
        out[d] = {"slots": a.slots, "pages_found": len(s), "open_s": open_s, "fill_s": fill}
        print(f"{d}: {len(s)} of {a.slots} slots indexed in {open_s:.2f} s (filled in {fill:.1f} s)")
        s.close()
        shutil.rmtree(d, ignore_errors=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
