#!/usr/bin/env python3
"""The linker's DRAM tier policy (hosttier.py's 2Q) on a Zipf trace, beside plain LRU and the
static best (the most popular documents that fit), by page hit rate. No I/O: the real HostTier
with 4 KiB pages on the CPU, driven as the linker drives it (offloads enter probation; a load
pins what is resident, and the pages it read from the SSD go through wants(), the wanted ones
promoted with reserve(hot=True) + publish). The trace is bench_serving's capacity phase in
miniature: --docs documents of --pages pages each offloaded once (the capwarm phase), then
--requests requests whose document follows Zipf(alpha), with the tier holding 1/--ratio of the
documents. --device-docs N puts SGLang's device pool in front (an LRU of N documents): a request
it answers never reaches the tier, which then sees the rest of the stream, as in a server.

    python bench/sim_host_policy.py --alphas 0.8,1.0 --json out.json
    python bench/sim_host_policy.py --docs 8 --pages 64 --ratio 2.6667 --device-docs 2    # the server's
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


class DeviceLRU:
    """SGLang's device pool in front of the tier: the last `docs` documents used stay in GPU
    memory (its radix cache evicts the least recently used), and a request they answer never
    reaches the tier. 0 documents: no device pool (every request reaches the tier). warm_docs:
    documents 0..warm_docs-1 were just written in order (capwarm), so the last of them are
    there."""

    def __init__(self, docs: int, warm_docs: int = 0):
        self.docs, self.lru = docs, OrderedDict()
        for d in range(max(0, warm_docs - docs), warm_docs):
            self.hit(d)

    def hit(self, doc: int) -> bool:
        if self.docs <= 0:
            return False
        here = doc in self.lru
        self.lru[doc] = None
        self.lru.move_to_end(doc)
        while len(self.lru) > self.docs:
            self.lru.popitem(last=False)
        return here


def run_2q(docs: np.ndarray, n_docs: int, pages: int, slots: int, device_docs: int = 0) -> dict:
    tier = HostTier(slots * PAGE_BYTES, 1, 1, PAGE_BYTES, torch.device("cpu"), False)
    for d in range(n_docs):  # capwarm: each document offloaded once
        keys = keys_of(d, pages)
        tier.publish(keys, tier.reserve(keys, hot=False), True)
    device = DeviceLRU(device_docs, warm_docs=n_docs)
    hits = total = dev = 0
    for d in docs.tolist():
        if device.hit(int(d)):
            dev += pages
            continue
        keys = keys_of(int(d), pages)
        slots_ = tier.pin(keys)
        tier.hit(slots_)  # the load runs at once: its DRAM pages are hits
        here = slots_ >= 0
        hits += int(here.sum())
        total += len(keys)
        tier.unpin(slots_[here])
        read = [k for k, h in zip(keys, here.tolist()) if not h]
        want = [k for k, w in zip(read, tier.wants(read).tolist()) if w]
        if want:
            tier.publish(want, tier.reserve(want, hot=True), True)
    st = tier.stats()
    all_pages = len(docs) * pages
    return {"hit_rate": hits / max(1, total), "device_share": dev / all_pages, "host_share": hits / all_pages,
            "promoted": st.get("host_inserted_pages", 0) - n_docs * pages,
            "evicted": st.get("host_evicted_pages", 0)}


def run_lru(docs: np.ndarray, n_docs: int, pages: int, slots: int, device_docs: int = 0) -> dict:
    lru: OrderedDict = OrderedDict()
    for d in range(n_docs):
        for k in keys_of(d, pages):
            lru[k] = None
            while len(lru) > slots:
                lru.popitem(last=False)
    device = DeviceLRU(device_docs, warm_docs=n_docs)
    hits = total = 0
    for d in docs.tolist():
        if device.hit(int(d)):
            continue
        for k in keys_of(int(d), pages):
            total += 1
            if k in lru:
                hits += 1
                lru.move_to_end(k)
            else:
                lru[k] = None
                while len(lru) > slots:
                    lru.popitem(last=False)
    return {"hit_rate": hits / max(1, total), "host_share": hits / (len(docs) * pages)}


def static_best(docs: np.ndarray, n_docs: int, pages: int, slots: int, device_docs: int = 0) -> dict:
    """The tier holding the most popular documents the device pool does not (the device pool
    held, ideally, the most popular of all): its share of the requests, and of those that reach
    it."""
    counts = np.sort(np.bincount(docs, minlength=n_docs))[::-1]
    tier = counts[device_docs:device_docs + slots // pages].sum()
    reach = counts[device_docs:].sum()
    return {"hit_rate": float(tier / max(1, reach)), "host_share": float(tier / len(docs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alphas", default="0.8,1.0", help="Zipf exponents, comma-separated")
    ap.add_argument("--docs", type=int, default=96, help="documents in the working set")
    ap.add_argument("--pages", type=int, default=16, help="pages per document")
    ap.add_argument("--ratio", type=float, default=3.0, help="working set / DRAM tier")
    ap.add_argument("--requests", type=int, default=2000, help="requests after the warm-up")
    ap.add_argument("--seed", type=int, default=1, help="the trace's seed")
    ap.add_argument("--device-docs", type=int, default=0,
                    help="documents SGLang's device pool holds in front of the tier (LRU; 0: none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    slots = int(args.docs * args.pages / args.ratio)
    rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        docs = zipf_docs(args.docs, alpha, args.requests, args.seed)
        row = {"alpha": alpha, "docs": args.docs, "pages": args.pages, "slots": slots,
               "requests": args.requests, "device_docs": args.device_docs,
               "2q": run_2q(docs, args.docs, args.pages, slots, args.device_docs),
               "lru": run_lru(docs, args.docs, args.pages, slots, args.device_docs),
               "static_best": static_best(docs, args.docs, args.pages, slots, args.device_docs)}
        rows.append(row)
    print("| Zipf alpha | tier / working set | device pool (docs): its share | tier's share of all pages: "
          "hosttier / LRU / static best |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['alpha']:g} | 1/{args.ratio:g} | {args.device_docs}: {r['2q']['device_share']:.1%} | "
              f"{r['2q']['host_share']:.1%} / {r['lru']['host_share']:.1%} / {r['static_best']['host_share']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
