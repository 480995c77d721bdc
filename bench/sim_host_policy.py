#!/usr/bin/env python3
"""The linker's DRAM tier policy (hosttier.py's 2Q) on a Zipf trace, beside plain LRU and the
static best (the most popular documents that fit), by page hit rate. No I/O: the real HostTier
with 4 KiB pages on the CPU, driven as the linker drives it (offloads enter probation; a load
pins what is resident, and the pages it read from the SSD go through wants(), the wanted ones
promoted with reserve(hot=True) + publish). The trace is bench_serving's capacity phase in
miniature: --docs documents of --pages pages each offloaded once (the capwarm phase), then
--requests requests whose document follows Zipf(alpha), with the tier holding 1/--ratio of the
documents.

    python bench/sim_host_policy.py --alphas 0.8,1.0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from tutti_hicache.layerwise.hosttier import HostTier  # noqa: E402

PAGE_BYTES = 4096


def zipf_docs(n_docs: int, alpha: float, n: int, seed: int) -> np.ndarray:
    """n document indices, P(doc k) ~ 1 / (k + 1)^alpha (the first document is the hottest)."""
    p = 1.0 / np.arange(1, n_docs + 1) ** alpha
    return np.random.default_rng(seed).choice(n_docs, size=n, p=p / p.sum())


def keys_of(doc: int, pages: int) -> list:
    return [f"d{doc:05d}p{i:04d}".ljust(64, "0") for i in range(pages)]


def run_2q(docs: np.ndarray, n_docs: int, pages: int, slots: int) -> dict:
    tier = HostTier(slots * PAGE_BYTES, 1, 1, PAGE_BYTES, torch.device("cpu"), False)
    for d in range(n_docs):  # capwarm: each document offloaded once
        keys = keys_of(d, pages)
        tier.publish(keys, tier.reserve(keys, hot=False), True)
    hits = total = 0
    for d in docs.tolist():
        keys = keys_of(int(d), pages)
        slots_ = tier.pin(keys)
        here = slots_ >= 0
        hits += int(here.sum())
        total += len(keys)
        tier.unpin(slots_[here])
        read = [k for k, h in zip(keys, here.tolist()) if not h]
        want = [k for k, w in zip(read, tier.wants(read).tolist()) if w]
        if want:
            tier.publish(want, tier.reserve(want, hot=True), True)
    st = tier.stats()
    return {"hit_rate": hits / total, "promoted": st.get("host_inserted_pages", 0) - n_docs * pages,
            "evicted": st.get("host_evicted_pages", 0)}


def run_lru(docs: np.ndarray, n_docs: int, pages: int, slots: int) -> dict:
    lru: OrderedDict = OrderedDict()
    for d in range(n_docs):
        for k in keys_of(d, pages):
            lru[k] = None
            while len(lru) > slots:
                lru.popitem(last=False)
    hits = total = 0
    for d in docs.tolist():
        for k in keys_of(int(d), pages):
            total += 1
            if k in lru:
                hits += 1
                lru.move_to_end(k)
            else:
                lru[k] = None
                while len(lru) > slots:
                    lru.popitem(last=False)
    return {"hit_rate": hits / total}


def static_best(docs: np.ndarray, n_docs: int, pages: int, slots: int) -> dict:
    counts = np.bincount(docs, minlength=n_docs)
    top = np.sort(counts)[::-1][: slots // pages]
    return {"hit_rate": float(top.sum() / len(docs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alphas", default="0.8,1.0", help="Zipf exponents, comma-separated")
    ap.add_argument("--docs", type=int, default=96, help="documents in the working set")
    ap.add_argument("--pages", type=int, default=16, help="pages per document")
    ap.add_argument("--ratio", type=float, default=3.0, help="working set / DRAM tier")
    ap.add_argument("--requests", type=int, default=2000, help="requests after the warm-up")
    ap.add_argument("--seed", type=int, default=1, help="the trace's seed")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    slots = int(args.docs * args.pages / args.ratio)
    rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        docs = zipf_docs(args.docs, alpha, args.requests, args.seed)
        row = {"alpha": alpha, "docs": args.docs, "pages": args.pages, "slots": slots,
               "requests": args.requests, "2q": run_2q(docs, args.docs, args.pages, slots),
               "lru": run_lru(docs, args.docs, args.pages, slots),
               "static_best": static_best(docs, args.docs, args.pages, slots)}
        rows.append(row)
    print("| Zipf alpha | tier / working set | 2Q (hosttier) | LRU | static best |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['alpha']:g} | 1/{args.ratio:g} | {r['2q']['hit_rate']:.1%} | {r['lru']['hit_rate']:.1%} | "
              f"{r['static_best']['hit_rate']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
