"""Faults inside a real SGLang server (0.5.23; a GPU): every request either gets the output the same
prompt got when it was computed from scratch, or fails with an error; the server keeps serving.

Per configuration (`tutti-linker`, `tutti-host`), one server, documents first computed (their greedy
outputs are the reference) and written to the store, then, one after another:
  corrupt     random bytes flipped in every file the store wrote (payload, headers, metadata), then the
              same prompts after /flush_cache (their prefixes now come from the damaged store)
  truncate    every segment file cut to half its length (pages deleted under the index)
  disk-full   each store directory's filesystem filled (a filler file), new documents sent (their
              offloads hit ENOSPC), the old prompts again; then the fillers removed and new documents
              again (the store writes again)
  injector    `tutti-host` only: a restarted server with SGLang's own failure injector
              (SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE=0.2) on every storage call
Reported per fault: requests, outputs equal to the reference, requests failed with an error, wrong
outputs (must be 0), whether the server was still serving, tutti's counters (checksum failures, load
failures, read errors). Not covered here: a directory made unreadable (the server runs as root, and
root reads through any mode bits; the loop devices have no error injection): see docs/reliability.md.

  python bench/faults_sglang.py --write-model --model /tmp/llama8 --layers 8 \\
      --tutti-dirs /mnt/a0,...,/mnt/a7 --configs tutti-linker,tutti-host --json faults.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import time

from tutti_hicache.benchmarks import configs, e2e
from tutti_hicache.benchmarks.server import Server, config_files, tutti_stats


def store_files(args) -> list:
    out = []
    for d in args.tutti_dirs.split(","):
        for root, _, files in os.walk(os.path.join(d, "tutti")):
            out += [os.path.join(root, f) for f in files]
    return sorted(out)


def corrupt(args, rng: random.Random, flips: int) -> int:
    """Flip `flips` random bytes in every file the store wrote; returns the files touched."""
    files = store_files(args)
    for p in files:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "r+b") as f:
            for _ in range(flips if size > 1 << 20 else 1):
                off = rng.randrange(size)
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            f.flush()
            os.fsync(f.fileno())
    return len(files)


def truncate_segments(args) -> int:
    n = 0
    for p in store_files(args):
        size = os.path.getsize(p)
        if size > 1 << 20:  # segments; metadata files are small
            os.truncate(p, size // 2)
            n += 1
    return n


def fill(args) -> list:
    fillers = []
    for d in args.tutti_dirs.split(","):
        path = os.path.join(d, "filler")
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(0, free - (1 << 20)))
            except OSError:
                pass
        fillers.append(path)
    return fillers


NEAR_TIE = 0.05  # nats between the top two tokens: a greedy choice a rounding difference can flip


def generate(srv: Server, req: e2e.Request, max_new: int) -> dict:
    """One greedy generation with the top-2 log-probabilities of every output token (not streamed):
    output_ids, gaps (top-1 minus top-2 logprob per position), SGLang's cached-token details."""
    import requests
    body = {"input_ids": req.ids, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    rec = {"id": req.id}
    try:
        r = requests.post(srv.url + "/generate", json=body, timeout=(5, 300))
        out = r.json()
    except Exception as e:  # a failed request is recorded, never hangs the run
        rec["error"] = repr(e)
        return rec
    if isinstance(out, list):
        out = out[0]
    meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
    if not isinstance(out, dict) or "error" in out or r.status_code != 200:
        rec["error"] = str(out)[:400]
    tops = meta.get("output_top_logprobs") or []
    ids = out.get("output_ids") if isinstance(out, dict) else None
    if ids is None and meta.get("output_token_logprobs"):
        ids = [t[1] for t in meta["output_token_logprobs"]]
    rec.update(output_ids=ids, finish_reason=meta.get("finish_reason"),
               cached_tokens=meta.get("cached_tokens"), details=meta.get("cached_tokens_details"),
               gaps=[round(t[0][0] - t[1][0], 5) if t and len(t) > 1 else None for t in tops])
    return rec


def judge(records: list, reference: dict) -> dict:
    """Against the from-scratch outputs: equal, failed (an error or SGLang's abort), or wrong. A wrong
    output is also placed: the first position it differs at, and the reference's top-2 gap there
    (below NEAR_TIE the reference itself nearly chose the other token: a numerical difference of a
    recomputed suffix, not damaged KV, can flip it)."""
    out = {"requests": len(records), "equal": 0, "errors": 0, "wrong": 0, "wrong_ids": [],
           "wrong_near_tie": 0, "divergences": [],
           "error_texts": sorted({r["error"][:160] for r in records if r.get("error")})[:5]}
    for r in records:
        reason = r.get("finish_reason") or {}
        ref = reference.get(r["id"].split("#")[0])
        if r.get("error") or r.get("output_ids") is None or (
                isinstance(reason, dict) and reason.get("type") == "abort"):
            out["errors"] += 1  # failed with an error, or aborted by SGLang (finish_reason abort)
        elif ref is None or ref["output_ids"] == r["output_ids"]:
            out["equal"] += 1
        else:
            out["wrong"] += 1
            out["wrong_ids"].append(r["id"])
            a, b = ref["output_ids"] or [], r["output_ids"]
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gaps = ref.get("gaps") or []
            gap = gaps[at] if at < len(gaps) else None
            got = (r.get("gaps") or [None] * (at + 1))[at] if at < len(r.get("gaps") or []) else None
            out["divergences"].append({"id": r["id"], "at": at, "ref_gap": gap, "gap": got,
                                       "cached_tokens": r.get("cached_tokens"), "details": r.get("details")})
            if gap is not None and gap < NEAR_TIE:
                out["wrong_near_tie"] += 1
    return out


def ask(srv: Server, reqs: list, max_new: int, tag: str) -> list:
    recs = []
    for r in reqs:
        srv.flush()
        rec = generate(srv, r, max_new)
        rec["id"] = f"{r.id}#{tag}"
        recs.append(rec)
    return recs


def tutti_counters(args, config: str) -> dict:
    keys = ("checksum_failures", "read_errors", "load_failures", "misses", "hits", "write_failures")
    total: dict = {}
    for s in tutti_stats(args.out_dir, config):
        for k in keys:
            for v in (s.get(k), s.get("linker", {}).get(k)):
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
    return total


def fresh_store(args) -> None:
    """Empty store directories (the same paths the server's tutti_dirs name)."""
    for d in args.tutti_dirs.split(","):
        shutil.rmtree(os.path.join(d, "tutti"), ignore_errors=True)
        os.makedirs(os.path.join(d, "tutti"))


def run_config(args, config: str, wl: e2e.Workload) -> dict:
    fresh_store(args)
    for path in config_files(args.out_dir, "stats", config):
        os.unlink(path)
    port = 31000 + configs.CONFIGS.index(config)
    cmd, env = configs.server_cmd(args, config, port)
    log = os.path.join(args.out_dir, f"server-faults-{config}.log")
    res = {"config": config, "faults": {}}
    rng = random.Random(0)
    docs = wl.warm()
    # new documents (another seed) under their own ids: they share warm()'s "warm/C/d" names, and
    # a reference stored under the same id replaced the first documents' (the first run of this
    # benchmark judged those "wrong": they were compared with other documents' outputs)
    fresh = iter(dataclasses.replace(r, id=f"new-{r.id}")
                 for r in e2e.Workload(wl.contexts, 8, seed=1).warm())
    srv = Server(cmd, env, log, port)
    reference: dict = {}

    def remember(r):  # computed from scratch (first seen): the reference output
        if r.id in reference:
            raise RuntimeError(f"two documents share the id {r.id}")
        reference[r.id] = generate(srv, r, args.max_new)

    def fault(name, reqs, tag):
        recs = ask(srv, reqs, args.max_new, tag)
        res["faults"][name] = {**judge(recs, reference), "serving": srv.alive(),
                               "counters": tutti_counters(args, config),
                               "records": [{k: r.get(k) for k in ("id", "output_ids", "gaps", "finish_reason",
                                                                    "error", "cached_tokens", "details")}
                                           for r in recs]}
        print(f"  {config:14s} {name:10s} " + json.dumps({k: v for k, v in res["faults"][name].items()
                                                          if k != "records"}), flush=True)

    try:
        res["start_s"] = srv.wait_ready(args.start_timeout)
        for r in docs:  # computed from scratch: the reference outputs; their KV goes to the store
            remember(r)
        res["reference"] = reference
        time.sleep(args.settle_s)
        fault("baseline", docs, "base")
        res["corrupted_files"] = corrupt(args, rng, args.flips)
        fault("corrupt", docs, "corrupt")
        new = [next(fresh) for _ in range(2)]  # new pages written after the damage
        for r in new:
            remember(r)
        time.sleep(args.settle_s)
        res["truncated_files"] = truncate_segments(args)
        fault("truncate", docs + new, "truncate")
        fillers = fill(args)
        full = [next(fresh) for _ in range(2)]
        for r in full:
            remember(r)
        time.sleep(args.settle_s)
        fault("disk-full", docs + full, "full")
        for p in fillers:
            os.unlink(p)
        after = [next(fresh) for _ in range(2)]
        for r in after:
            remember(r)
        time.sleep(args.settle_s)
        fault("space-back", after, "back")
        if config == "tutti-host" and not args.no_injector:
            srv.stop()
            fresh_store(args)  # a clean store: this phase is about the injector
            env = dict(env, SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE="0.2")
            srv = Server(cmd, env, log, port)
            srv.wait_ready(args.start_timeout)
            again = [next(fresh) for _ in range(2)]
            for r in again:
                remember(r)
            time.sleep(args.settle_s)
            fault("injector", again * 3, "inject")
    except Exception as e:  # keep what was measured
        res["error"] = repr(e)
        print(f"  {config}: {e!r}", flush=True)
    finally:
        res["serving_at_end"] = srv.alive()
        srv.stop()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8")
    ap.add_argument("--write-model", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tutti-dirs", required=True)
    ap.add_argument("--configs", default="tutti-linker,tutti-host")
    ap.add_argument("--contexts", default="16384")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--flips", type=int, default=64, help="bytes flipped per segment file")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=150000)
    ap.add_argument("--host-gb", type=int, default=4)
    ap.add_argument("--dram-gb", type=int, default=4)
    ap.add_argument("--capacity-gb", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait for write-back before a fault")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--no-injector", action="store_true")
    ap.add_argument("--out-dir", default="/tmp/tutti-faults")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    args.one_dir = args.tutti_dirs.split(",")[0]
    os.makedirs(args.out_dir, exist_ok=True)
    if args.write_model:
        configs.write_model(args.model, args.layers)
    wl = e2e.Workload([int(c) for c in args.contexts.split(",")], args.docs)
    results = [run_config(args, c, wl) for c in args.configs.split(",")]
    with open(args.json, "w") as f:
        json.dump(results, f, default=str)
    for r in results:
        for name, f in r["faults"].items():
            print(f"| {r['config']} | {name} | {f['requests']} | {f['equal']} | {f['errors']} | {f['wrong']} "
                  f"| {f['serving']} |", flush=True)


if __name__ == "__main__":
    main()
