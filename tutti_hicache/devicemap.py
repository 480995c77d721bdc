"""Where the KV objects of a page live in SGLang's device pool (the layer-wise path's L1).

At a glance:
    dm = DeviceMap.from_pool(pool, page_size)   MHATokenToKVPool (NHD) or MLATokenToKVPool
    dm.k_bufs, dm.v_bufs                        per-layer device tensors [rows, heads, dim];
                                                MLA: its kv_buffer as k_bufs, v_bufs None
    dm.geometry                                 PageGeometry (canonical order)
    dm.mla

Page p of layer l is rows [p * page_size, (p + 1) * page_size) of k_bufs[l] (and v_bufs[l]):
one contiguous region per (page, layer, K|V), the same objects as on disk. No SGLang import:
the pool is duck-typed by its class name and buffers; anything else raises ValueError. The
host pool's twin is hostmap.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .layout import PageGeometry


@dataclass(frozen=True)
class DeviceMap:
    k_bufs: list
    v_bufs: Optional[list]
    geometry: PageGeometry

    @property
    def mla(self) -> bool:
        return self.v_bufs is None

    @classmethod
    def from_pool(cls, pool, page_size: int) -> "DeviceMap":
        kind = type(pool).__name__
        own = getattr(pool, "page_size", page_size)
        if own != page_size:  # SGLang's decode context parallelism (--dcp-size N): the allocator
            # hands out pages of N x the pool's over virtual token locations, stored at local
            # row loc // N; moving rows page_id * page_size would move other pages' rows
            raise ValueError(f"tutti linker: the cache's pages are {page_size} tokens and the "
                             f"device pool's {own} (--dcp-size > 1?); decode context parallelism "
                             "is not supported")
        if getattr(pool, "k_scale_buffer", None) is not None or \
                getattr(pool, "kv_cache_layout", None) == "vectorized_5d":
            raise ValueError(f"tutti linker: {kind} with scales or a 5D layout is not supported")
        if kind == "MLATokenToKVPool":
            bufs = list(pool.kv_buffer)
            kb = bufs[0][0].numel() * bufs[0].element_size()
            return cls(bufs, None, PageGeometry("mla", len(bufs), page_size, kb, 0))
        if kind != "MHATokenToKVPool" or getattr(pool, "use_hnd", False):
            hnd = " (HND)" if getattr(pool, "use_hnd", False) else ""
            raise ValueError(f"tutti linker: {kind}{hnd} is not supported "
                             "(MHATokenToKVPool in NHD, or MLATokenToKVPool)")
        k, v = list(pool.k_buffer), list(pool.v_buffer)
        if not all(t.is_contiguous() for t in k + v):
            raise ValueError("tutti linker: device K/V buffers must be contiguous")
        kb = k[0][0].numel() * k[0].element_size()
        vb = v[0][0].numel() * v[0].element_size()
        if kb != vb:  # the kernels move a page's K and V as objects of one size
            raise ValueError(f"tutti linker: K and V of a token differ in size ({kb} and {vb} bytes: "
                             "v_head_dim != head_dim); such MHA pools are not supported")
        return cls(k, v, PageGeometry("mha", len(k), page_size, kb, vb))
