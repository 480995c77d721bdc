"""A Llama-shaped decoder with random weights over a paged KV pool: the forward pass that the
prefill benchmarks (bench/bench_prefill.py, bench/bench_cluster.py) put a restore behind.

At a glance:
    model = Model(shape, rows, device)      shape: layers, hidden, heads, kv_heads, head_dim, mlp, page
    prefill(model, tokens, prefix, restore=None, counter=None) -> (TTFT s, bubble s)
    sync()                                  torch.cuda.synchronize() where there is CUDA

The KV pool's rows are tokens; rows 0..page-1 stay unused (the pool's padding page). Each layer calls
counter.wait_until(l) before its attention, as SGLang's KV pool does, and the bubble is the time
spent there (CUDA events on a GPU, the CPU clock otherwise). SDPA attention, real MLP GEMMs.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


class Model:
    """Random-weight Llama-shaped decoder layers over a paged KV pool (rows = tokens)."""

    def __init__(self, shape: dict, rows: int, device, dtype=torch.bfloat16):
        s = shape
        self.s, self.device, self.dtype = s, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims):
            return (torch.randn(*dims, generator=g, device=device) / math.sqrt(dims[0])).to(dtype)

        qkv = s["heads"] * s["head_dim"] + 2 * s["kv_heads"] * s["head_dim"]
        self.w = [dict(qkv=w(s["hidden"], qkv), o=w(s["heads"] * s["head_dim"], s["hidden"]),
                       up=w(s["hidden"], 2 * s["mlp"]), down=w(s["mlp"], s["hidden"]))
                  for _ in range(s["layers"])]
        self.k = [torch.zeros(rows, s["kv_heads"], s["head_dim"], device=device, dtype=dtype)
                  for _ in range(s["layers"])]
        self.v = [torch.zeros_like(b) for b in self.k]

    def forward(self, x, start: int, total: int, counter=None, marks=None):
        """New tokens x [n, hidden] at rows [start, total) over KV rows [page, total)."""
        s, page = self.s, self.s["page"]
        n = x.shape[0]
        for l, w in enumerate(self.w):
            qkv = x @ w["qkv"]
            q, k, v = qkv.split([s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"],
                                 s["kv_heads"] * s["head_dim"]], dim=-1)
            self.k[l][start:total] = k.view(n, s["kv_heads"], s["head_dim"])
            self.v[l][start:total] = v.view(n, s["kv_heads"], s["head_dim"])
            if counter is not None:
                before = _mark(marks)
                counter.wait_until(l)
                _mark(marks, before)
            kk, vv = self.k[l][page:total], self.v[l][page:total]
            o = _attention(q.view(n, s["heads"], s["head_dim"]), kk, vv, s["heads"] // s["kv_heads"])
            x = x + o.reshape(n, -1) @ w["o"]
            gate, up = (x @ w["up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return x


def _attention(q, k, v, rep):
    """Causal attention of the last q.shape[0] positions over all of k/v (lower-right aligned)."""
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)[0].transpose(0, 1)


def _mark(marks, before=None):
    """GPU timestamps around each wait_until (CUDA events), or CPU time on CPU."""
    if marks is None:
        return None
    if torch.cuda.is_available():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
    else:
        ev = time.perf_counter()
    if before is not None:
        marks.append((before, ev))
    return ev


def _bubble_s(marks) -> float:
    if not marks:
        return 0.0
    if torch.cuda.is_available():
        return sum(a.elapsed_time(b) for a, b in marks) / 1e3
    return sum(b - a for a, b in marks)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(model, tokens: int, prefix: int, restore=None, counter=None):
    """One request: TTFT (s), bubble (s). restore() starts the layer-wise loads, returns index."""
    page = model.s["page"]
    x = torch.randn(tokens - prefix, model.s["hidden"], device=model.device, dtype=model.dtype)
    sync()
    marks = [] if counter is not None else None
    t0 = time.perf_counter()
    if restore is not None:
        counter.set_consumer(restore())
    model.forward(x, page + prefix, page + tokens, counter, marks)
    if counter is not None:
        counter.finish(counter.consumer_index)
    sync()
    return time.perf_counter() - t0, _bubble_s(marks)
