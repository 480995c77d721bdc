"""PNG of the prefill benchmark: TTFT vs cached fraction h per configuration (bench_prefill JSON).

    python bench/plot_prefill.py OUT.png run.json [run.json ...]
"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(paths):
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        yield from r["results"]
        for medium in r["media"].values():
            yield from medium["runs"]


def main(out, *paths):
    series = defaultdict(dict)
    for r in rows(paths):
        config = r["config"] + (f" read-ahead {r['read_ahead']}" if "read_ahead" in r else "")
        series[(r["C"], config)][r["h"]] = r["ttft_s"]
    contexts = sorted({c for c, _ in series})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        for (cc, config), pts in sorted(series.items()):
            if cc == c:
                hs = sorted(pts)
                ax.plot(hs, [pts[h] for h in hs], marker="o", label=config)
        ax.set_title(f"Llama-3-8B shape, context {c // 1024}K (H200)")
        ax.set_xlabel("cached prefix fraction h")
        ax.set_ylabel("TTFT (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
