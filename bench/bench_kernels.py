"""Bandwidth of the scatter/gather kernels, and their interference with a compute-bound forward.

Run from the repository root on a GPU (about 2 minutes on an H200):

    python bench/bench_kernels.py --json out.json

``--dry-run`` runs every step with tiny sizes on CPU tensors through Triton's interpreter (a smoke test; its
figures mean nothing). Bandwidth is payload bytes per second (each byte read once and written once, so memory
traffic is twice that), against a device-to-device ``torch`` copy of the same payload in the same run.
The interference test runs Llama-3-8B-sized GEMMs and attention on the default stream while scatter kernels
run back to back on (a) an ordinary stream, (b) a high-priority stream, (c) green-context streams of 8 and 16
SMs from ``tutti_hicache.green``; it reports the compute's slowdown and the scatter bandwidth in each case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

UNITS = {"time_ms": "milliseconds (median; interference: best of 3)", "payload_bytes": "bytes",
         "graph_time_ms": "milliseconds per launch inside one CUDA graph (host launch cost excluded)",
         "graph_bandwidth_GBps": "1e9 payload bytes/s, from graph_time_ms",
         "bandwidth_GBps": "1e9 payload bytes/s", "io_bandwidth_GBps": "1e9 payload bytes/s, during the compute",
         "io_alone_bandwidth_GBps": "1e9 payload bytes/s, same stream without compute",
         "slowdown": "compute time with I/O / compute time alone", "num_sms": "SMs the I/O kernels may use",
         "pages": "KV pages", "layers": "layers", "compute_iters": "compute steps",
         "io_payload_bytes_per_launch": "bytes"}
# name: (MLA?, page_size, KV heads, head dim); bf16
GEOMETRIES = {"llama3-8b": (False, 64, 8, 128), "mla-576": (True, 64, 1, 576)}
TINY = {"llama3-8b": (False, 4, 2, 8), "mla-576": (True, 4, 1, 24)}


def load_kernels():
    """The kernels (the installed package ``tutti_kernels``), imported after TRITON_INTERPRET is set."""
    import tutti_kernels
    return tutti_kernels


REPEATS = 1
GRAPH = False  # --graph: also time every per-layer case inside a CUDA graph


def timed_ms(fn, device) -> float:
    """Median milliseconds of ``fn`` (CUDA: ``triton.testing.do_bench``, L2 flushed; the best of ``REPEATS``
    such medians, since a ~40 us launch is at the mercy of clocks and the L2 flush; CPU: wall clock)."""
    if device.type == "cuda":
        import triton.testing
        return min(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") for _ in range(REPEATS))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def graph_ms(fn, device):
    """Milliseconds per launch with the host out of the loop: launches captured back to back in one CUDA
    graph and replayed (``triton.testing.do_bench_cudagraph``, no L2 flush), best of ``REPEATS`` medians.
    The eager figure of ``timed_ms`` includes whatever part of the launcher's host time the GPU waits for:
    the launchers validate every argument in Python (~45 us of CPU), which for a ~40 us kernel (MLA, 1K
    pages) can leak into the timed window. None on CPU or when capture fails (printed)."""
    if device.type != "cuda" or not GRAPH:
        return None
    import triton.testing
    try:
        return min(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") for _ in range(REPEATS))
    except Exception as e:  # a capture problem must not lose the eager figures
        print(f"graph timing failed: {e!r}")
        return None


class Layer:
    """One layer's pool buffers (NHD, bf16) plus staging for ``n_pages`` pages of it."""

    def __init__(self, geometry, pool_pages, n_pages, device, num_layers=1):
        self.mla, self.page_size, heads, dim = geometry
        shape = (pool_pages * self.page_size, heads, dim)
        per_layer = 1 if self.mla else 2
        self.layers = [[torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(per_layer)]
                       for _ in range(num_layers)]
        self.obj_bytes = self.page_size * heads * dim * 2
        self.payload = n_pages * num_layers * per_layer * self.obj_bytes
        self.staging = torch.randint(0, 256, (self.payload,), dtype=torch.uint8, device=device)
        self.copy_dst = torch.empty_like(self.staging)
        gen = torch.Generator().manual_seed(n_pages)
        self.page_ids = torch.randperm(pool_pages, generator=gen)[:n_pages].to(device)

    def bufs(self, layer=0):
        return self.layers[layer]

    def kv(self, layer=0):
        """(k_buf, v_buf) of a layer; v_buf None for MLA (the kernels' one signature)."""
        bufs = self.layers[layer]
        return bufs[0], None if self.mla else bufs[1]

    def per_layer_lists(self):
        k = [b[0] for b in self.layers]
        return k, None if self.mla else [b[1] for b in self.layers]


def layer_ops(tk, lay):
    """name -> zero-argument callable, for one layer."""
    k, v = lay.kv()
    return {"scatter_layer": lambda: tk.scatter_layer(lay.staging, k, v, lay.page_ids, lay.page_size),
            "gather_layer": lambda: tk.gather_layer(lay.staging, k, v, lay.page_ids, lay.page_size),
            "torch_copy": lambda: lay.copy_dst.copy_(lay.staging)}


def verify_layer(tk, lay) -> bool:
    """Kernel result equals the plain-torch reference on this geometry."""
    layer_ops(tk, lay)["scatter_layer"]()
    ref = [b.clone() for b in lay.bufs()]
    for b in ref:
        b.zero_()
    tk.scatter_layer_ref(lay.staging, ref[0], None if lay.mla else ref[1], lay.page_ids, lay.page_size)
    pages = lay.page_ids.long()
    return all(torch.equal(a.view(torch.int16).view(-1, lay.obj_bytes // 2)[pages],
                           r.view(torch.int16).view(-1, lay.obj_bytes // 2)[pages]) for a, r in zip(lay.bufs(), ref))


def row(geometry, op, pages, payload, ms, graph=None, **extra):
    out = {"geometry": geometry, "op": op, "pages": pages, "payload_bytes": payload, "time_ms": round(ms, 4),
           "bandwidth_GBps": round(payload / ms / 1e6, 1), **extra}
    if graph:
        out.update(graph_time_ms=round(graph, 4), graph_bandwidth_GBps=round(payload / graph / 1e6, 1))
    return out


def bench_layers(tk, device, sizes, geometries):
    rows = []
    for name, geometry in geometries.items():
        for n_pages in sizes:
            lay = Layer(geometry, n_pages + n_pages // 4, n_pages, device)
            ok = verify_layer(tk, lay)
            for op, fn in layer_ops(tk, lay).items():
                rows.append(row(name, op, n_pages, lay.payload, timed_ms(fn, device), graph_ms(fn, device),
                                verified=ok))
    return rows


def bench_pages(tk, device, n_pages, num_layers, geometries):
    """All layers of ``n_pages`` pages: one ``*_pages`` launch against a loop of per-layer launches."""
    rows = []
    for name, geometry in geometries.items():
        lay = Layer(geometry, 2 * n_pages, n_pages, device, num_layers)
        k, v = lay.per_layer_lists()
        args = (lay.staging, k, v)  # v None for MLA
        ops = {"scatter_pages": lambda: tk.scatter_pages(*args, lay.page_ids, lay.page_size),
               "gather_pages": lambda: tk.gather_pages(*args, lay.page_ids, lay.page_size),
               f"scatter_layer x{num_layers}": lambda: scatter_each_layer(tk, lay),
               "torch_copy": lambda: lay.copy_dst.copy_(lay.staging)}
        for op, fn in ops.items():
            rows.append(row(name, op, n_pages, lay.payload, timed_ms(fn, device), layers=num_layers))
    return rows


def scatter_each_layer(tk, lay):
    """The same bytes as one ``scatter_pages`` launch, as one ``scatter_layer`` launch per layer (staging
    layer-major)."""
    per_layer = lay.payload // len(lay.layers)
    for layer in range(len(lay.layers)):
        tk.scatter_layer(lay.staging[layer * per_layer:(layer + 1) * per_layer], *lay.kv(layer),
                         lay.page_ids, lay.page_size)


class Compute:
    """A Llama-3-8B-sized forward slice: an MLP GEMM and causal attention (32 heads x 128), bf16."""

    def __init__(self, device, tokens=16384, hidden=4096, ffn=14336, attn_tokens=4096):
        self.a = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        self.b = torch.randn(hidden, ffn, dtype=torch.bfloat16, device=device)
        self.c = torch.empty(tokens, ffn, dtype=torch.bfloat16, device=device)
        self.q, self.k, self.v = (torch.randn(1, 32, attn_tokens, 128, dtype=torch.bfloat16, device=device)
                                  for _ in range(3))

    def step(self):
        torch.matmul(self.a, self.b, out=self.c)
        F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)


def overlapped(compute, iters, stream, io_fn, io_launches):
    """Run ``iters`` compute steps on the default stream and ``io_launches`` I/O launches on ``stream``, both
    released at once. Returns (compute ms, list of ms at which each I/O launch ended), from the release."""
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms: the host enqueues everything meanwhile
    go, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    go.record()
    ends = []
    if stream is not None:
        stream.wait_event(go)
        with torch.cuda.stream(stream):
            for _ in range(io_launches):
                io_fn()
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
    for _ in range(iters):
        compute.step()
    done.record()
    torch.cuda.synchronize()
    return go.elapsed_time(done), [go.elapsed_time(e) for e in ends]


def io_bandwidth(ends, until_ms, payload):
    """GB/s of the I/O launches that ended by ``until_ms``."""
    finished = [t for t in ends if t <= until_ms]
    return round(len(finished) * payload / finished[-1] / 1e6, 1) if finished else None


def interference(tk, device, iters=20, repeats=3):
    from tutti_hicache import green

    compute = Compute(device)
    lay = Layer(GEOMETRIES["llama3-8b"], 1280, 1024, device)
    io_fn = layer_ops(tk, lay)["scatter_layer"]
    all_sms = torch.cuda.get_device_properties(device).multi_processor_count
    streams = {"ordinary": (torch.cuda.Stream(), "ordinary", all_sms),
               "priority": (torch.cuda.Stream(priority=-1), "priority", all_sms)}
    for sms in (8, 16):
        io = green.io_stream(sms)
        streams[f"green-{sms}"] = (io.stream, io.kind, io.num_sms)
    for stream, _, _ in streams.values():  # compile and warm up on every stream
        with torch.cuda.stream(stream):
            io_fn()
    alone_ms = min(overlapped(compute, iters, None, None, 0)[0] for _ in range(repeats))
    rows = [{"case": "compute alone", "time_ms": round(alone_ms, 3), "slowdown": 1.0}]
    for case, (stream, kind, num_sms) in streams.items():
        solo_ends = overlapped(compute, 0, stream, io_fn, 20)[1]
        solo_bw = io_bandwidth(solo_ends, float("inf"), lay.payload)
        launches = int(1.5 * alone_ms / (solo_ends[-1] / 20)) + 2  # keep the I/O busy past the compute
        runs = [overlapped(compute, iters, stream, io_fn, launches) for _ in range(repeats)]
        ms, ends = min(runs, key=lambda r: r[0])
        rows.append({"case": f"scatter on {case} stream", "stream_kind": kind, "num_sms": num_sms,
                     "time_ms": round(ms, 3), "slowdown": round(ms / alone_ms, 3),
                     "io_bandwidth_GBps": io_bandwidth(ends, ms, lay.payload), "io_alone_bandwidth_GBps": solo_bw})
    return {"compute_iters": iters, "io_payload_bytes_per_launch": lay.payload, "rows": rows}


def print_table(result):
    print(f"device: {result['meta']['device']}  torch {result['meta']['torch']}  triton {result['meta']['triton']}")
    print(f"{'geometry':<11}{'op':<18}{'layers':>7}{'pages':>7}{'MiB':>9}{'ms':>10}{'GB/s':>9}"
          f"{'graph ms':>10}{'graph GB/s':>11}")
    for r in result["bandwidth"]:
        graph = (f"{r['graph_time_ms']:>10.3f}{r['graph_bandwidth_GBps']:>11.1f}" if "graph_time_ms" in r
                 else f"{'-':>10}{'-':>11}")
        print(f"{r['geometry']:<11}{r['op']:<18}{r.get('layers', 1):>7}{r['pages']:>7}"
              f"{r['payload_bytes'] / 2**20:>9.1f}{r['time_ms']:>10.3f}{r['bandwidth_GBps']:>9.1f}" + graph)
    inter = result.get("interference")
    if not isinstance(inter, dict):
        print(f"interference: {inter}")
        return
    mib = inter["io_payload_bytes_per_launch"] / 2**20
    print(f"\ninterference ({inter['compute_iters']} compute steps; scatter {mib:.0f} MiB per launch)")
    print(f"{'case':<30}{'kind':<10}{'SMs':>5}{'ms':>9}{'slowdown':>10}{'I/O GB/s':>10}{'alone':>9}")
    for r in inter["rows"]:
        cells = (r.get("num_sms", ""), r["time_ms"], r["slowdown"], r.get("io_bandwidth_GBps", ""),
                 r.get("io_alone_bandwidth_GBps", ""))
        print(f"{r['case']:<30}{r.get('stream_kind', ''):<10}" + "".join(
            f"{str(c):>{w}}" for c, w in zip(cells, (5, 9, 10, 10, 9))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU, Triton interpreter")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many do_bench medians per case")
    parser.add_argument("--layers-only", action="store_true", help="only the per-layer bandwidth table")
    parser.add_argument("--graph", action="store_true",
                        help="also time each per-layer case inside a CUDA graph (host launch cost excluded)")
    args = parser.parse_args(argv)
    global REPEATS, GRAPH
    REPEATS, GRAPH = max(1, args.repeats), args.graph
    import triton

    tk = load_kernels()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    geometries = GEOMETRIES if cuda else TINY
    result = {"meta": {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
                       "torch": torch.__version__, "triton": triton.__version__, "dry_run": not cuda},
              "units": UNITS}
    result["bandwidth"] = bench_layers(tk, device, (1024, 4096, 16384) if cuda else (2, 3), geometries)
    result["meta"]["repeats"] = REPEATS
    if not args.layers_only:
        result["bandwidth"] += bench_pages(tk, device, 512 if cuda else 2, 32 if cuda else 2, geometries)
    result["interference"] = interference(tk, device) if cuda and not args.layers_only else "skipped"
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
