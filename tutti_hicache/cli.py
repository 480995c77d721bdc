"""`tutti-hicache`: demo, bench store, inspect, fsck.

    tutti-hicache demo [--dir DIR] [--geometry small] [--pages 256]
    tutti-hicache bench store --medium DIR [--geometry llama3-8b] [--pages N] [--json OUT]
    tutti-hicache inspect DIR [DIR ...]
    tutti-hicache fsck DIR [DIR ...] [--repair]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

from . import __version__


def _bench_spec(a):
    from .bench_store import BenchSpec
    return BenchSpec(medium=a.medium, geometry=a.geometry, pages=a.pages, layout=a.layout,
                     engine=a.engine, io_mode=a.io_mode, queue_depth=a.queue_depth,
                     threads=a.threads, with_file=not a.no_file, keep=False, seed=a.seed,
                     pin_memory=a.pin)


def cmd_bench_store(a) -> int:
    from .bench_store import run, table
    res = run(_bench_spec(a))
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    ok = res["tutti_verified_bytes_equal"] and res["tutti_noverify_verified_bytes_equal"]
    return 0 if ok else 1


def cmd_demo(a) -> int:
    from .bench_store import run, table
    base = a.dir or tempfile.mkdtemp(prefix="tutti-demo-", dir=_default_demo_dir())
    a.medium = base
    print(f"tutti demo: {a.pages} pages of a '{a.geometry}' model under {base}\n"
          "  1. write the pages through TuttiStorage (SGLang's own _page_backup)\n"
          "  2. close the store, reopen it (index rebuilt from slot headers)\n"
          "  3. restore every page through SGLang's _page_transfer, compare every byte\n"
          "  4. the same with SGLang's built-in `file` backend, and a raw O_DIRECT read\n",
          flush=True)
    res = run(_bench_spec(a))
    print(table(res))
    good = res["tutti_verified_bytes_equal"] and res["tutti_noverify_verified_bytes_equal"]
    print("\nall restored bytes verified" if good else "\nRESTORED BYTES DIFFER")
    return 0 if good else 1


def _default_demo_dir() -> str:
    here = os.getcwd()
    return here if os.access(here, os.W_OK) else tempfile.gettempdir()


def _namespaces(dirs: list[str]) -> dict[str, list[str]]:
    """fingerprint dir name -> its namespace dirs ordered by placement.json's dir_index."""
    found: dict[str, dict[int, str]] = {}
    for d in dirs:
        for name in sorted(os.listdir(d)):
            ns = os.path.join(d, name)
            pj = os.path.join(ns, "placement.json")
            if name.startswith("tutti-") and os.path.exists(pj):
                with open(pj) as f:
                    found.setdefault(name, {})[json.load(f)["dir_index"]] = d
    return {k: [v[i] for i in sorted(v)] for k, v in found.items()}


def open_existing(dirs: list[str], ns_name: str, writer: bool):
    """Open a namespace found on disk with the geometry and capacity it was written with."""
    from .config import TuttiConfig
    from .layout import PageGeometry
    from .store import ObjectStore
    ns0 = os.path.join(dirs[0], ns_name)
    with open(os.path.join(ns0, "identity.json")) as f:
        ident = json.load(f)
    with open(os.path.join(ns0, "placement.json")) as f:
        place = json.load(f)
    if place["n_dirs"] != len(dirs):
        raise ValueError(f"{ns_name} is striped over {place['n_dirs']} directories; "
                         f"found {len(dirs)}: pass all of them")
    g = PageGeometry(ident["kind"], ident["layers"], ident["page_size"], ident["k_token_bytes"],
                     ident["v_token_bytes"], ident["order"])
    total = sum(os.path.getsize(os.path.join(d, ns_name, n)) for d in dirs
                for n in os.listdir(os.path.join(d, ns_name)) if n.endswith(".dat"))
    seg_gb = place["slots_per_segment"] * place["slot_nbytes"] / (1 << 30)
    cfg = TuttiConfig(dirs=tuple(dirs), capacity_gb=max(total, place["slot_nbytes"]) / (1 << 30),
                      segment_gb=seg_gb, rescan_interval_s=-1.0)
    return ObjectStore(cfg, g, ident, writer=writer), ident


def cmd_inspect(a) -> int:
    for name, dirs in _namespaces(a.dirs).items():
        store, ident = open_existing(dirs, name, writer=False)
        try:
            st = store.stats()
            print(f"{name}  ({', '.join(dirs)})")
            print(f"  identity: {json.dumps(ident, sort_keys=True)}")
            print(f"  slots: {st['capacity_slots']} x {st['slot_nbytes']} B = "
                  f"{st['capacity_slots'] * st['slot_nbytes'] / 2**30:.2f} GiB, pages: {st['pages']}")
            keys = sorted(store.index.entries)[: a.keys]
            for k in keys:
                e = store.index.entries[k]
                print(f"    {k}  slot {e.slot}  seq {e.seq}  xxh3 {e.checksum:016x}")
        finally:
            store.close()
    return 0


def cmd_fsck(a) -> int:
    bad = 0
    for name, dirs in _namespaces(a.dirs).items():
        store, _ = open_existing(dirs, name, writer=a.repair)
        try:
            r = store.check(repair=a.repair)
        finally:
            store.close()
        bad += r["bad"] + r["bad_headers"]
        print(f"{name}: {r['checked']} pages checked, {r['bad']} bad payloads"
              f"{' dropped' if a.repair and r['bad'] else ''}, {r['bad_headers']} unreadable headers")
        for k in r["bad_keys"]:
            print(f"  bad: {k}")
    return 1 if bad and not a.repair else 0


def _add_bench_args(p, pages: int, geometry: str) -> None:
    from .bench_store import GEOMETRIES
    p.add_argument("--geometry", default=geometry, choices=sorted(GEOMETRIES))
    p.add_argument("--pages", type=int, default=pages)
    p.add_argument("--layout", default="layer_first",
                   choices=["layer_first", "page_first", "page_first_direct"])
    p.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    p.add_argument("--io-mode", default="vectored", choices=["vectored", "fixed"])
    p.add_argument("--queue-depth", type=int, default=1024)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--no-file", action="store_true", help="skip SGLang's file backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin", action="store_true", help="pinned host pool (needs CUDA), as in a GPU server")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tutti-hicache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=__version__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="write, restart, restore and verify a long prefix")
    d.add_argument("--dir", help="where to put the store (default: a temp dir here)")
    _add_bench_args(d, 256, "small")
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    bs = b.add_parser("store", help="L3 -> host restore vs raw O_DIRECT vs SGLang file")
    bs.add_argument("--medium", required=True, help="directory on the medium to measure")
    bs.add_argument("--json", help="write the results here")
    _add_bench_args(bs, 256, "llama3-8b")
    bs.set_defaults(fn=cmd_bench_store)
    i = sub.add_parser("inspect", help="capacity, slots, keys, identities of a store")
    i.add_argument("dirs", nargs="+")
    i.add_argument("--keys", type=int, default=5, help="keys to list per namespace")
    i.set_defaults(fn=cmd_inspect)
    f = sub.add_parser("fsck", help="verify every slot; --repair drops bad ones")
    f.add_argument("dirs", nargs="+")
    f.add_argument("--repair", action="store_true")
    f.set_defaults(fn=cmd_fsck)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
