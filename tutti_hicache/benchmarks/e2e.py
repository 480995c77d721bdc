"""The end-to-end server benchmark's pure parts: workload, summaries and report tables.

At a glance:
    wl = Workload(contexts=(16384, 32768, 65536), docs=2)
    wl.warm() / wl.first() / wl.sweep(fractions) / wl.rates(rate, n) / wl.capacity_warm(n_docs, C)
        / wl.capacity_reuse(n_docs, C, n)   -> [Request]   (seeded token ids, no data set)
    summarize(records, seconds) -> dict                    TTFT mean/p50/p99, ITL, throughput, cached tokens
    outputs_vs(runs, ref="recompute") -> {config: {phase: (equal, compared, [ids])}}
    sweep_rows(runs, bytes_per_token) / slo_rows(runs, slo_ms) / capacity_rows(runs) -> [dict]
    timeline_rows(runs) / split_rows(runs) -> [dict]      where a load's time went; TTFT around it
    report_markdown(runs, bytes_per_token) -> str          every table of docs/benchmarks.md's e2e section

The workload is LEval/LooGLE-shaped: documents of C tokens (a shared 256-token system prompt, then
the document) asked short questions. Request ids are stable across configurations, so the outputs
of one configuration are compared with the same prompt's recomputed output (config `recompute`).
A sweep request keeps the first h*C tokens of a warmed document (page-aligned: what a store can
hold) and fills the rest of its C tokens with new ones, so h is the cached share of the prompt.

A run (what bench/e2e_sglang.py writes, one dict per configuration and medium):
    {"config", "medium", "raw_read_GBps", "phases": {phase: [record]}, ...}
    record = {"id", "ttft_s", "itl_s": [...], "e2e_s", "cached_tokens", "details", "output_ids"}
Pure: numpy only, no server, no GPU (tested on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
import json
import os
import sys
from typing import Iterable, Optional

import numpy as np

PAGE = 64
SYSTEM_TOKENS = 256
TOKEN_RANGE = (100, 30000)


@dataclass(frozen=True)
class Request:
    id: str            # stable across configurations (the output comparison key)
    ids: list          # prompt token ids
    context: int       # document size in tokens (C)
    cached: int        # leading tokens a warmed store holds for this prompt (page-aligned)

    @property
    def hit_fraction(self) -> float:
        return self.cached / len(self.ids)


class Workload:
    """Seeded documents and questions. `docs` documents per context; questions of `q_tokens`.
    salt != 0 changes every token that follows a document (questions, a sweep point's new
    tokens, its twin's), never the documents: a second configuration on a store the first one
    wrote then asks nothing that store already holds past the documents."""

    def __init__(self, contexts: Iterable[int] = (16384, 32768, 65536), docs: int = 2,
                 q_tokens: int = 96, seed: int = 0, salt: int = 0):
        self.contexts = tuple(int(c) for c in contexts)
        if any(c <= SYSTEM_TOKENS + PAGE for c in self.contexts):
            raise ValueError(f"contexts must exceed {SYSTEM_TOKENS + PAGE} tokens: {self.contexts}")
        self.docs, self.q_tokens, self.seed, self.salt = int(docs), int(q_tokens), int(seed), int(salt)
        self.system = self.tokens("system", SYSTEM_TOKENS)

    def tokens(self, tag: str, n: int, *key: int) -> list:
        """n seeded token ids; the same (seed, tag, key) always gives the same ids (and the salt,
        for every tag but the system prompt's and the documents')."""
        words = [self.seed, sum(map(ord, tag)) * 7919 + len(tag), *key]
        if self.salt and tag not in ("system", "doc", "cap"):
            words.append(1_000_003 * self.salt)
        return np.random.default_rng(words).integers(*TOKEN_RANGE, n).tolist()

    def document(self, context: int, d: int, tag: str = "doc") -> list:
        """The shared system prompt and document d of size `context` (tokens in all)."""
        return self.system + self.tokens(tag, context - SYSTEM_TOKENS, context, d)

    def _question(self, *key: int) -> list:
        return self.tokens("question", self.q_tokens, *key)

    def rid(self, name: str) -> str:
        """A request id; with a salt, its first part says so ("sweep~s1/32768/0.9"): salted
        prompts differ from unsalted ones under the same name, so ids must too."""
        if not self.salt:
            return name
        head, _, rest = name.partition("/")
        return f"{head}~s{self.salt}/{rest}" if rest else f"{head}~s{self.salt}"

    def _ask(self, rid: str, doc: list, context: int, *key: int) -> Request:
        return Request(self.rid(rid), doc + self._question(*key), context, len(doc) // PAGE * PAGE)

    def warm(self) -> list:
        """Each document once (first seen: computed, its KV written to the tier)."""
        return [self._ask(f"warm/{c}/{d}", self.document(c, d), c, c, d, 0)
                for c in self.contexts for d in range(self.docs)]

    def first(self) -> Request:
        """The first request after a restart: the largest context's first document, a new question."""
        c = max(self.contexts)
        return self._ask(f"first/{c}/0", self.document(c, 0), c, c, 0, 1)

    def sweep(self, fractions: Iterable[float]) -> list:
        """Per context and hit fraction h: the first h*C tokens of a warmed document (documents
        taken in turn), then new tokens up to C in all, then a question."""
        out = []
        for c in self.contexts:
            for i, h in enumerate(fractions):
                if not 0 < h < 1:
                    raise ValueError(f"hit fractions must lie in (0, 1): {h}")
                d = i % self.docs
                keep = int(h * c) // PAGE * PAGE
                fresh = self.tokens("fresh", c - keep, c, d, int(round(h * 1000)))
                ids = self.document(c, d)[:keep] + fresh
                out.append(Request(self.rid(f"sweep/{c}/{h:g}"), ids + self._question(c, d, 2, i), c, keep))
        return out

    def rates(self, rate: float, n: int) -> list:
        """n questions on warmed documents of every context, in a seeded random order."""
        rng = np.random.default_rng([self.seed, 17, int(rate * 1000)])
        pairs = [(c, d) for c in self.contexts for d in range(self.docs)]
        out = []
        for k in range(n):
            c, d = pairs[int(rng.integers(len(pairs)))]
            out.append(self._ask(f"rate{rate:g}/{k}", self.document(c, d), c, c, d, 1000 + k))
        return out

    def capacity_warm(self, n_docs: int, context: int) -> list:
        return [self._ask(f"capwarm/{context}/{d}", self.document(context, d, "cap"), context,
                          context, d, 0) for d in range(n_docs)]

    def capacity_reuse(self, n_docs: int, context: int, n: int) -> list:
        """n reuses of the capacity documents in a seeded random order (without repeats while
        n <= n_docs), each with a new question."""
        order = np.random.default_rng([self.seed, 29]).permutation(n_docs).tolist()
        order = (order * (n // max(1, n_docs) + 1))[:n]
        return [self._ask(f"cap/{context}/{k}", self.document(context, d, "cap"), context,
                          context, d, 2000 + k) for k, d in enumerate(order)]


def bytes_per_token(layers: int, kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2) -> int:
    """KV bytes of one token (K and V of every layer): Llama-3-8B at 32 layers is 128 KiB."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def _pct(a, q):
    return float(np.percentile(a, q)) if len(a) else None


def summarize(records: list, seconds: Optional[float] = None) -> dict:
    """TTFT mean/p50/p99 and ITL in ms, requests/s, SGLang's cached tokens (mean, and by tier)."""
    recs = [r for r in records if r.get("ttft_s") is not None]
    ttft = np.array([r["ttft_s"] for r in recs]) * 1e3
    itl = np.array([x for r in recs for x in r.get("itl_s", [])]) * 1e3
    tiers = {}
    for r in recs:
        for k, v in (r.get("details") or {}).items():
            if isinstance(v, (int, float)):
                tiers[k] = tiers.get(k, 0) + v
    out = {"requests": len(records), "failed": len(records) - len(recs),
           "ttft_mean_ms": float(ttft.mean()) if len(ttft) else None,
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
           "itl_mean_ms": float(itl.mean()) if len(itl) else None,
           "cached_tokens_mean": float(np.mean([r.get("cached_tokens", 0) for r in recs])) if recs else None,
           "cached_by_tier_mean": {k: v / len(recs) for k, v in tiers.items()} if recs else {}}
    if seconds:
        out["throughput_rps"] = len(recs) / seconds
    return out


def _by_id(run: dict) -> dict:
    return {r["id"]: r for recs in run.get("phases", {}).values() for r in recs}


def outputs_vs(runs: list, ref: str = "recompute") -> dict:
    """Per configuration and phase: (equal, compared, mismatching ids) against the reference
    configuration's output for the same request id (same medium or any medium: outputs do not
    depend on the medium)."""
    refs = {}
    for run in runs:
        if run.get("config") == ref:
            refs.update({k: r.get("output_ids") for k, r in _by_id(run).items()})
    out = {}
    for run in runs:
        if run.get("config") == ref:
            continue
        per = {}
        for phase, recs in run.get("phases", {}).items():
            pairs = [(r["id"], r.get("output_ids"), refs.get(r["id"]))
                     for r in recs]
            pairs = [p for p in pairs if p[2] is not None and p[1] is not None]
            bad = [i for i, got, want in pairs if got != want]
            per[phase] = (len(pairs) - len(bad), len(pairs), bad)
        out[f"{run['config']}@{run.get('medium', '')}"] = per
    return out


def sweep_rows(runs: list, bpt: int) -> list:
    """One row per (config, medium, context, h): restored TTFT, the same prompt's TTFT with its
    prefix already in device memory (compute only), the I/O floor (cached bytes / raw read),
    the bound max(compute, I/O), and ratios to it, to `dram` and to `recompute`."""
    base = {}
    for run in runs:
        if run.get("config") in ("dram", "recompute"):
            for r in run.get("phases", {}).get("sweep", []):
                base[(run["config"], r["id"])] = r.get("ttft_s")
    rows = []
    for run in runs:
        recs = {r["id"]: r for r in run.get("phases", {}).get("sweep", [])}
        raw = run.get("raw_read_GBps") or 0
        for rid, r in recs.items():
            if rid.endswith("/l1") or r.get("ttft_s") is None:
                continue
            _, c, h = rid.split("/")
            l1 = recs.get(rid + "/l1", {}).get("ttft_s")
            io = io_floor_s(r, raw, bpt)
            bound = max(x for x in (l1, io) if x is not None) if (l1 or io) else None
            row = {"config": run["config"], "medium": run.get("medium"), "context": int(c),
                   "h": float(h), "ttft_ms": r["ttft_s"] * 1e3,
                   "compute_ms": l1 * 1e3 if l1 else None, "io_floor_ms": io * 1e3 if io else None,
                   "vs_bound": r["ttft_s"] / bound if bound else None,
                   "cached_tokens": r.get("cached_tokens"), "details": r.get("details")}
            for b in ("dram", "recompute"):
                t = base.get((b, rid))
                row[f"vs_{b}"] = r["ttft_s"] / t if t else None
            rows.append(row)
    return sorted(rows, key=lambda x: (x["medium"] or "", x["config"], x["context"], x["h"]))


def io_floor_s(rec: dict, raw_GBps, bpt: int):
    """Seconds to read a request's cached prefix at the medium's raw rate, or None (unknown)."""
    if not (bpt and raw_GBps and rec.get("cached")):
        return None
    return rec["cached"] * bpt / (raw_GBps * 1e9)


def sweep_pivot(rows: list) -> str:
    """One line per (medium, context, h): each configuration's TTFT, the compute-only time and the
    I/O floor (from the linker's run when there is one), and the linker's ratios."""
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["medium"], r["context"], r["h"]), {})[r["config"]] = r
    lines = []
    for (medium, c, h), by in sorted(cells.items(), key=lambda kv: (kv[0][0] or "", kv[0][1], kv[0][2])):
        ref = by.get("tutti-linker") or next(iter(by.values()))
        lines.append([medium, c, f"{h:g}"] + [_f(by[k]["ttft_ms"]) if k in by else "-" for k in configs] +
                     [_f(ref["compute_ms"]), _f(ref["io_floor_ms"]), _f(ref.get("vs_bound"), ".2f"),
                      _f(_ratio(by, "recompute", "tutti-linker"), ".1f")])
    return _table(["medium", "C", "h"] + configs + ["compute only", "I/O floor", "linker / max(compute, I/O)",
                                                    "recompute / linker"], lines)


def _ratio(by: dict, a: str, b: str):
    return by[a]["ttft_ms"] / by[b]["ttft_ms"] if a in by and b in by else None


def slo_rows(runs: list, slo_ms: float = 1000.0) -> list:
    """Per configuration and medium: each rate's TTFT summary and the highest rate whose mean TTFT
    stays within the SLO (None if none does)."""
    rows = []
    for run in runs:
        rates = sorted((float(p[4:]), s) for p, s in run.get("summaries", {}).items()
                       if p.startswith("rate"))
        if not rates:
            continue
        ok = [r for r, s in rates if s.get("ttft_mean_ms") is not None and s["ttft_mean_ms"] <= slo_ms
              and not s.get("failed")]
        rows.append({"config": run["config"], "medium": run.get("medium"),
                     "max_rate_within_slo": max(ok) if ok else None,
                     "rates": {r: s for r, s in rates}})
    return rows


def capacity_rows(runs: list) -> list:
    """Per configuration: the capacity phase's TTFT and its hit rate (cached tokens over prompt
    tokens, and the share of requests with any cached prefix)."""
    rows = []
    for run in runs:
        recs = run.get("phases", {}).get("capacity", [])
        if not recs:
            continue
        s = summarize(recs)
        prompt = [r.get("prompt_tokens") or 0 for r in recs]
        cached = [r.get("cached_tokens") or 0 for r in recs]
        rows.append({"config": run["config"], "medium": run.get("medium"), **s,
                     "token_hit_rate": sum(cached) / max(1, sum(prompt)),
                     "requests_with_hit": sum(c > p / 2 for c, p in zip(cached, prompt)) / max(1, len(recs)),
                     "working_set_gb": run.get("capacity_working_set_gb"),
                     "host_pool_gb": run.get("host_pool_gb")})
    return rows


def _f(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def _table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def report_markdown(runs: list, bpt: int, slo_ms: float = 1000.0) -> str:
    """Every table of the e2e section: sweep, rates + SLO, capacity, first request, outputs."""
    parts = ["### Hit-fraction sweep: TTFT ms (after a restart and a page-cache drop)",
             sweep_pivot(sweep_rows(runs, bpt))]
    slo = slo_rows(runs, slo_ms)
    rates = sorted({r for row in slo for r in row["rates"]})
    parts += [f"### Request rates: mean / p99 TTFT ms (max rate within a {slo_ms:.0f} ms mean-TTFT SLO)",
              _table(["medium", "config"] + [f"{r:g} req/s" for r in rates] + ["max rate in SLO"],
                     [[row["medium"], row["config"]] +
                      [(lambda s: f"{_f(s.get('ttft_mean_ms'))} / {_f(s.get('ttft_p99_ms'))}" if s else "-")(
                          row["rates"].get(r)) for r in rates] + [_f(row["max_rate_within_slo"], "g")]
                      for row in slo])]
    parts += ["### Capacity phase (working set larger than the DRAM tier)", _table(
        ["medium", "config", "TTFT mean / p50 / p99 ms", "token hit rate", "requests with half the prompt cached",
         "working set GB", "host pool GB"],
        [[r["medium"], r["config"], f"{_f(r['ttft_mean_ms'])} / {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])}",
          _f(r["token_hit_rate"], ".2f"), _f(r["requests_with_hit"], ".2f"), _f(r["working_set_gb"], ".1f"),
          _f(r["host_pool_gb"], ".1f")] for r in capacity_rows(runs)])]
    parts += ["### Per configuration", _table(
        ["medium", "config", "first request after start ms",
         "restore GB/s over whole load spans, paced ones too (raw)", "server starts s",
         "outputs = recompute (sequential phases)", "outputs = recompute (concurrent phases)"],
        [_config_row(run, outputs_vs(runs).get(f"{run['config']}@{run.get('medium', '')}", {}))
         for run in runs])]
    tl = timeline_rows(runs)
    if tl:
        parts += ["### Where the loads' time went (tutti_timeline_file; medians over each "
                  "configuration's loads, ms from the load's start)", _table(
                      ["medium", "config", "loads", "GB/s over the reads", "reads done", "last layer handed over",
                       "reaction p50", "forward inside wait_until", "finish returned"],
                      [[r["medium"], r["config"], r["loads"], _f(r["read_GBps"], ".2f"), _f(r["reads_ms"], ".1f"),
                        _f(r["handed_ms"], ".1f"), _f(r["react_ms_p50"], ".2f"),
                        _f(r["forward_wait_ms"], ".1f"), _f(r["finish_ms"], ".1f")] for r in tl])]
    split = split_rows(runs, bpt)
    if split:
        parts += ["### The sweep's TTFT around its load (client clock joined with the timeline's; ms)", _table(
            ["medium", "config", "C", "h", "TTFT", "compute-only twin's TTFT", "before the load",
             "of which before the linker's lookup", "load", "of which reads",
             "after the load", "of which until SGLang's first offload", "I/O floor + before + after (I/O-bound rows only)", "TTFT / that",
             "GPU begins layer 0 / the last layer (ms after the load's start)",
             "forward's stream idle for KV: layer 0 / all layers",
             "layers' compute (all but the last): this / its twin's"],
            [[r["medium"], r["config"], r["context"], f"{r['h']:g}", _f(r["ttft_ms"]), _f(r.get("twin_ms")),
              _f(r["before_ms"], ".1f"), _f(r.get("to_lookup_ms"), ".1f"), _f(r["load_ms"], ".1f"), _f(r["reads_ms"], ".1f"), _f(r["after_ms"], ".1f"), _f(r.get("to_offload_ms"), ".1f"), _f(r["floor_ms"]),
              _f(r["ttft_ms"] / r["floor_ms"] if r["floor_ms"] else None, ".2f"),
              f"{_f(r.get('gpu_layer0_ms'), '.1f')} / {_f(r.get('gpu_last_layer_ms'), '.1f')}",
              f"{_f(r.get('stream_stall_first_ms'), '.1f')} / {_f(r.get('stream_stall_ms'), '.1f')}",
              f"{_f(r.get('layers_compute_ms'), '.1f')} / {_f(r.get('next_bare_compute_ms'), '.1f')}"]
             for r in split])]
    return "\n\n".join(parts)


def split_rows(runs: list, bpt: int = 0) -> list:
    """The sweep's TTFT split around its load, per configuration with timeline records: each
    request (client send and first-token times, CLOCK_MONOTONIC) joined with the load that started
    between them (the server's timeline file, same clock): before = send to the load's start
    (HTTP, tokens, SGLang's scheduling and prefix match, the linker's lookup), load = start to
    finish_layer_wise_loading's return, after = that return to the first token (the last
    layers' compute, sampling, the response). With bytes per token (bpt) and the run's raw read:
    floor_ms = the I/O floor (the cached bytes at the raw rate) + before + after, the time left
    for an I/O-bound request once SGLang's own work outside the load is counted. to_lookup_ms:
    send to the linker's last lookup before the load (SGLang's part of before); twin_ms: the TTFT of the point's
    compute-only twin (the same prefix in device memory), beside it; to_offload_ms: the load's
    finish to SGLang's first offload after it (the batch's result processed; after's first part)."""
    out = []
    for run in runs:
        loads = sorted((t for t in run.get("timeline") or [] if t.get("start_ns") and t.get("finish_ns")
                        and not t.get("error")), key=lambda t: t["start_ns"])
        if not loads:
            continue
        sweep = run.get("phases", {}).get("sweep", [])
        twins = {r["id"][:-3]: r.get("ttft_s") for r in sweep if r["id"].endswith("/l1")}
        for r in sweep:
            sent, first = r.get("sent_ns"), r.get("first_token_ns")
            if r["id"].endswith("/l1") or not sent or not first:
                continue
            load = next((t for t in loads if sent <= t["start_ns"] <= first), None)
            if load is None:
                continue
            _, c, h = r["id"].split("/")
            row = {"medium": run.get("medium"), "config": run["config"], "context": int(c),
                   "h": float(h), "ttft_ms": (first - sent) / 1e6,
                   "before_ms": (load["start_ns"] - sent) / 1e6,
                   "load_ms": (load["finish_ns"] - load["start_ns"]) / 1e6,
                   "reads_ms": load.get("reads_ms"),
                   "after_ms": (first - load["finish_ns"]) / 1e6, "floor_ms": None,
                   "twin_ms": twins[r["id"]] * 1e3 if twins.get(r["id"]) else None,
                   "to_lookup_ms": (load["lookup_ns"] - sent) / 1e6
                   if sent <= load.get("lookup_ns", 0) <= load["start_ns"] else None,
                   "to_offload_ms": (load["offload_ns"] - load["finish_ns"]) / 1e6
                   if load["finish_ns"] <= load.get("offload_ns", 0) <= first else None,
                   **{k: load.get(k) for k in ("stream_stall_first_ms", "stream_stall_ms",
                                                "layers_compute_ms", "next_bare_compute_ms",
                                                "gpu_layer0_ms", "gpu_last_layer_ms")}}
            io = io_floor_s(r, run.get("raw_read_GBps"), bpt)
            if io is not None:
                row["floor_ms"] = io * 1e3 + row["before_ms"] + row["after_ms"]
            out.append(row)
    return sorted(out, key=lambda x: (x["medium"] or "", x["config"], x["context"], x["h"]))


def timeline_rows(runs: list) -> list:
    """Per configuration with timeline records (bench/e2e_sglang.py keeps their summaries under
    "timeline"): medians of the summaries' fields, and the bytes read per second of reads."""
    import statistics
    out = []
    for run in runs:
        recs = [t for t in run.get("timeline") or [] if not t.get("error") and t.get("reads_ms")]
        if not recs:
            continue

        def med(key):
            vals = [t[key] for t in recs if t.get(key) is not None]
            return statistics.median(vals) if vals else None
        page_bytes = run.get("page_bytes")
        rates = [t["pages"] * page_bytes / (t["reads_ms"] / 1e3) / 1e9 for t in recs
                 if page_bytes and t.get("pages")]
        out.append({"medium": run.get("medium"), "config": run["config"], "loads": len(recs),
                    "read_GBps": statistics.median(rates) if rates else None,
                    **{k: med(k) for k in ("reads_ms", "handed_ms", "react_ms_p50", "forward_wait_ms",
                                           "finish_ms")}})
    return out


def _config_row(run: dict, eq: dict) -> list:
    first = run.get("phases", {}).get("first", [{}])[0].get("ttft_s")
    seq = [v for p, v in eq.items() if not p.startswith("rate")]
    conc = [v for p, v in eq.items() if p.startswith("rate")]

    def frac(vals):
        n = sum(v[1] for v in vals)
        return f"{sum(v[0] for v in vals)}/{n}" if n else "-"
    restore = run.get("restore_GBps")
    raw = run.get("raw_read_GBps")
    return [run.get("medium"), run["config"], _f(first * 1e3 if first else None),
            f"{_f(restore, '.2f')} ({_f(raw, '.2f')})", "/".join(f"{s:.0f}" for s in run.get("start_s", [])),
            frac(seq), frac(conc)]


# ------------------------------------------------------------------ server configurations
CONFIGS = ("recompute", "dram", "file", "nixl", "tutti-host", "tutti-linker", "tutti-linker-dynamic",
           "tutti-mooncake")
CLUSTER = "tutti-mooncake"  # two servers: A warms (SSD + its Mooncake segment), B reads remote hits
LINKERS = ("tutti-linker", "tutti-linker-dynamic")
PERSISTENT = {"file", "nixl", "tutti-host", *LINKERS}
TUTTI = {"tutti-host", CLUSTER, *LINKERS}


def tutti_settings(parts: list, name: str) -> dict:
    """["tutti_threads=4", "tutti_verify=false"] -> {"tutti_threads": "4", ...}; anything else in
    parts (an empty one too) is an error naming `name`."""
    over = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("tutti_"):
            raise ValueError(f"{name!r}: a variant is +tutti_KEY=VALUE, not {part!r}")
        over[key] = value
    return over


def split_config(name: str) -> tuple[str, dict]:
    """A configuration name with tutti settings after it, for an A/B inside one run:
    "tutti-linker+tutti_threads=4+tutti_verify=false" -> ("tutti-linker", {...}). The variant keeps
    its whole name in the report, its stats files and its outputs; only tutti configurations
    take settings."""
    base, *parts = name.split("+")
    if base not in CONFIGS:
        raise ValueError(f"unknown configuration {base!r} (one of {', '.join(CONFIGS)})")
    over = tutti_settings(parts, name)
    if over and base not in TUTTI:
        raise ValueError(f"{name!r}: only tutti configurations take tutti settings")
    return base, over


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def write_model(path: str, layers: int) -> None:
    """A Llama-3-8B-shaped config.json with `layers` layers (the server loads random weights)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(LLAMA3_8B, num_hidden_layers=layers), f)


def tutti_config(args, config: str) -> dict:
    """tutti's settings of a run: striped over args.tutti_dirs, a stats file per server process."""
    return {"tutti_dirs": [os.path.join(d, "tutti") for d in args.tutti_dirs.split(",")],
            "tutti_capacity_gb": args.capacity_gb,
            "tutti_stats_file": os.path.join(args.out_dir, f"stats-{config}-{{pid}}.json"),
            "tutti_timeline_file": os.path.join(args.out_dir, f"timeline-{config}-{{pid}}.jsonl")}


def graph_flags(max_bs: int, version: Optional[str] = None, prefill: bool = False) -> list:
    """The server's CUDA graph flags: decode graphs for batches up to max_bs, prefill graphs off
    (a layer-wise load waits inside the prefill's forward) unless `prefill` (SGLang's own
    prefill graphs as it would pick them: 0.5.23's breakable ones, which wait for a load at
    their eager breaks), or none at all (max_bs 0: eager, the harness's default). SGLang 0.5.23
    spells them per phase; 0.5.17 has one max and piecewise prefill graphs."""
    if max_bs <= 0:
        return ["--disable-cuda-graph"]
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as pkg_version
        try:
            version = pkg_version("sglang")
        except PackageNotFoundError:
            version = ""
    parts = tuple(int(x) for x in version.split(".")[:3] if x.isdigit())
    if parts and parts < (0, 5, 23):
        return ["--cuda-graph-max-bs", str(max_bs)] + ([] if prefill else ["--disable-piecewise-cuda-graph"])
    return ([] if prefill else ["--cuda-graph-backend-prefill", "disabled"]) + \
        ["--cuda-graph-max-bs-decode", str(max_bs)]


def server_cmd(args, config: str, port: int, node: str = "", extra: Optional[dict] = None) -> tuple[list, dict]:
    """(argv, environment) of one configuration's server. tutti-mooncake: `node` (a, b) names the
    server's own tutti directories and stats files, `extra` adds its Mooncake keys (the master)
    and cluster settings; both servers share the GPU (a smaller static memory share)."""
    name = config  # a variant's whole name (its stats files); config: the base configuration
    config, over = split_config(name)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
           "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
           "--sampling-backend", "pytorch", "--page-size", str(PAGE),
           "--mem-fraction-static", "0.5", "--max-total-tokens", str(args.max_total_tokens),
           "--port", str(port), "--enable-metrics", "--enable-cache-report"]
    cmd += graph_flags(getattr(args, "cuda_graph_max_bs", 0), prefill=getattr(args, "prefill_graphs", False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_HICACHE_FILE", "SGLANG_HICACHE_NIXL"))}
    hicache = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
               "--hicache-storage-prefetch-policy", "wait_complete"]
    if config == "recompute":
        cmd.append("--disable-radix-cache")
    elif config == "dram":
        cmd += hicache + ["--hicache-size", str(args.dram_gb), "--hicache-mem-layout", "layer_first"]
    elif config == "file":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "layer_first",
                          "--hicache-storage-backend", "file"]
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = os.path.join(args.one_dir, "file")
    elif config == "nixl":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "page_first_direct",
                          "--hicache-storage-backend", "nixl",
                          "--hicache-storage-backend-extra-config", json.dumps({"use_uring": "true"})]
        dirs = (getattr(args, "nixl_dirs", "") or args.one_dir).split(",")  # nixl spreads over a list
        env.update(SGLANG_HICACHE_NIXL_BACKEND_PLUGIN="POSIX",
                   SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR=",".join(os.path.join(d, "nixl") for d in dirs))
    elif config == "tutti-host":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "layer_first",
                          "--hicache-storage-backend", "tutti", "--hicache-storage-backend-extra-config",
                          json.dumps({**tutti_config(args, name), **over})]
    elif config in LINKERS:
        cfg = {**tutti_config(args, name), **over}
        backend = "tutti"
        if config == "tutti-linker-dynamic":
            backend, cfg = "dynamic", {"linker": "TuttiLinker", "linker_module_path": "tutti_hicache.linker",
                                       "linker_extra_config": cfg}
        cmd += ["--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend", backend,
                "--unified-cache-external-linker-config", json.dumps(cfg)]
    elif config == CLUSTER:
        node = node or "a"
        cfg = tutti_config(args, f"{name}-{node}")
        cfg["tutti_dirs"] = [os.path.join(d, f"tutti-{node}") for d in args.tutti_dirs.split(",")]
        cfg.update(extra or {})
        cfg.update(over)
        # SGLang's MooncakeStore takes page-first host pools only (MHA layer_first is refused)
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "page_first_direct",
                          "--hicache-storage-backend", CLUSTER, "--hicache-storage-backend-extra-config",
                          json.dumps(cfg)]
        cmd[cmd.index("--mem-fraction-static") + 1] = "0.35"  # two servers on one GPU
    else:
        raise ValueError(f"unknown configuration {config!r} (one of {', '.join(CONFIGS)})")
    return cmd, env


def output_ids(chunks: list) -> list:
    """Cumulative chunks (each extends the last): the last; incremental ones: their concatenation."""
    if all(chunks[i] == chunks[i + 1][: len(chunks[i])] for i in range(len(chunks) - 1)):
        return chunks[-1] if chunks else []
    return [t for c in chunks for t in c]


def sweep_requests(wl: Workload, fractions: list) -> list:
    """Interleaved over contexts (so a document comes back only after every other context's
    documents have passed through the device pool), each point followed by its compute-only twin:
    the same cached prefix, new tokens of the same length, while the prefix is in device memory."""
    pts = wl.sweep(fractions)
    by = {(r.context, r.id.split("/")[2]): r for r in pts}
    out = []
    for h in fractions:
        for c in wl.contexts:
            r = by[(c, f"{h:g}")]
            twin_tail = wl.tokens("twin", len(r.ids) - r.cached, c, int(round(h * 1000)))
            out += [r, Request(r.id + "/l1", r.ids[: r.cached] + twin_tail, c, r.cached)]
    return out
