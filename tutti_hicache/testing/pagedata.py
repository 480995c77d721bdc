"""Deterministic page bytes derived from a key, for tests, the soak script and checks.

    page_content(key, nbytes) -> uint8 array     the bytes a page stored under `key` holds

A reader that knows only the key can tell whether a page served for it is exact, with no record
of what was written (nbytes a multiple of 8).
"""

from __future__ import annotations

import hashlib

import numpy as np


def page_content(key: str, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    w = np.arange(nbytes // 8, dtype=np.uint64)
    w += np.uint64(seed)
    w *= np.uint64(0x9E3779B97F4A7C15)
    w ^= w >> np.uint64(29)
    return w.view(np.uint8)


def fill_host_pages(pool, idx, keys, page_size: int) -> None:
    """Page i of host indices `idx` holds page_content(keys[i]), through SGLang's own flat-page
    setter (`pool` is an SGLang host pool; torch is imported only here)."""
    import torch
    tmpl = pool.get_dummy_flat_data_page()
    nbytes = tmpl.numel() * tmpl.element_size()
    for i, k in enumerate(keys):
        raw = torch.from_numpy(page_content(k, nbytes).copy())
        pool.set_from_flat_data_page(int(idx[i * page_size]), raw.view(tmpl.dtype))
