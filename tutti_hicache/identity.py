"""The identity of a store namespace: what makes two processes' pages interchangeable.

    identity_for(cfg, pool, geometry, model, pp, cp, tp, kv_cache_dtype, weights) -> dict
                                                 of a KV pool (host or device)
    weights_of(model_args, spec_args=None) -> (model, weights)   what the KV depends on beyond
                                                 the pool, from SGLang's server args
    kv_dtype(pool_dtype, kv_cache_dtype) -> str  the dtype it names (a byte pool: the server's)
    is_writer(kind, tp_rank) -> bool             whether this rank writes pages (the MLA rule)
    make_identity(cfg, model, geometry, dtype, pp, cp, tp, heads, first_layer) -> dict
    with_geometry(identity, geometry) -> dict    what the store fingerprints: identity + geometry

Shared by the host-tier backend and the linker so that a page written by either is found by
the other when model, weights revision, dtype, geometry, object order and rank coordinates
match. MHA heads are sharded by tensor parallelism, so the tp rank and size are part of the
identity; MLA's latent KV is the same on every rank, so it is not (one writer serves all).
Both SGLang adapters (storage.py, linker.py) use identity_for and is_writer, so the rule and the
head geometry are stated once.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from .config import TuttiConfig
from .layout import PageGeometry

FORMAT = 1


def is_writer(kind: str, tp_rank: int) -> bool:
    """MLA ranks hold the same latent KV, so rank 0 writes for all of them; every MHA rank holds
    its own heads and writes them."""
    return kind != "mla" or tp_rank == 0


def pool_heads(pool, kind: str) -> Optional[list]:
    """[head_num, head_dim, v_head_dim] of an SGLang MHA pool (host or device); None for MLA."""
    if kind == "mla":
        return None
    return [pool.head_num, pool.head_dim, getattr(pool, "v_head_dim", pool.head_dim)]


# SGLang's --kv-cache-dtype values whose KV its pools hold as bytes, and the torch dtype each is
# (the name a device pool reports, so both seams name the same KV alike)
BYTE_KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                  "fp4_e2m1": "float4_e2m1fn_x2"}


def kv_dtype(pool_dtype, kv_cache_dtype: Optional[str] = None) -> str:
    """The KV dtype an identity names. SGLang's host pools hold fp8 (and fp4) KV as bytes:
    their dtype is uint8 whether the server runs fp8_e4m3 or fp8_e5m2, whose bytes mean other
    numbers. A byte pool is therefore named by the server's --kv-cache-dtype (kv_cache_dtype),
    so the two never share a namespace; device pools report the real dtype already. Under
    --kv-cache-dtype auto a pool holds bytes only when the checkpoint says FP8, which SGLang
    makes e4m3: named so, as the linker's device pool names it."""
    name = str(pool_dtype).replace("torch.", "")
    if name != "uint8":
        return name
    s = str(kv_cache_dtype or "").lower().replace("torch.", "")
    if s == "auto":  # a byte pool under auto: SGLang read FP8 from the checkpoint's
        s = "fp8_e4m3"  # kv_cache_quant_algo, the one fp8 auto resolves to (e4m3)
    if s in ("fp8_e4m3", "fp8_e5m2") and _on_rocm():
        return _rocm_fp8(s)
    if s in BYTE_KV_DTYPES:
        return BYTE_KV_DTYPES[s]
    return f"uint8:{s}" if s else "uint8"


def _on_rocm() -> bool:
    import torch  # a byte pool is a torch tensor: torch is loaded

    return bool(getattr(torch.version, "hip", None))


def _rocm_fp8(kv_cache_dtype: str) -> str:
    """On ROCm SGLang keeps both fp8 KV kinds in its platform's fp8 type: float8_e4m3fnuz on
    gfx94x (MI300), whose bytes mean other numbers than CUDA's float8_e4m3fn, else
    float8_e4m3fn. Named as the device pool there names it; a platform it cannot ask is named
    apart from every CUDA server's KV."""
    import torch

    try:
        arch = torch.cuda.get_device_properties(0).gcnArchName
    except Exception:
        return f"uint8:rocm:{kv_cache_dtype}"
    return "float8_e4m3fnuz" if "gfx94" in arch else "float8_e4m3fn"


def weights_of(model_args, spec_args=None) -> tuple[str, dict]:
    """(model, weights): what a server's KV depends on beyond its pool, from SGLang's server
    args (a ServerArgs, or 0.5.23's published `model` and `spec` bags; spec_args defaults to
    model_args). model: the weights' path (--model-path), not the name the server answers to:
    two servers may serve other weights under one --served-model-name. weights: only what is
    set, so a plain server's identity is what it was: SGLang's --revision of the weights,
    --quantization (other weights compute other KV), the fp8 KV scales (--quantization-param-path:
    the stored bytes are K / k_scale, so another file makes them other numbers; named by a hash
    of the file's contents, else by its path), and the draft model of speculative decoding
    (--speculative-draft-model-path and its revision: a NextN/MTP draft's layers live in the host
    pool beside the target's)."""
    spec_args = model_args if spec_args is None else spec_args

    def get(obj, name):
        try:
            v = getattr(obj, name, None) if obj is not None else None
        except (AttributeError, ValueError):  # a bag without that leaf
            return None
        return str(v) if v not in (None, "") else None

    weights = {"model_revision": get(model_args, "revision"),
               "quantization": get(model_args, "quantization"),
               "kv_scales": _file_digest(get(model_args, "quantization_param_path")),
               "draft": get(spec_args, "speculative_draft_model_path"),
               "draft_revision": get(spec_args, "speculative_draft_model_revision")}
    if weights["draft"] is None:
        weights["draft_revision"] = None
    return get(model_args, "model_path") or "", {k: v for k, v in weights.items() if v}


def _file_digest(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()[:32]
    except OSError:
        return path


def identity_for(cfg: TuttiConfig, pool, geometry: PageGeometry, *, model: str, pp: tuple,
                 cp: tuple, tp: tuple, kv_cache_dtype: Optional[str] = None,
                 weights: Optional[dict] = None) -> dict:
    """The identity of an SGLang KV pool (its dtype and heads) at these rank coordinates;
    kv_cache_dtype: the server's --kv-cache-dtype, which names a byte pool's KV (kv_dtype);
    model, weights: weights_of()."""
    return make_identity(cfg, model=model, geometry=geometry,
                         dtype=kv_dtype(pool.dtype, kv_cache_dtype), pp=pp, cp=cp, tp=tp,
                         heads=pool_heads(pool, geometry.kind),
                         first_layer=int(getattr(pool, "start_layer", 0) or 0), weights=weights)


def make_identity(cfg: TuttiConfig, *, model: str, geometry: PageGeometry, dtype, pp: tuple,
                  cp: tuple, tp: tuple, heads: Optional[list], first_layer: int = 0,
                  weights: Optional[dict] = None) -> dict:
    """first_layer: the model layer of the pool's layer 0 (a pipeline stage's start_layer): two
    stages with the same rank and layer count may hold different layers (another partition,
    SGLANG_PP_LAYER_PARTITION). Named only where it is not 0, so the identity of every store
    without a later stage stays what it was. weights: weights_of()'s, each key named only when
    set; tutti_model replaces the model's path, never these."""
    g = geometry
    ident = {
        "format": FORMAT, "model": cfg.model or model or "", "revision": cfg.revision,
        "kind": g.kind, "dtype": str(dtype).replace("torch.", ""), "layers": g.num_layers,
        "page_size": g.page_size, "k_token_bytes": g.k_token_bytes,
        "v_token_bytes": g.v_token_bytes, "order": g.order,
        "pp": [int(pp[0]), int(pp[1])], "cp": [int(cp[0]), int(cp[1])],
    }
    ident.update({k: str(v) for k, v in (weights or {}).items() if v})
    if first_layer:
        ident["first_layer"] = int(first_layer)
    if g.kind == "mha":
        ident["tp"] = [int(tp[0]), int(tp[1])]
        ident["heads"] = [int(h) for h in heads]
    return ident


def with_geometry(identity: dict, g: PageGeometry) -> dict:
    """The page geometry is always part of a store's identity, whatever the caller passed."""
    return {**identity, "geometry": [g.kind, g.num_layers, g.page_size, g.k_token_bytes,
                                     g.v_token_bytes, g.order]}
