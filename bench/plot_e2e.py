"""Tables (markdown, printed) and PNG plots of end-to-end server runs (bench/e2e_sglang.py JSON files).

    python bench/plot_e2e.py OUTDIR run.json [run.json ...]
      OUTDIR/e2e_sweep.png     TTFT vs hit fraction per context, one line per configuration
      OUTDIR/e2e_rates.png     mean TTFT vs request rate, with the 1 s SLO line
      OUTDIR/e2e_capacity.png  capacity phase: mean TTFT and hit rate per configuration
Several files are merged (one call of the GPU machine each); a configuration measured twice keeps
the last run, plus the rate points of earlier calls on the same shape that it lacks
(e2e_report.merge_runs). The tables are tutti_hicache.benchmarks.e2e_report.report_markdown's; without
matplotlib they are printed and the plots skipped.
"""
import json
import os
import sys

from tutti_hicache.benchmarks import e2e, e2e_report

try:  # the tables need only the package; the plots need matplotlib
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None


def load(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
            runs += [r for r in (data.get("runs", []) if isinstance(data, dict) else data) if "phases" in r]
    return e2e_report.merge_runs(runs)


def plot_sweep(rows, out):
    ctxs = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, c in zip(axes[0], ctxs):
        for cfg in sorted({r["config"] for r in rows}):
            pts = sorted((r["h"], r["ttft_ms"]) for r in rows if r["context"] == c and r["config"] == cfg)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg)
        floor = sorted((r["h"], r["compute_ms"]) for r in rows if r["context"] == c
                       and r["config"] == "tutti-linker" and r["compute_ms"])
        if floor:  # the same prompts with their prefix already in device memory
            ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", lw=1, label="compute only")
        ax.set_title(f"{c // 1024}K-token prompts")
        ax.set_xlabel("cached share of the prompt (h)")
        ax.set_ylabel("TTFT ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_rates(slo, out, slo_ms=1000.0):
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in slo:
        rates = sorted(row["rates"])
        ax.plot(rates, [row["rates"][r].get("ttft_mean_ms") for r in rates], marker="o", label=row["config"])
    ax.axhline(slo_ms, color="k", ls="--", lw=1, label="SLO")
    ax.set_xlabel("requests / s")
    ax.set_ylabel("mean TTFT ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_capacity(rows, out):
    fig, ax = plt.subplots(figsize=(5, 4))
    names = [r["config"] for r in rows]
    ax.bar(names, [r["ttft_mean_ms"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["ttft_mean_ms"], f"hit {r['token_hit_rate']:.0%}", ha="center", va="bottom")
    ax.set_ylabel("mean TTFT ms")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(outdir, *paths):
    runs = load(paths)
    layers = max((r.get("layers", 8) for r in runs), default=8)
    bpt = e2e.bytes_per_token(layers)
    print(e2e_report.report_markdown(runs, bpt))
    if plt is None:
        print("(no plots: matplotlib is not installed; pip install matplotlib)", file=sys.stderr)
        return
    os.makedirs(outdir, exist_ok=True)
    rows = e2e_report.sweep_rows(runs, bpt)
    if rows:
        plot_sweep(rows, os.path.join(outdir, "e2e_sweep.png"))
    slo = e2e_report.slo_rows(runs)
    if slo:
        plot_rates(slo, os.path.join(outdir, "e2e_rates.png"))
    cap = e2e_report.capacity_rows(runs)
    if cap:
        plot_capacity(cap, os.path.join(outdir, "e2e_capacity.png"))


if __name__ == "__main__":
    main(*sys.argv[1:])
