"""The end-to-end server benchmark's report: the tables of a run's records (docs/benchmarks.md §7).

At a glance:
    sweep_rows(runs, bytes_per_token) / slo_rows(runs, slo_ms) / capacity_rows(runs) -> [dict]
    baseline_rows(runs) -> [dict]     tutti's best against each lmcache-* run: TTFT at lmcache-dram's
                                      SLO rate, and the ratio of the highest rates under the SLO
    timeline_rows(runs) / split_rows(runs) -> [dict]      where a load's time went; TTFT around it
    output_rows(runs, tol) / control_rows(runs, tol) -> [dict]   outputs against recompute (greedy
                                                       ids, top-k logprobs); the +misplace control
    report_markdown(runs, bytes_per_token) -> str          every table of the e2e section
    merge_runs(runs) -> [run]         several calls' runs, one per (config, medium): the last one,
                                      with the rate points of earlier calls on the same shape

Runs and records are those of e2e.py's docstring. Pure: no server, no GPU (tested on CPU).
"""

from __future__ import annotations

import numpy as np

from .configs import CONFIGS
from .e2e import LOGPROB_TOL, model_key, outputs_vs, run_key, summarize
from .serving import highest_rate

# what must match for two calls' rate points of one configuration to be one sweep
_SAME_SWEEP = ("model_shape", "layers", "page_size", "kv_cache_dtype", "attention_backend", "weights",
               "cuda_graph_max_bs", "host_pool_gb")


def merge_runs(runs: list) -> list:
    """Runs of several calls (in call order) -> one per (config, medium, model_key): the last call's, with the
    rate points of earlier calls on the same model, settings and rate-phase shape that it lacks
    (a sweep split over calls; the GPU machine's calls are short). The highest rate under the SLO
    is taken again over the merged points. Anything else of an earlier call is dropped, except
    where the later call measured nothing (the configuration did not start): the earlier run stays."""
    out: dict = {}
    for run in runs:
        key = (run.get("config"), run.get("medium"), *model_key(run))  # a run of another model stays
        old = out.get(key)
        if old and old.get("phases") and not run.get("phases"):
            continue
        out[key] = run
        if not old or not old.get("rate_sweep") or not run.get("rate_sweep"):
            continue
        if any(old.get(k) != run.get(k) for k in _SAME_SWEEP):
            continue
        shape = lambda r, ph: (r.get("serving", {}).get(ph) or {}).get("shape")  # noqa: E731
        new_pts = run["rate_sweep"].get("mean_ttft_s", {})
        lacking = [r for r in old["rate_sweep"].get("mean_ttft_s", {}) if r not in new_pts]
        ref = shape(run, f"rate{next(iter(new_pts), '')}")
        lacking = [r for r in lacking if shape(old, f"rate{r}") == ref]
        if not lacking:
            continue
        run = out[key] = {**run, "phases": dict(run.get("phases", {})),
                          "summaries": dict(run.get("summaries", {})),
                          "serving": dict(run.get("serving", {})),
                          "rate_sweep": dict(run["rate_sweep"], mean_ttft_s=dict(new_pts)),
                          "merged_rates_from_earlier_call": sorted(lacking, key=float)}
        for r in lacking:
            ph = f"rate{r}"
            for part in ("phases", "summaries", "serving"):
                if ph in old.get(part, {}):
                    run[part][ph] = old[part][ph]
            run["rate_sweep"]["mean_ttft_s"][r] = old["rate_sweep"]["mean_ttft_s"][r]
        pts = {float(r): t for r, t in run["rate_sweep"]["mean_ttft_s"].items()}
        run["rate_sweep"]["highest_rate_under_slo"] = highest_rate(pts, run["rate_sweep"].get("slo_s", 1.0))
    return list(out.values())


def sweep_rows(runs: list, bpt: int) -> list:
    """One row per (config, medium, context, h): restored TTFT, the same prompt's TTFT with its
    prefix already in device memory (compute only), the I/O floor (cached bytes / raw read),
    the bound max(compute, I/O), and ratios to it, to `dram` and to `recompute`."""
    base = {}
    for run in runs:
        if run.get("config") in ("dram", "recompute"):
            for r in run.get("phases", {}).get("sweep", []):
                base[(model_key(run), run["config"], r["id"])] = r.get("ttft_s")
    rows = []
    for run in runs:
        recs = {r["id"]: r for r in run.get("phases", {}).get("sweep", [])}
        mk = model_key(run)
        raw, run_bytes = run.get("raw_read_GBps") or 0, run_bpt(run, bpt)
        for rid, r in recs.items():
            if rid.endswith("/l1") or r.get("ttft_s") is None:
                continue
            _, c, h = rid.split("/")
            l1 = recs.get(rid + "/l1", {}).get("ttft_s")
            io = io_floor_s(r, raw, run_bytes)
            bound = max(x for x in (l1, io) if x is not None) if (l1 or io) else None
            row = {"config": run["config"], "medium": run.get("medium"), "model": model_label(run), "context": int(c),
                   "h": float(h), "ttft_ms": r["ttft_s"] * 1e3,
                   "compute_ms": l1 * 1e3 if l1 else None, "io_floor_ms": io * 1e3 if io else None,
                   "vs_bound": r["ttft_s"] / bound if bound else None,
                   "cached_tokens": r.get("cached_tokens"), "details": r.get("details"),
                   "hit_share": hit_share(r) if run["config"] != "recompute" else None}  # recompute misses by design
            for b in ("dram", "recompute"):
                t = base.get((mk, b, rid))
                row[f"vs_{b}"] = r["ttft_s"] / t if t else None
            rows.append(row)
    return sorted(rows, key=lambda x: (x["model"], x["medium"] or "", x["config"], x["context"], x["h"]))


def model_label(run: dict) -> str:
    """The model_key as a table cell: shape/layers/KV dtype (weights and page size when not the
    defaults); "" for a run from before the fields were recorded."""
    shape, layers, kv, weights, page = model_key(run)
    if shape is None and layers is None:
        return ""
    extra = [x for x, d in ((weights, "seeded"), (page and f"page {page}", "page 64")) if x and x != d]
    return "/".join(str(x) for x in (shape, layers, kv or "auto", *extra))


def run_bpt(run: dict, bpt: int) -> int:
    """KV bytes per token of the run's own server (page_bytes / page_size, which the harness records
    from the model shape, layer count and KV dtype), else ``bpt``: a report over runs of several
    shapes or KV dtypes (fp8 halves the bytes) must not price every run's I/O floor as one shape's."""
    page_bytes, page_size = run.get("page_bytes"), run.get("page_size")
    return page_bytes // page_size if page_bytes and page_size else bpt


def hit_share(rec: dict):
    """The share of a request's intended cached prefix (rec["cached"]) that SGLang reported cached
    (its cached_tokens), capped at 1; None when either is unknown. Under 1 the request recomputed
    part of its prefix: its TTFT and its I/O floor (priced at the intended prefix) are not the
    point's, and the tables mark it."""
    want, got = rec.get("cached"), rec.get("cached_tokens")
    return min(1.0, got / want) if want and got is not None else None


def _cell(row: dict) -> str:
    """A sweep row's TTFT, marked with the hit share when SGLang served less than the intended prefix."""
    share = row.get("hit_share")
    return _f(row["ttft_ms"]) + (f" (hit {share:.0%})" if share is not None and share < 1 else "")


def io_floor_s(rec: dict, raw_GBps, bpt: int):
    """Seconds to read a request's cached prefix at the medium's raw rate, or None (unknown)."""
    if not (bpt and raw_GBps and rec.get("cached")):
        return None
    return rec["cached"] * bpt / (raw_GBps * 1e9)


def sweep_pivot(rows: list) -> str:
    """One line per (medium, context, h): each configuration's TTFT (marked "(hit N%)" where SGLang
    served less than the intended prefix), the compute-only time and the I/O floor (from the
    linker's run when there is one), and the linker's ratios; without a linker run in the rows,
    the ratio to the bound is the first configuration's, and says so."""
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    ours = "tutti-linker" if "tutti-linker" in configs else next((c for c in configs if c != "recompute"),
                                                                 "tutti-linker")
    cells: dict = {}
    for r in rows:
        cells.setdefault((r.get("model", ""), r["medium"], r["context"], r["h"]), {})[r["config"]] = r
    models = len({k[0] for k in cells}) > 1  # runs of several models: a column says whose row
    lines = []
    for (model, medium, c, h), by in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2], kv[0][3])):
        ref = by.get(ours) or next(iter(by.values()))
        lines.append(([model] if models else []) + [medium, c, f"{h:g}"] +
                     [_cell(by[k]) if k in by else "-" for k in configs] +
                     [_f(ref["compute_ms"]), _f(ref["io_floor_ms"]), _f(by.get(ours, {}).get("vs_bound"), ".2f"),
                      _f(_ratio(by, "recompute", "tutti-linker"), ".1f")])
    name = "linker" if ours == "tutti-linker" else ours
    return _table((["model"] if models else []) + ["medium", "C", "h"] + configs +
                  ["compute only", "I/O floor", f"{name} / max(compute, I/O)", "recompute / linker"], lines)


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


def _dram_page_share(run: dict):
    """Of the pages the linker loaded over the whole run, the share its DRAM tier gave (tutti's
    stats; None without a tier). SGLang files a load with any SSD page under `storage`, so its
    per-request `host` share counts only the loads served wholly from DRAM."""
    lk = [s["linker"] for s in run.get("tutti_stats", []) if "host_slots" in s.get("linker", {})]
    pages = sum(x.get("load_pages", 0) for x in lk)
    return sum(x.get("load_host_pages", 0) for x in lk) / pages if pages else None


def capacity_rows(runs: list) -> list:
    """Per configuration: the capacity phase's TTFT and its hit rate (cached tokens over prompt
    tokens, and the share of requests with any cached prefix), and the run's DRAM page share."""
    rows = []
    for run in runs:
        for name, recs in run.get("phases", {}).items():
            if not recs or not (name == "capacity" or name.startswith("capacity") and name[8:9].isdigit()):
                continue
            s = summarize(recs)
            prompt = [r.get("prompt_tokens") or 0 for r in recs]
            cached = [r.get("cached_tokens") or 0 for r in recs]
            done = s["requests"] - s["failed"]  # SGLang's tiers, each a share of the prompt tokens
            by_tier = {k: v * done / max(1, sum(prompt))
                       for k, v in s.pop("cached_by_tier_mean", {}).items()}
            shape = run.get("serving", {}).get(name, {}).get("shape", {})
            rows.append({"config": run["config"], "medium": run.get("medium"), "phase": name,
                         "zipf_alpha": shape.get("zipf"), **s,
                         "token_hit_rate": sum(cached) / max(1, sum(prompt)), "tier_hit_rate": by_tier,
                         "requests_with_hit": sum(c > p / 2 for c, p in zip(cached, prompt)) / max(1, len(recs)),
                         "working_set_gb": run.get("capacity_working_set_gb"),
                         "host_pool_gb": run.get("host_pool_gb"),
                         "dram_page_share_run": _dram_page_share(run)})
    return rows


def serving_rows(runs: list) -> list:
    """Per configuration run with bench_serving (--client bench-serving): the first request on an
    empty store (warm's first), the first restore after the start (reuse's first) and the later
    ones (median), bench_serving's own reuse TTFT mean / p50 / p99, whether every reuse request got
    its page-aligned prompt cached, and the rate sweep's highest rate under the SLO."""
    rows = []
    for run in runs:
        bs = run.get("serving")
        if not bs:
            continue
        warm = run.get("phases", {}).get("warm", [])
        reuse = run.get("phases", {}).get("reuse", [])
        later = [r["ttft_s"] for r in reuse[1:] if r.get("ttft_s") is not None]
        rs = bs.get("reuse", {})
        sweep = run.get("rate_sweep") or {}
        rows.append({"config": run["config"], "medium": run.get("medium"),
                     "warm_first_ms": warm[0]["ttft_s"] * 1e3 if warm and warm[0].get("ttft_s") else None,
                     "reuse_first_ms": reuse[0]["ttft_s"] * 1e3 if reuse and reuse[0].get("ttft_s") else None,
                     "reuse_later_p50_ms": float(np.median(later)) * 1e3 if later else None,
                     "reuse_mean_ms": rs.get("mean_ttft_ms"), "reuse_p50_ms": rs.get("median_ttft_ms"),
                     "reuse_p99_ms": rs.get("p99_ttft_ms"),
                     "whole_hits": sum((r.get("cached_tokens") or 0) >= r.get("cached", 0) for r in reuse),
                     "reuse_requests": len(reuse),
                     "cache_hit_pct": (rs.get("cache_report") or {}).get("cache_hit_rate_pct"),
                     "rates": sweep.get("mean_ttft_s", {}),
                     "highest_rate": sweep.get("highest_rate_under_slo"), "slo_s": sweep.get("slo_s")})
    return rows


def identity_rows(runs: list) -> list:
    """Per run with an identity phase (--identity-restart): what changed, and the prompt tokens the
    restarted server still found cached (by tier); any is a store read across identities."""
    rows = []
    for run in runs:
        ident = run.get("identity")
        if not ident:
            continue
        changed = ", ".join(f"{k.lstrip('-')} {v}" for k, v in ident["changed"].items())
        before = {"--kv-cache-dtype": run.get("kv_cache_dtype"), "--page-size": run.get("page_size")}
        rows.append({"config": run["config"], "medium": run.get("medium"),
                     "written": ", ".join(f"{k.lstrip('-')} {before.get(k)}" for k in ident["changed"]),
                     "read": changed, "requests": ident["requests"], "failed": ident.get("failed", 0),
                     "prompt_tokens": ident["prompt_tokens"], "cached_tokens": ident["cached_tokens"],
                     "cached_by_tier": ident.get("cached_by_tier", {}),
                     "misses": ident["cached_tokens"] == 0})
    return rows


def baseline_rows(runs: list, reference: str = "lmcache-dram", prefix: str = "lmcache-") -> list:
    """tutti against each baseline run (configurations named `prefix`*, the paper's LMCache ones),
    from the bench_serving rate sweeps: the rate where `reference` last met the SLO (the paper's
    comparison point; a baseline's own where the reference has none), the mean TTFT there of the
    baseline and of tutti's best configuration at that rate (the tutti-* run with the lowest),
    baseline / tutti, and the ratio of the highest rates under the SLO (tutti's best / the
    baseline's; None where either has none). A sweep that never reached the SLO (out of rates or
    of time) gives a lower bound only: `*_slo_rate_bound` says so, and the rate ratio is then a
    lower bound (tutti's) or an upper one (the baseline's). A baseline over the SLO at its lowest
    rate has no highest rate, only one it is below (`baseline_below_rate`): the rate ratio is then
    more than tutti's rate over that one. Where the baseline has no point at the comparison rate
    (its sweep stopped below it), both are compared at its nearest rate below (else its lowest).
    Runs on another medium are compared per medium."""
    def sweep(run):
        s = run.get("rate_sweep") or {}
        return {float(r): t for r, t in s.get("mean_ttft_s", {}).items()}, s.get("highest_rate_under_slo")

    def unbroken(run):  # every point under the SLO: the breaking point was not reached
        s = run.get("rate_sweep") or {}
        return all(t is not None and t < s.get("slo_s", 1.0) for t in s.get("mean_ttft_s", {}).values())

    rows = []
    for medium in sorted({r.get("medium") or "" for r in runs}):
        here = [r for r in runs if (r.get("medium") or "") == medium and r.get("rate_sweep")]
        ours = [r for r in here if r["config"].startswith("tutti-")]
        ref = next((r for r in here if r["config"] == reference), None)
        ref_rate = sweep(ref)[1] if ref else None
        # the highest rate; between equals, a sweep that never broke (its rate may be higher still)
        best_run = max((r for r in ours if sweep(r)[1] is not None), key=lambda r: (sweep(r)[1], unbroken(r)),
                       default=None)
        ours_best = sweep(best_run)[1] if best_run else None
        for base in (r for r in here if r["config"].startswith(prefix)):
            points, best = sweep(base)
            at = ref_rate if ref_rate is not None else best
            if points and (at is None or at not in points):  # its sweep stopped short of that rate
                below = [r for r in points if r <= at] if at is not None else []
                at = max(below) if below else min(points)
            below_rate = min(points) if best is None and points else None
            cands = [(sweep(r)[0].get(at), r) for r in ours] if at is not None else []
            cands = [(t, r) for t, r in cands if t is not None]
            t_ours, mine = min(cands, key=lambda c: c[0]) if cands else (None, None)
            t_base = points.get(at) if at is not None else None
            rows.append({"medium": medium, "baseline": base["config"], "at_rate": at,
                         "baseline_ttft_s": t_base, "tutti": mine["config"] if mine else None,
                         "tutti_ttft_s": t_ours,
                         "ttft_ratio": t_base / t_ours if t_base is not None and t_ours else None,
                         "baseline_slo_rate": best, "tutti_slo_rate": ours_best,
                         "baseline_slo_rate_bound": unbroken(base), "baseline_below_rate": below_rate,
                         "tutti_slo_rate_bound": bool(best_run) and unbroken(best_run),
                         "rate_ratio": (ours_best / best if best else ours_best / below_rate if below_rate
                                        else None) if ours_best is not None else None})
    return rows


def _bound(row: dict, who: str) -> str:
    return ">=" if row[f"{who}_slo_rate_bound"] and row[f"{who}_slo_rate"] is not None else ""


def _rate_ratio(row: dict) -> str:
    """The ratio, marked where a sweep stopped short of its breaking point."""
    if row["rate_ratio"] is None:
        return "-"
    if row.get("baseline_below_rate"):  # the baseline's rate is under its lowest one
        return f">{row['rate_ratio']:.2f}"
    ours_short, theirs_short = row["tutti_slo_rate_bound"], row["baseline_slo_rate_bound"]
    if ours_short and theirs_short:
        return "unknown (both sweeps stopped short)"
    mark = ">=" if ours_short else "<=" if theirs_short else ""
    return f"{mark}{row['rate_ratio']:.2f}"


def _f(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def _table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def _outputs(runs: list, refs: list = (), tol: float = LOGPROB_TOL) -> dict:
    """e2e.outputs_vs over runs with refs (recompute runs of an earlier call, --reference) beside
    them; a run whose requests found no recompute output there keeps the check stored in its JSON
    ("outputs_vs_recompute", made when the call had its reference), so a report rebuilt from the
    JSON alone still shows it."""
    eq = outputs_vs([*runs, *refs], tol=tol)
    for run in runs:
        key = run_key(run)
        stored = run.get("outputs_vs_recompute")
        if stored and not any(row["compared"] for row in eq.get(key, {}).values()):
            eq[key] = stored
    return eq


def output_rows(runs: list, tol: float = LOGPROB_TOL, refs: list = ()) -> list:
    """One row per configuration, medium and phase with requests compared against recompute's
    (e2e.outputs_vs: greedy ids, and top-k logprobs within tol)."""
    eq, rows, seen = _outputs(runs, refs, tol), [], set()
    for run in runs:
        key = run_key(run)
        if key in seen:
            continue
        seen.add(key)
        rows += [{"config": run["config"], "medium": run.get("medium", ""), "model": model_label(run),
                  "phase": phase, **row} for phase, row in eq.get(key, {}).items() if row["compared"]]
    return rows


def control_rows(runs: list, tol: float = LOGPROB_TOL, refs: list = ()) -> list:
    """Per +misplace run (its "misplaced" record): the requests that restore the misplaced page
    and were compared, how many of them differ from recompute (all must: "caught"), and how many
    other requests differ."""
    eq = _outputs(runs, refs, tol)
    answered = set().union(*(_answered(run) for run in [*runs, *refs] if run.get("config") == "recompute"))
    rows = []
    for run in runs:
        m = run.get("misplaced")
        if m is None:
            continue
        per = eq.get(run_key(run), {})
        bad = {i for row in per.values() for i in row["mismatches"]}
        both = _answered(run) & answered
        affected = [i for i in m.get("affected", []) if i in both]
        caught = sum(i in bad for i in affected)
        rows.append({"config": run["config"], "medium": run.get("medium"), "error": m.get("error"),
                     "what": f"page {m.get('page')} of C={m.get('context')} documents 0 and 1 swapped"
                             f" ({m.get('verified', 0)}/{len(m.get('namespaces', []))} verified)",
                     "affected": len(affected), "caught": caught,
                     "other_mismatches": len(bad - set(affected)),
                     "verdict": "did not run" if m.get("error") or not m.get("swapped") else
                     "no recompute outputs to compare" if not answered else
                     ("caught" if affected and caught == len(affected) else "NOT caught")})
    return rows


def _answered(run: dict) -> set:
    """Ids of a run's requests with an output (those outputs_vs can compare)."""
    return {r["id"] for recs in run.get("phases", {}).values() for r in recs if r.get("output_ids") is not None}


def _ids(ids: list, n: int = 4) -> str:
    return ", ".join(ids[:n]) + (f" (+{len(ids) - n} more)" if len(ids) > n else "") if ids else "-"


def report_markdown(runs: list, bpt: int, slo_ms: float = 1000.0, tol: float = LOGPROB_TOL,
                    refs: list = ()) -> str:
    """Every table of the e2e section: sweep, rates + SLO, capacity, first request, outputs.
    refs: recompute runs from an earlier call (--reference), for the output check only."""
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
    bs = serving_rows(runs)
    if bs:
        rts = sorted({float(r) for row in bs for r in row["rates"]})
        parts += ["### bench_serving phases: first requests, reuse after a restart (TTFT ms), rate sweep "
                  "(mean TTFT s per req/s)", _table(
                      ["medium", "config", "first on an empty store", "first restore after start",
                       "later restores p50", "reuse mean / p50 / p99", "whole page-aligned hits",
                       "cache hit %"] + [f"{r:g}/s" for r in rts] + ["highest rate under the SLO"],
                      [[r["medium"], r["config"], _f(r["warm_first_ms"]), _f(r["reuse_first_ms"]),
                        _f(r["reuse_later_p50_ms"]),
                        f"{_f(r['reuse_mean_ms'])} / {_f(r['reuse_p50_ms'])} / {_f(r['reuse_p99_ms'])}",
                        f"{r['whole_hits']}/{r['reuse_requests']}", _f(r["cache_hit_pct"], ".1f")] +
                       [_f(r["rates"].get(f"{x:g}"), ".2f") for x in rts] + [_f(r["highest_rate"], "g")]
                       for r in bs])]
    base = baseline_rows(runs)
    if base:
        parts += ["### tutti against the paper's baselines (bench_serving rate sweeps; at the rate where "
                  "lmcache-dram last met the SLO, or the baseline's nearest measured rate below it)", _table(
                      ["medium", "baseline", "at req/s", "baseline mean TTFT s", "tutti's best there",
                       "its mean TTFT s", "baseline / tutti", "highest rate under the SLO: baseline / tutti",
                       "rate ratio (tutti / baseline)"],
                      [[r["medium"], r["baseline"], _f(r["at_rate"], "g"), _f(r["baseline_ttft_s"], ".2f"),
                        r["tutti"] or "-", _f(r["tutti_ttft_s"], ".2f"), _f(r["ttft_ratio"], ".2f"),
                        (f"<{r['baseline_below_rate']:g}" if r.get("baseline_below_rate") else
                         f"{_bound(r, 'baseline')}{_f(r['baseline_slo_rate'], 'g')}") + " / "
                        f"{_bound(r, 'tutti')}{_f(r['tutti_slo_rate'], 'g')}",
                        _rate_ratio(r)] for r in base])]
    ident = identity_rows(runs)
    if ident:
        parts += ["### Identity: the store read after a restart with other settings (must miss)", _table(
            ["medium", "config", "store written with", "read with", "requests (failed)",
             "prompt tokens cached / sent", "by tier", "verdict"],
            [[r["medium"], r["config"], r["written"], r["read"], f"{r['requests']} ({r['failed']})",
              f"{r['cached_tokens']} / {r['prompt_tokens']}",
              ", ".join(f"{k} {v}" for k, v in r["cached_by_tier"].items()) or "-",
              "all misses" if r["misses"] else "**read across identities**"] for r in ident])]
    parts += ["### Capacity phase (working set larger than the DRAM tier)", _table(
        ["medium", "config", "Zipf alpha", "TTFT mean / p50 / p99 ms", "token hit rate",
         "of it: device / host / storage", "requests with half the prompt cached", "working set GB",
         "host pool GB", "loaded pages from tutti's DRAM tier (whole run)"],
        [[r["medium"], r["config"], _f(r["zipf_alpha"], "g"),
          f"{_f(r['ttft_mean_ms'])} / {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])}",
          _f(r["token_hit_rate"], ".2f"),
          " / ".join(_f(r["tier_hit_rate"].get(k), ".2f") for k in ("device", "host", "storage")),
          _f(r["requests_with_hit"], ".2f"), _f(r["working_set_gb"], ".1f"),
          _f(r["host_pool_gb"], ".1f"), _f(r["dram_page_share_run"], ".2f")] for r in capacity_rows(runs)])]
    eq = _outputs(runs, refs, tol)
    models = len({model_label(run) for run in runs}) > 1  # several models: a column says whose row
    head = ["model"] if models else []
    parts += ["### Per configuration", _table(
        head + ["medium", "config", "first request after start ms",
                "restore GB/s over whole load spans, paced ones too (raw; raw in the linker's requests)",
                "pages loaded / copied from pages just restored (whole run)", "server starts s",
                "outputs = recompute (sequential phases)", "outputs = recompute (concurrent phases)"],
        [[model_label(run)] * models + _config_row(run, eq.get(run_key(run), {})) for run in runs])]
    outs = output_rows(runs, tol, refs)
    if outs:
        parts += [f"### Outputs against the same prompt recomputed (greedy ids; top-k logprobs within {tol:g})",
                  _table(head + ["medium", "config", "phase", "compared", "equal", "compared on logprobs",
                                 "max logprob difference", "mismatching requests"],
                         [[r["model"]] * models + [r["medium"], r["config"], r["phase"], r["compared"], r["equal"],
                                                   r["with_logprobs"], _f(r["max_logprob_diff"], ".2g"),
                                                   _ids(r["mismatches"])] for r in outs])]
    ctl = control_rows(runs, tol, refs)
    if ctl:
        parts += ["### Negative control: a misplaced page (+misplace; each request that restores it must differ)",
                  _table(["medium", "config", "what", "restoring requests compared", "of them differing",
                          "other requests differing", "verdict"],
                         [[r["medium"], r["config"], r["error"] or r["what"], r["affected"], r["caught"],
                           r["other_mismatches"], r["verdict"]] for r in ctl])]
    tl = timeline_rows(runs)
    if tl:
        parts += ["### Where the loads' time went (tutti_timeline_file; medians over each "
                  "configuration's loads, ms from the load's start)", _table(
                      ["medium", "config", "loads", "GB/s over the reads", "reads done", "last layer handed over",
                       "reaction p50", "forward inside wait_until", "finish returned"],
                      [[r["medium"], r["config"], r["loads"], _f(r["read_GBps"], ".2f"), _f(r["reads_ms"], ".1f"),
                        _f(r["handed_ms"], ".1f"), _f(r["react_ms_p50"], ".2f"),
                        _f(r["forward_wait_ms"], ".1f"), _f(r["finish_ms"], ".1f")] for r in tl])]
    hr = host_restore_rows(runs)
    if hr:
        parts += ["### The host tier's restores (tutti_timeline_file: its get calls grouped per restore; "
                  "exists to get = SGLang's hit query to its first read, ms)", _table(
                      ["medium", "config", "restores", "first: ms / pages / GB/s / exists to get",
                       "later p50: ms / GB/s / exists to get",
                       "inside tutti's gets, ms: first / later p50 (the rest is SGLang's between them)",
                       "set calls during restores", "exists calls: p50 / max ms"],
                      [[r["medium"], r["config"], r["restores"],
                        f"{_f(r['first_ms'], '.1f')} / {r['first_pages']} / {_f(r['first_GBps'], '.2f')} / "
                        f"{_f(r['first_exists_to_get_ms'], '.1f')}",
                        f"{_f(r['later_ms'], '.1f')} / {_f(r['later_GBps'], '.2f')} / {_f(r['later_exists_to_get_ms'], '.1f')}",
                        f"{_f(r['first_in_calls_ms'], '.1f')} / {_f(r['later_in_calls_ms'], '.1f')}",
                        r["sets_during"],
                        f"{_f(r['exists_p50_ms'], '.2f')} / {_f(r['exists_max_ms'], '.2f')}"] for r in hr])]
    hs = host_split_rows(runs)
    if hs:
        parts += ["### The host tier's TTFT around its reads (client clock joined with its timeline; ms)", _table(
            ["medium", "config", "request", "TTFT", "pages read", "send to SGLang's hit query",
             "hit query to the first read", "reads", "reads' return to the first token"],
            [[r["medium"], r["config"], r["id"], _f(r["ttft_ms"]), r["pages"], _f(r["before_ms"], ".1f"),
              _f(r["queue_ms"], ".1f"), _f(r["reads_ms"], ".1f"), _f(r["after_ms"], ".1f")] for r in hs])]
    split = split_rows(runs, bpt)
    if split:
        parts += ["### The sweep's TTFT around its load (client clock joined with the timeline's; ms)", _table(
            ["medium", "config", "C", "h", "TTFT", "compute-only twin's TTFT", "before the load",
             "of which before the linker's lookup", "load", "of which reads",
             "after the load", "of which until SGLang's first offload", "I/O floor + before + after (I/O-bound rows only)", "TTFT / that",
             "GPU begins layer 0 / the last layer (ms after the load's start)",
             "forward's stream idle for KV: layer 0 / all layers",
             "layers' compute (all but the last): this / its twin's"],
            [[r["medium"], r["config"], r["context"], f"{r['h']:g}", _cell(r), _f(r.get("twin_ms")),
              _f(r["before_ms"], ".1f"), _f(r.get("to_lookup_ms"), ".1f"), _f(r["load_ms"], ".1f"), _f(r["reads_ms"], ".1f"), _f(r["after_ms"], ".1f"), _f(r.get("to_offload_ms"), ".1f"), _f(r["floor_ms"]),
              _f(r["ttft_ms"] / r["floor_ms"] if r["floor_ms"] else None, ".2f"),
              f"{_f(r.get('gpu_layer0_ms'), '.1f')} / {_f(r.get('gpu_last_layer_ms'), '.1f')}",
              f"{_f(r.get('stream_stall_first_ms'), '.1f')} / {_f(r.get('stream_stall_ms'), '.1f')}",
              f"{_f(r.get('layers_compute_ms'), '.1f')} / {_f(r.get('next_bare_compute_ms'), '.1f')}"]
             for r in split])]
    cut = ended_early_rows(runs)
    if cut:
        parts += ["### Configurations that ended early (the harness's record of why)", _table(
            ["medium", "config", "error", "lowest host memory available, GiB (phase)"],
            [[r["medium"], r["config"], r["error"], r["host_low"]] for r in cut])]
    return "\n\n".join(parts)


def ended_early_rows(runs: list) -> list:
    """Runs with an error (a server that died, the host-memory guard's kill, a daemon that did
    not start), each with the lowest MemAvailable its phases saw (hostmem.py)."""
    rows = []
    for run in runs:
        if not run.get("error"):
            continue
        lows = {p: v for p, v in (run.get("host_available_low_gb") or {}).items() if v is not None}
        low = min(lows.items(), key=lambda kv: kv[1]) if lows else None
        rows.append({"medium": run.get("medium"), "config": run["config"], "error": str(run["error"])[:300],
                     "host_low": f"{low[1]:g} ({low[0]})" if low else "-"})
    return rows


def host_restore_rows(runs: list) -> list:
    """Per run with host-tier timeline records (run["host_calls"], timeline.host_summary): its
    restores, the first one's time, pages, rate and SGLang's delay from hit query to read, and
    the medians of the later ones (None where there is one restore only)."""
    rows = []
    for run in runs:
        hc = run.get("host_calls") or {}
        rs = hc.get("restores") or []
        if not rs:
            continue
        later = rs[1:]

        def med(key):
            vals = [r[key] for r in later if r.get(key) is not None]
            return float(np.median(vals)) if vals else None
        ex = hc.get("exists") or {}
        rows.append({"medium": run.get("medium"), "config": run["config"], "restores": len(rs),
                     "first_ms": rs[0]["ms"], "first_pages": rs[0]["pages"], "first_GBps": rs[0]["GBps"],
                     "first_exists_to_get_ms": rs[0]["exists_to_get_ms"],
                     "first_in_calls_ms": rs[0].get("in_calls_ms"), "later_in_calls_ms": med("in_calls_ms"),
                     "sets_during": sum(r.get("sets_during") or 0 for r in rs), "later_ms": med("ms"),
                     "later_GBps": med("GBps"), "later_exists_to_get_ms": med("exists_to_get_ms"),
                     "exists_p50_ms": ex.get("ms_p50"), "exists_max_ms": ex.get("ms_max")})
    return rows


def host_split_rows(runs: list) -> list:
    """The host tier's TTFT around its reads, per request of the harness's own client (send and
    first-token times on CLOCK_MONOTONIC, as split_rows) joined with the restore whose first get
    entered between them (run["host_calls"]): before = send to SGLang's hit query (HTTP, tokens,
    scheduling, prefix match), queue = the hit query to the first read (SGLang's prefetch
    threads), reads = the restore's gets, after = their return to the first token (SGLang moving
    the prefix to the GPU, the forward, the response)."""
    out = []
    for run in runs:
        restores = [r for r in (run.get("host_calls") or {}).get("restores") or [] if r.get("t0_ns")]
        if not restores:
            continue
        for phase in ("first", "reuse", "sweep"):
            for q in run.get("phases", {}).get(phase, []):
                sent, first = q.get("sent_ns"), q.get("first_token_ns")
                if not sent or not first:
                    continue
                r = next((x for x in restores if sent <= x["t0_ns"] <= first), None)
                if r is None:
                    continue
                asked = r["exists_ns"] if r.get("exists_ns") and sent <= r["exists_ns"] <= r["t0_ns"] else None
                out.append({"medium": run.get("medium"), "config": run["config"], "id": q["id"],
                            "ttft_ms": (first - sent) / 1e6, "pages": r["pages"],
                            "before_ms": (asked - sent) / 1e6 if asked else None,
                            "queue_ms": (r["t0_ns"] - asked) / 1e6 if asked else None,
                            "reads_ms": r["ms"], "after_ms": (first - r["t1_ns"]) / 1e6})
    return out


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
        raw, run_bytes = run.get("raw_read_GBps"), run_bpt(run, bpt)
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
                   "after_ms": (first - load["finish_ns"]) / 1e6, "floor_ms": None, "hit_share": hit_share(r),
                   "twin_ms": twins[r["id"]] * 1e3 if twins.get(r["id"]) else None,
                   "to_lookup_ms": (load["lookup_ns"] - sent) / 1e6
                   if sent <= load.get("lookup_ns", 0) <= load["start_ns"] else None,
                   "to_offload_ms": (load["offload_ns"] - load["finish_ns"]) / 1e6
                   if load["finish_ns"] <= load.get("offload_ns", 0) <= first else None,
                   **{k: load.get(k) for k in ("stream_stall_first_ms", "stream_stall_ms",
                                                "layers_compute_ms", "next_bare_compute_ms",
                                                "gpu_layer0_ms", "gpu_last_layer_ms")}}
            io = io_floor_s(r, raw, run_bytes)
            if io is not None and (row["twin_ms"] is None or io * 1e3 >= row["twin_ms"]):  # I/O-bound rows
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
    phases = run.get("phases", {})  # bench_serving's runs: the reuse phase's first request
    first = (phases.get("first") or phases.get("reuse") or [{}])[0].get("ttft_s")
    seq = [v for p, v in eq.items() if not p.startswith("rate")]
    conc = [v for p, v in eq.items() if p.startswith("rate")]

    def frac(vals):
        n = sum(v["compared"] for v in vals)
        diffs = [v["max_logprob_diff"] for v in vals if v["max_logprob_diff"] is not None]
        worst = f", max logprob diff {max(diffs):.2g}" if diffs else ""
        return f"{sum(v['equal'] for v in vals)}/{n}{worst}" if n else "-"
    restore = run.get("restore_GBps")
    raw = run.get("raw_read_GBps")
    l2 = (run.get("lmcache_prefetches") or {}).get("l2_GBps")  # LMCache's L2 -> L1 prefetches
    l2 = f", L2 prefetch {l2:.2f}" if l2 else ""
    req, req_raw = run.get("raw_request_bytes"), run.get("raw_request_GBps")
    at_req = f"; {_f(req_raw, '.2f')} in {req >> 10} KiB" if req and req_raw else ""
    return [run.get("medium"), run["config"], _f(first * 1e3 if first else None),
            f"{_f(restore, '.2f')}{l2} ({_f(raw, '.2f')}{at_req})", _loaded_copied(run),
            "/".join(f"{s:.0f}" for s in run.get("start_s", [])), frac(seq), frac(conc)]


def _loaded_copied(run: dict) -> str:
    """The linker's pages loaded (from the SSD or its DRAM tier) and copied in the pool from pages
    it had just restored (loader.py) over the run's server starts; "-" without linker stats."""
    lk = [s["linker"] for s in run.get("tutti_stats", []) if "load_pages" in s.get("linker", {})]
    if not lk:
        return "-"
    return f"{sum(x['load_pages'] for x in lk)} / {sum(x.get('load_copied_pages', 0) for x in lk)}"
