"""Where a layer-wise restore's time goes, from a `tutti_timeline_file` (layerwise/timeline.py).

    python -m tutti_hicache.benchmarks.timeline FILE [FILE ...]     one row per load

At a glance:
    read(paths) -> [record]         every JSON line of the files (unreadable lines skipped)
    summarize(record) -> dict       milliseconds from the load's start (LayerwiseKV.start):
        reads_ms          the last staging chunk's reads final (the I/O span)
        first_read_ms     the first chunk's
        lookup_ms, lookup_took_ms   the linker's last lookup before the start (negative)
                          and its duration; lookup_ns its entry
        begin_ms, opened_ms   the loader thread took the batch; its read stream was open (the
                          part of first_read_ms before any read was at the devices)
        handed_ms         the last layer handed to the forward
        react_ms_p50/max  per layer: handed to the forward minus its last chunk's reads final
                          (the loader's reaction)
        forward_start_ms  the forward's first wait_until (it reached layer 0's attention)
        forward_wait_ms   the forward's time inside wait_until, summed over the layers
        forward_end_ms    the return of its last wait_until
        finish_ms, finish_wait_ms   finish_layer_wise_loading's return, and its time inside
        start_ns, finish_ns         the load's start and finish_layer_wise_loading's return, in
                          CLOCK_MONOTONIC ns (a client on the same machine joins them with its
                          requests' send and first-token times: e2e_report.split_rows)
        from the forward's own record (layerwise/windows.LayerTimes.report; on a GPU, CUDA event
        times on the forward's stream, so what the GPU did, not what the CPU waited for):
        stream_stall_first_ms   the stream idle before layer 0's KV landed (the load's fill)
        stream_stall_ms   the same summed over the layers (the forward's real bubble)
        layers_compute_ms layer 0's KV landed -> the last layer reached, waits excluded (the
                          compute of every layer but the last, under the load's copies)
        forward_clock     "gpu" or "host" (CPU forwards: host clocks)
        gpu_layer0_ms, gpu_last_layer_ms   when the GPU began layer 0's and the last layer's
                          compute (their KV landed), from the forward record's host anchor
        next_bare_compute_ms  the same for the longest forward without a load between this
                          load and the next (a benchmark's compute-only twin)
    table(records) -> markdown
The host tier's records in the same file (storage.py: one per exists/get/set call):
    host_calls(paths) -> [call]     those records, by entry time
    host_restores(calls, page_bytes) -> [restore]   the gets grouped into restores (a run of gets
                          each entered within HOST_GAP_MS of the last one's return): t0_ns,
                          t1_ns (CLOCK_MONOTONIC: a client on the same machine joins them with its
                          requests, e2e_report.host_split_rows), start_ms (from the first call of
                          the files), ms, calls, pages, GBps, exists_ns,
                          exists_to_get_ms: from the entry of the last exists call before it
                          (SGLang's hit query) to its first get (SGLang's prefetch queue),
                          in_calls_ms: the gets' own time summed (ms - in_calls_ms is SGLang's
                          between them), sets_during: set calls overlapping the restore
    host_summary(paths, page_bytes) -> dict   the restores, and the exists and set calls' counts
                          and times ({} without host records)
"""

from __future__ import annotations

import json
import statistics
import sys


def _lines(path: str) -> list:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return [r for r in out if isinstance(r, dict)]


def read(paths) -> list:
    """The loads' records of every file, each with its forward's record (written later, by the
    same process: `forward_of` = the load's `seq`, its number since the counter was made; files
    from before `seq` match on `index` where no index repeats: it restarts at every reset)
    under "forward" when there is one."""
    out = []
    for p in paths:
        lines = _lines(p)
        forwards = {r["forward_of"]: r for r in lines if "forward_of" in r}
        bare = {}
        for r in lines:  # the longest forward without a load between a load and the next: a
            # benchmark's compute-only twin (a prefill; eager decode steps are written too)
            if "bare_after" in r:
                k = r["bare_after"]
                if k not in bare or sum(r["span_ms"]) > sum(bare[k]["span_ms"]):
                    bare[k] = r
        offloads = {r["offload_after"]: r for r in lines if "offload_after" in r}
        loads = [r for r in lines if "start_ns" in r]
        old = [r.get("index") for r in loads if "seq" not in r]
        ambiguous = len(old) != len(set(old))  # a file from before seq, its index reset
        for r in loads:
            key = r.get("seq", r.get("index"))
            if key in forwards and ("seq" in r or not ambiguous):
                r["forward"] = forwards[key]
            if "seq" in r and r["seq"] in bare:
                r["next_bare"] = bare[r["seq"]]
            if "seq" in r and r["seq"] in offloads:  # SGLang's first offload after its finish
                r["offload_ns"] = offloads[r["seq"]]["offload_ns"]
            out.append(r)
    return out


def summarize(rec: dict) -> dict:
    t0 = rec["start_ns"]

    def ms(t):
        return round((t - t0) / 1e6, 3) if t else None

    out = {"index": rec.get("index"), "pages": rec.get("pages"),
           "error": rec.get("error"), "start_ns": t0}
    for key in ("host_pages", "copied_pages"):  # from the DRAM tier; copied in the pool
        if key in rec:
            out[key] = rec[key]
    look = rec.get("lookup_ns") or [0, 0]
    if look[0] and look[1]:  # the linker's lookups before the start (negative: before it)
        out["lookup_ms"], out["lookup_took_ms"] = ms(look[0]), round((look[1] - look[0]) / 1e6, 3)
        out["lookup_ns"] = look[0]
    for key in ("begin", "opened"):  # the loader took the batch; its read stream was open
        if rec.get(f"{key}_ns"):
            out[f"{key}_ms"] = ms(rec[f"{key}_ns"])
    done, layers = rec.get("chunk_done_ns") or [], rec.get("chunk_layers") or []
    if done:
        out["first_read_ms"], out["reads_ms"] = ms(min(done)), ms(max(done))
    complete = rec.get("complete_ns") or []
    if complete and all(complete):
        out["handed_ms"] = ms(max(complete))
        last = {}
        for layer, t in zip(layers, done):
            last[layer] = max(last.get(layer, 0), t)
        react = [(complete[l] - t) / 1e6 for l, t in last.items() if l < len(complete)]
        if react:
            out["react_ms_p50"] = round(statistics.median(react), 3)
            out["react_ms_max"] = round(max(react), 3)
    waits = [w for w in rec.get("wait_ns") or [] if w[0] and w[1]]
    if waits:
        out["forward_start_ms"] = ms(min(w[0] for w in waits))
        out["forward_wait_ms"] = round(sum(w[1] - w[0] for w in waits) / 1e6, 3)
        out["forward_end_ms"] = ms(max(w[1] for w in waits))
    fin = rec.get("finish_ns") or [0, 0]
    if fin[1]:
        out["finish_ms"], out["finish_wait_ms"] = ms(fin[1]), round((fin[1] - fin[0]) / 1e6, 3)
        out["finish_ns"] = fin[1]
    off = rec.get("offload_ns") or [0, 0]
    if off[0]:  # the scheduler's first offload after the finish: the batch's result processed
        out["offload_ms"], out["offload_ns"] = ms(off[0]), off[0]
    fwd = rec.get("forward") or {}
    stall, span = fwd.get("stall_ms") or [], fwd.get("span_ms") or []
    if stall:
        out["stream_stall_first_ms"] = round(stall[0], 3)
        out["stream_stall_ms"] = round(sum(stall), 3)
    if span:
        out["layers_compute_ms"] = round(sum(span), 3)
        out["forward_clock"] = fwd.get("clock")
    if span and stall and fwd.get("last_passed_ns"):  # the forward's GPU times on the host clock
        out["gpu_last_layer_ms"] = ms(fwd["last_passed_ns"])
        out["gpu_layer0_ms"] = round(out["gpu_last_layer_ms"] - sum(span) - sum(stall[1:]), 3)
    nxt = (rec.get("next_bare") or {}).get("span_ms") or []
    if nxt:
        out["next_bare_compute_ms"] = round(sum(nxt), 3)
    return out


HOST_GAP_MS = 50.0  # gets entered within this of the last one's return: one restore


def host_calls(paths) -> list:
    calls = [r for p in paths for r in _lines(p) if "host_op" in r and "t0_ns" in r and "t1_ns" in r]
    return sorted(calls, key=lambda r: r["t0_ns"])


def host_restores(calls: list, page_bytes: int, gap_ms: float = HOST_GAP_MS) -> list:
    if not calls:
        return []
    base = calls[0]["t0_ns"]
    out, cur, last_exists = [], None, None
    for c in calls:
        if c["host_op"] == "exists":
            last_exists = c
            continue
        if c["host_op"] != "get" or not c.get("keys"):
            continue
        if cur is not None and (c["t0_ns"] - cur["t1_ns"]) / 1e6 <= gap_ms:
            cur["t1_ns"] = max(cur["t1_ns"], c["t1_ns"])
            cur["calls"] += 1
            cur["pages"] += c.get("found", 0)
            cur["in_ns"] += c["t1_ns"] - c["t0_ns"]
            continue
        cur = {"t0_ns": c["t0_ns"], "t1_ns": c["t1_ns"], "calls": 1, "pages": c.get("found", 0),
               "in_ns": c["t1_ns"] - c["t0_ns"], "exists_ns": last_exists["t0_ns"] if last_exists else None}
        out.append(cur)
    sets = [c for c in calls if c["host_op"] == "set"]
    rows = []
    for r in out:
        secs = (r["t1_ns"] - r["t0_ns"]) / 1e9
        rows.append({"t0_ns": r["t0_ns"], "t1_ns": r["t1_ns"], "exists_ns": r["exists_ns"],
                     "start_ms": round((r["t0_ns"] - base) / 1e6, 3), "ms": round(secs * 1e3, 3),
                     "in_calls_ms": round(r["in_ns"] / 1e6, 3),
                     "sets_during": sum(s["t0_ns"] < r["t1_ns"] and s["t1_ns"] > r["t0_ns"] for s in sets),
                     "calls": r["calls"], "pages": r["pages"],
                     "GBps": round(r["pages"] * page_bytes / secs / 1e9, 2) if secs > 0 and page_bytes else None,
                     "exists_to_get_ms": round((r["t0_ns"] - r["exists_ns"]) / 1e6, 3) if r["exists_ns"] else None})
    return rows


def host_summary(paths, page_bytes: int) -> dict:
    calls = host_calls(paths)
    if not calls:
        return {}

    def times(op):
        ms = [(c["t1_ns"] - c["t0_ns"]) / 1e6 for c in calls if c["host_op"] == op]
        return {"calls": len(ms), "ms_p50": round(statistics.median(ms), 3) if ms else None,
                "ms_max": round(max(ms), 3) if ms else None, "first_ms": round(ms[0], 3) if ms else None}
    sets = [c for c in calls if c["host_op"] == "set"]
    return {"restores": host_restores(calls, page_bytes), "exists": times("exists"),
            "sets": {**times("set"), "pages": sum(c.get("found", 0) for c in sets)},
            "threads": sorted({c.get("thread", "") for c in calls})}


COLUMNS = ("index", "pages", "begin_ms", "opened_ms", "first_read_ms", "reads_ms", "handed_ms",
           "react_ms_p50", "react_ms_max", "forward_start_ms", "forward_wait_ms", "forward_end_ms", "finish_ms",
           "finish_wait_ms", "stream_stall_first_ms", "stream_stall_ms", "layers_compute_ms", "error")


def table(records: list) -> str:
    rows = [summarize(r) for r in records]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(read(sys.argv[1:])))
