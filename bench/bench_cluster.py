"""Remote hits through the cluster tier (Mooncake) vs a local SSD hit vs recompute, on one machine.

Two node processes with the tiered backend (tutti_hicache.tiered) and a mooncake_master, all on
loopback (tutti_hicache.testing.cluster): node A writes a C-token prefix (Llama-3-8B KV shape: 8 KV
heads x 128, bf16, page 64, --layers layers) through SGLang's _page_backup, so the pages land on
A's SSD tier and in A's Mooncake segment. Node B (its own tutti directory, pinned host pool) then
restores the whole prefix through SGLang's _page_transfer, each configuration --repeats times:
  remote          from A's segment by Mooncake batch_get_into, no promotion (B forgets between)
  remote+promote  the same with tutti_cluster_promote (the default): the pages are also copied
                  out of the host pool inside the call and written to B's SSD tier on the
                  promotion thread (promote_drain_s: how long after the call that ended)
  local           from B's own SSD tier (O_DIRECT), after the promotion
each followed by one H2D copy of the restored pages into GPU memory (timed apart). Recompute: a
prefill of C tokens of the same shape (random-weight Llama layers, SDPA:
tutti_hicache/benchmarks/model.py) in this process. Every restore is checked byte-exact against
A's pages (SHA-256 per page).

Loopback TCP is not a cluster network: one host's memory bandwidth carries both ends, the
transfer engine copies through sockets, and nothing crosses a NIC. RDMA between nodes would
replace the socket copies with NIC DMA into the registered host pool (Mooncake's `rdma` protocol,
protocol/device_name in the extra config); see docs/cluster.md.

  python bench/bench_cluster.py --dirs /mnt/a,/mnt/b --context 32768 --json out.json
  python bench/bench_cluster.py --dirs /tmp/a,/tmp/b --dry-run      # tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from tutti_hicache.benchmarks.model import Model, prefill

SHAPE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, page=64)


def recompute_s(layers: int, tokens: int, repeats: int) -> float | None:
    """Median prefill time of `tokens` new tokens through the benchmarks' model with `layers` layers."""
    if not torch.cuda.is_available():
        return None
    model = Model(dict(SHAPE, layers=layers), tokens + 2 * SHAPE["page"], torch.device("cuda"))
    prefill(model, tokens, 0)  # warm-up
    times = [prefill(model, tokens, 0)[0] for _ in range(repeats)]
    del model
    torch.cuda.empty_cache()
    return statistics.median(times)


def run(args) -> dict:
    from tutti_hicache.testing import cluster as mc
    from tutti_hicache.testing.sglang import make_page_keys

    page = 16 if args.dry_run else SHAPE["page"]
    shape = dict(layers=2, heads=2, head_dim=64, page=page) if args.dry_run else dict(
        layers=args.layers, heads=SHAPE["kv_heads"], head_dim=SHAPE["head_dim"], page=page)
    pages = args.context // page
    page_bytes = 2 * shape["layers"] * shape["heads"] * shape["head_dim"] * 2 * page
    total = pages * page_bytes
    gib = total / (1 << 30)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else None
    pin = device is not None
    seg_mb = int(total * 1.25 / (1 << 20)) + 64
    cap_gb = max(0.05, 2.5 * gib)
    dirs = args.dirs.split(",")
    master = mc.Master(log_path=os.path.join(args.log_dir, "master.log")).start()
    method = "spawn" if device else "forkserver"  # CUDA in a forked child needs a clean parent
    a, b = mc.Node.spawn(method), mc.Node.spawn(method)
    out = {"context": args.context, "shape": shape, "pages": pages, "bytes": total,
           "device": torch.cuda.get_device_name() if device else "cpu", "protocol": "tcp",
           "network": "loopback", "results": []}
    try:
        a.ready(), b.ready()
        common = dict(n_pages=pages + 8, pin=pin, capacity_gb=cap_gb, **shape)
        a.call("open", "kv", [dirs[0]], mc.mooncake_extra(master, seg_mb), **common)
        for name, promote in (("remote", False), ("promote", True)):
            extra = mc.mooncake_extra(master, 64, tutti_cluster_publish="off",
                                      tutti_cluster_promote=promote)
            d = os.path.join(dirs[1], name)
            os.makedirs(d, exist_ok=True)
            b.call("open", name, [d], extra, **common)
        for node, names in ((a, ["kv"]), (b, ["remote", "promote"])):
            for name in names:
                assert node.call("wait_state", name, "up", timeout=60) == "up", name
        keys = make_page_keys(pages, 1)
        t0 = time.perf_counter()
        done, want = a.call("write", "kv", keys, 1, timeout=600)
        write_s = time.perf_counter() - t0
        assert done == pages, f"A stored {done} of {pages} pages"
        out["write_s"] = write_s
        print(f"A wrote {pages} pages ({gib:.2f} GiB) to its SSD tier and its segment in "
              f"{write_s:.2f} s", flush=True)
        plan = [("remote", "remote", True), ("remote+promote", "promote", True),
                ("local", "promote", False)]
        for config, name, forget in plan:
            for r in range(args.repeats):
                if forget:
                    b.call("forget", name, keys)
                res = b.call("timed_read", name, keys, device, timeout=600)
                promote_s = b.call("drain", name, timeout=600)  # the background promotion's end
                exact = res["pages"] == pages and res["digests"] == want
                row = dict(config=config, repeat=r, pages=res["pages"], byte_exact=exact,
                           transfer_s=res["transfer_s"], h2d_s=res["h2d_s"],
                           restore_s=res["transfer_s"] + res["h2d_s"],
                           promote_drain_s=promote_s, gbps=total / res["transfer_s"] / 1e9)
                out["results"].append(row)
                print(f"{config:15s} r{r}: {res['pages']}/{pages} pages, byte-exact {exact}, "
                      f"host {res['transfer_s']:.3f} s ({row['gbps']:.2f} GB/s), "
                      f"H2D {res['h2d_s']:.3f} s, promotion drained {promote_s:.3f} s later",
                      flush=True)
            if config == "local":
                out["stats"] = b.call("stats", name)
    finally:
        for n in (a, b):
            n.exit()
        master.stop()
    out["recompute_s"] = recompute_s(shape["layers"], args.context, args.repeats) if device else None
    return out


def table(out: dict) -> str:
    rows = ["| config | restore s (host + H2D), median | host GB/s, median | byte-exact | vs recompute |",
            "| --- | --- | --- | --- | --- |"]
    rec = out.get("recompute_s")
    for config in dict.fromkeys(r["config"] for r in out["results"]):
        rs = [r for r in out["results"] if r["config"] == config]
        t = statistics.median(r["restore_s"] for r in rs)
        g = statistics.median(r["gbps"] for r in rs)
        ratio = f"{rec / t:.2f}x faster" if rec and t < rec else (f"{t / rec:.2f}x slower" if rec else "-")
        rows.append(f"| {config} | {t:.3f} | {g:.2f} | {all(r['byte_exact'] for r in rs)} | {ratio} |")
    if rec:
        rows.append(f"| recompute ({out['shape']['layers']} layers, {out['context']} tokens) | "
                    f"{rec:.3f} | - | - | 1.00x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dirs", required=True, help="two directories: A's and B's SSD tiers")
    ap.add_argument("--context", type=int, default=32768, help="prefix tokens")
    ap.add_argument("--layers", type=int, default=8, help="KV layers (Llama-3-8B has 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.dry_run:
        args.context = min(args.context, 512)
    out = run(args)
    print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
