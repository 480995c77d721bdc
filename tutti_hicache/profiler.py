"""Compute-window profiling and the slack table (`tutti-hicache profile`).

At a glance:
    measure(shape, inputs, prefixes, device) -> [(n_input, n_prefix, seconds_per_layer)]
    fit(samples) -> LayerModel        t(n, p) = a + b*n + c*n*(p + n/2): the MLP and projections
                                      grow with new tokens n, attention with n x (prefix + n/2)
    build_table(model, geometry, read_Bps, write_Bps) -> SlackTable
    SlackTable.save(path) / SlackTable.load(path) / table.window(n_input, n_prefix) -> (s, bytes)

Per (L_input, L_prefix) bucket the table holds the per-layer compute time, the time to read one
layer of that prefix, and the per-layer window left for writes (compute - read, >= 0) with the
bytes that fit in it at the measured write bandwidth. The linker opens such a window between
layer reads when its reads are ahead of the forward (scheduler.Gate.set_window); the host tier
sees no layers and uses the read-first rules alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

INPUT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384)
PREFIX_BUCKETS = (0, 4096, 8192, 16384, 32768, 65536, 131072)
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336)


@dataclass
class LayerModel:
    a: float
    b: float
    c: float

    def seconds(self, n: int, p: int) -> float:
        return max(0.0, self.a + self.b * n + self.c * n * (p + n / 2))


def measure(shape: dict, inputs, prefixes, device: str = "cuda", repeats: int = 3) -> list:
    """Time one Llama-shaped layer (QKV, SDPA over prefix+input, O, MLP) per (n_input, n_prefix)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    dt = torch.bfloat16
    s = shape
    g = torch.Generator(device=device).manual_seed(0)
    qkv_out = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    w = {k: torch.randn(*d, generator=g, device=device).to(dt) * 0.02 for k, d in
         dict(qkv=(s["hidden"], qkv_out), o=(s["heads"] * s["head_dim"], s["hidden"]),
              up=(s["hidden"], 2 * s["mlp"]), down=(s["mlp"], s["hidden"])).items()}

    def layer(x, k_all, v_all):
        n = x.shape[0]
        q = (x @ w["qkv"])[:, : s["heads"] * s["head_dim"]].view(1, n, s["heads"], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k_all, v_all,
                                           attn_mask=causal_lower_right(n, k_all.shape[2]))
        x = x + o.transpose(1, 2).reshape(n, -1) @ w["o"]
        gate, up = (x @ w["up"]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w["down"]

    out = []
    for n in inputs:
        for p in prefixes:
            x = torch.randn(n, s["hidden"], device=device, dtype=dt)
            kv = torch.randn(1, s["heads"], n + p, s["head_dim"], device=device, dtype=dt)
            layer(x, kv, kv)  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                layer(x, kv, kv)
            _sync(device)
            out.append((n, p, (time.perf_counter() - t0) / repeats))
            del x, kv
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def fit(samples) -> LayerModel:
    """Least-squares fit of t = a + b*n + c*n*(p + n/2) to (n, p, t) samples."""
    a = np.array([[1.0, n, n * (p + n / 2)] for n, p, _ in samples])
    t = np.array([t for _, _, t in samples])
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    return LayerModel(*map(float, coef))


@dataclass
class SlackTable:
    model: LayerModel
    layer_bytes_per_token: int  # K+V bytes of one token in one layer
    read_Bps: float
    write_Bps: float
    sm_budget: int
    rows: list  # [n_input, n_prefix, compute_s, read_s, window_s, max_write_bytes]

    def window(self, n_input: int, n_prefix: int) -> tuple[float, int]:
        """Per-layer write window (s) and bytes for the bucket at or below (n_input, n_prefix)."""
        ni = max([b for b in INPUT_BUCKETS if b <= max(n_input, INPUT_BUCKETS[0])])
        npf = max([b for b in PREFIX_BUCKETS if b <= max(n_prefix, 0)])
        for r in self.rows:
            if r[0] == ni and r[1] == npf:
                return r[4], r[5]
        return 0.0, 0

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"format": 1, **asdict(self)}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "SlackTable":
        with open(path) as f:
            d = json.load(f)
        if d.get("format") != 1:
            raise ValueError(f"tutti_slack_table: {path} is not a tutti slack table (format 1)")
        d.pop("format")
        d["model"] = LayerModel(**d["model"])
        return cls(**d)


def build_table(model: LayerModel, layer_bytes_per_token: int, read_Bps: float, write_Bps: float,
                sm_budget: int = 8) -> SlackTable:
    rows = []
    for n in INPUT_BUCKETS:
        for p in PREFIX_BUCKETS:
            compute = model.seconds(n, p)
            read = p * layer_bytes_per_token / read_Bps
            window = max(0.0, compute - read)
            rows.append([n, p, compute, read, window, int(window * write_Bps)])
    return SlackTable(model, layer_bytes_per_token, read_Bps, write_Bps, sm_budget, rows)


def profile(shape: dict = LLAMA3_8B, device: str = "cuda", read_Bps: float = 10e9,
            write_Bps: float = 2e9, quick: bool = False) -> tuple[SlackTable, float, list]:
    """Measure, fit and tabulate; returns (table, seconds spent, samples)."""
    t0 = time.perf_counter()
    inputs = (512, 2048, 8192) if not quick else (64, 128)
    prefixes = (0, 8192, 32768) if not quick else (0, 256)
    samples = measure(shape, inputs, prefixes, device)
    model = fit(samples)
    per_token = 2 * shape["kv_heads"] * shape["head_dim"] * 2
    return build_table(model, per_token, read_Bps, write_Bps), time.perf_counter() - t0, samples


def relative_error(model: LayerModel, samples) -> float:
    return max(abs(model.seconds(n, p) - t) / max(t, 1e-9) for n, p, t in samples)

