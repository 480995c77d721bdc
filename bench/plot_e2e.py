"""Table (markdown) and PNG of the end-to-end server runs (e2e_sglang.py JSON files).

For each medium and configuration: cold-phase TTFT (after a server restart and a page-cache drop,
so prefix hits can only come from the storage tier), the same prompts as L1 hits in the first
server (reference), cached tokens per request, restore bandwidth vs the medium's raw O_DIRECT
read, and whether the greedy outputs equal the L1-hit run's.

    python bench/plot_e2e.py OUT.png run.json [run.json ...]   # prints the markdown table
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths):
    out = []
    for p in paths:
        with open(p) as f:
            out += [r for r in json.load(f) if "cold" in r]
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(runs) -> str:
    lines = ["| medium | config | cold TTFT mean / p50 / p99 ms | L1-hit TTFT ms | cached tokens / request "
             "| restore GB/s (raw) | outputs = L1 run | server start s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        c = r["cold"]
        restore = r.get("restore_GBps")
        raw = r.get("raw_read_GBps")
        bw = f"{restore:.2f} ({raw:.2f})" if restore else f"- ({raw:.2f})"
        eq = r.get("outputs_equal_count")
        eq = "-" if eq is None else f"{eq}/{len(r['cold_outputs'])}"
        starts = "/".join(f"{r[k]:.0f}" for k in ("warm_start_s", "cold_start_s") if k in r)
        lines.append(f"| {r['medium']} | {r['config']} | {c['ttft_mean_ms']:.0f} / {c['ttft_p50_ms']:.0f} / "
                     f"{c['ttft_p99_ms']:.0f} | {fmt(r.get('l1_ref', {}).get('ttft_mean_ms'), '.0f')} | "
                     f"{c['cached_tokens_mean']:.0f} | {bw} | {eq} | {starts} |")
    return "\n".join(lines)


def main(out, *paths):
    runs = load(paths)
    print(table(runs))
    media = sorted({r["medium"] for r in runs})
    fig, axes = plt.subplots(1, len(media), figsize=(5.5 * len(media), 4.2), squeeze=False)
    for ax, m in zip(axes[0], media):
        sel = [r for r in runs if r["medium"] == m]
        names = [r["config"] for r in sel]
        mean = [r["cold"]["ttft_mean_ms"] for r in sel]
        p99 = [r["cold"]["ttft_p99_ms"] for r in sel]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], mean, 0.4, label="mean")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("TTFT after restart + page-cache drop (ms)")
        ax.set_title(f"medium {m}")
        ax.legend()
    fig.suptitle("SGLang 0.5.17 server on H200, 8-layer Llama-3-8B-width model, 16K-token prefixes (plugin smoke: 8K)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
