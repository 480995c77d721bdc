"""Where each object of a KV page lives in SGLang's host pool (L2), computed vectorized.

At a glance:
    hm = HostMap.from_pool(pool)          MHA/MLA host pool, layer_first | page_first |
                                          page_first_direct | page_head (MHA)
    hm.geometry                           PageGeometry (canonical order when layer-splittable)
    hm.page_addresses(host_indices, n)    uint64 [n, objects_per_page]; validates the indices
    hm.flat_addresses(tensors)            same for SGLang's flat data pages (legacy API)
    hm.aligned                            every object address and size is 4 KiB-aligned
    hm.regions                            [(address, nbytes)] of the pool, for registration

No SGLang import: the pool is duck-typed (k_buffer/v_buffer for MHA, kv_buffer and
kv_cache_dim for MLA) and, when the pool offers get_page_buffer_meta, cross-checked against
it at construction so a layout this module misreads is refused instead of serving wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import ALIGN, PageGeometry

SUPPORTED = {"mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
             "mla": ("layer_first", "page_first", "page_first_direct")}


class UnsupportedPool(ValueError):
    """The host pool's type or layout is not one tutti can serve."""


@dataclass(frozen=True)
class _Obj:
    tensor: object  # the pool tensor holding the object
    const: int  # byte offset of the object within the tensor for page 0
    page_stride: int  # bytes per page index step
    nbytes: int


def _pool_kind(pool) -> str:
    if getattr(pool, "kv_cache_dim", None) is not None:
        return "mla"
    if all(hasattr(pool, a) for a in ("k_buffer", "v_buffer", "head_num", "head_dim")):
        return "mha"
    raise UnsupportedPool(f"tutti serves MHA and MLA KV host pools; got {type(pool).__name__}")


def _check_supported(pool, kind: str) -> None:
    layout = getattr(pool, "layout", None)
    if layout not in SUPPORTED[kind]:
        raise UnsupportedPool(
            f"tutti: host layout {layout!r} of {type(pool).__name__} is not supported; use "
            f"--hicache-mem-layout {' or '.join(SUPPORTED[kind])} (layer_first or "
            f"page_first_direct keep pages readable layer by layer)")
    if getattr(pool, "dcp_size", 1) not in (1, None):
        raise UnsupportedPool("tutti: decode context parallel (DCP > 1) host pools are not supported")
    if type(pool).__name__ not in ("MHATokenToKVPoolHost", "AsymmetricMHATokenToKVPoolHost",
                                   "MLATokenToKVPoolHost"):
        raise UnsupportedPool(f"tutti: host pool {type(pool).__name__} (scales, sparse or "
                              "packed formats) is not supported")


def _mha_objects(pool) -> tuple[list[_Obj], PageGeometry]:
    p, n_l, it = pool.page_size, pool.layer_num, pool.dtype.itemsize
    k, v = pool.k_buffer, pool.v_buffer
    kb = pool.head_num * pool.head_dim * it
    vb = pool.head_num * getattr(pool, "v_head_dim", pool.head_dim) * it
    lay = pool.layout
    if lay == "layer_first":  # [L, size, H, D]: page term is the token index
        objs = [o for l in range(n_l) for o in (
            _Obj(k, l * k.stride(0) * it, k.stride(1) * it, p * kb),
            _Obj(v, l * v.stride(0) * it, v.stride(1) * it, p * vb))]
        return objs, PageGeometry("mha", n_l, p, kb, vb, "canonical")
    if lay == "page_first_direct":  # [pages, L, P, H, D]: page term is the page number
        objs = [o for l in range(n_l) for o in (
            _Obj(k, l * k.stride(1) * it, k.stride(0) * it, p * kb),
            _Obj(v, l * v.stride(1) * it, v.stride(0) * it, p * vb))]
        return objs, PageGeometry("mha", n_l, p, kb, vb, "canonical")
    # page_first [size, L, H, D] (by token) or page_head [pages, H, P, L, D] (by page):
    # a page is one object per K and V holding every layer; not splittable by layer.
    objs = [_Obj(t, 0, t.stride(0) * it, p * n_l * b) for t, b in ((k, kb), (v, vb))]
    return objs, PageGeometry("mha", n_l, p, kb, vb, lay)


def _mla_objects(pool) -> tuple[list[_Obj], PageGeometry]:
    p, n_l, it = pool.page_size, pool.layer_num, pool.dtype.itemsize
    kv = pool.kv_buffer
    kb = pool.kv_cache_dim * it
    lay = pool.layout
    if lay == "layer_first":  # [L, size, 1, dim]
        objs = [_Obj(kv, l * kv.stride(0) * it, kv.stride(1) * it, p * kb) for l in range(n_l)]
        return objs, PageGeometry("mla", n_l, p, kb, 0, "canonical")
    if lay == "page_first_direct":  # [pages, L, P, 1, dim]
        objs = [_Obj(kv, l * kv.stride(1) * it, kv.stride(0) * it, p * kb) for l in range(n_l)]
        return objs, PageGeometry("mla", n_l, p, kb, 0, "canonical")
    return [_Obj(kv, 0, kv.stride(0) * it, p * n_l * kb)], PageGeometry("mla", n_l, p, kb, 0, "page_first")


class HostMap:
    def __init__(self, pool, objs: list[_Obj], geometry: PageGeometry):
        self.pool = pool
        self.geometry = geometry
        self.page_size = pool.page_size
        self.by_page = pool.layout in ("page_first_direct", "page_head")
        self.capacity_tokens = int(pool.size)
        self._const = np.array([o.tensor.data_ptr() + o.const for o in objs], dtype=np.uint64)
        self._stride = np.array([o.page_stride for o in objs], dtype=np.uint64)
        self.object_nbytes = np.array([o.nbytes for o in objs], dtype=np.int64)
        # page starts are multiples of page_size, so a per-token stride steps page_size at a time
        step = self._stride * np.uint64(1 if self.by_page else self.page_size)
        self.aligned = bool((self._const % ALIGN == 0).all() and (step % ALIGN == 0).all()
                            and (self.object_nbytes % ALIGN == 0).all())
        tensors = {id(o.tensor): o.tensor for o in objs}.values()
        self.regions = _merge_regions([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])

    @classmethod
    def from_pool(cls, pool) -> "HostMap":
        kind = _pool_kind(pool)
        _check_supported(pool, kind)
        objs, geometry = _mha_objects(pool) if kind == "mha" else _mla_objects(pool)
        hm = cls(pool, objs, geometry)
        hm._cross_check()
        return hm

    def page_addresses(self, host_indices, n_pages: int) -> np.ndarray:
        """Object addresses [n_pages, m] for pages whose token slots are host_indices.

        host_indices: CPU int64 tensor (or array) of n_pages*page_size slots; page i starts at
        host_indices[i*page_size] and covers page_size consecutive, page-aligned slots.
        Raises ValueError on a wrong length, misaligned or out-of-range index."""
        raw = np.asarray(host_indices.numpy() if hasattr(host_indices, "numpy") else host_indices)
        if raw.dtype.kind not in "iu":
            raise ValueError(f"host_indices: expected an integer tensor, got {raw.dtype}")
        idx = raw.astype(np.int64, copy=False)
        p = self.page_size
        if idx.ndim != 1 or len(idx) != n_pages * p:
            raise ValueError(f"host_indices: expected {n_pages}*{p} slots, got shape {idx.shape}")
        pages = idx.reshape(n_pages, p)
        starts = pages[:, 0]
        if n_pages and ((starts % p).any() or (pages != starts[:, None] + np.arange(p)).any()
                        or starts.min() < 0 or starts.max() + p > self.capacity_tokens):
            raise ValueError("host_indices: pages must be whole, page-aligned and inside the pool")
        term = (starts // p if self.by_page else starts).astype(np.uint64)
        return self._const[None, :] + term[:, None] * self._stride[None, :]

    def flat_object_offsets(self) -> np.ndarray:
        """Byte offset of each object inside one of SGLang's flat data pages."""
        g = self.geometry
        if g.order != "canonical" or g.kind == "mla":
            sizes = self.object_nbytes
            return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
        n_l, half = g.num_layers, self.object_nbytes[0] * g.num_layers
        kv = np.arange(2 * n_l) % 2  # flat page is [2][L][P][H][D]: K block, then V block
        layer = np.arange(2 * n_l) // 2
        return (kv * half + layer * self.object_nbytes[0]).astype(np.uint64)

    def flat_addresses(self, tensors) -> np.ndarray:
        base = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
        return base[:, None] + self.flat_object_offsets()[None, :]

    def _cross_check(self) -> None:
        """Compare two pages' byte ranges with the pool's own get_page_buffer_meta."""
        meta = getattr(self.pool, "get_page_buffer_meta", None)
        if meta is None or self.geometry.v_token_bytes not in (0, self.geometry.k_token_bytes):
            return
        import torch
        n = min(2, self.capacity_tokens // self.page_size)
        idx = torch.arange(n * self.page_size, dtype=torch.int64)
        ptrs, sizes = meta(idx)
        theirs = _merge_regions(list(zip(ptrs, sizes)))
        addrs = self.page_addresses(idx, n)
        ours = _merge_regions([(int(a), int(s)) for row in addrs
                               for a, s in zip(row, self.object_nbytes)])
        if theirs != ours:
            raise UnsupportedPool(
                f"tutti: host pool {type(self.pool).__name__} (layout {self.pool.layout}) does "
                "not match the layout tutti expects; refusing to serve it")


def _merge_regions(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, n in sorted((int(a), int(n)) for a, n in regions):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]
