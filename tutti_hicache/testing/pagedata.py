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
