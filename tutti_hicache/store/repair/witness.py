"""What a namespace directory's own slot headers say about its placement (for heal.py).

    witness(ns_dir, layout, fingerprint) -> Witness(stripe, n_dirs, slots_per_segment)
        each None unless the headers settle it

Slot s of a namespace striped over n directories with k slots per segment lives in directory
s % n, segment (s // n) // k, position (s // n) % k; every valid header records s. So the first
headers of the lowest two segment files of a directory tell n (two valid headers of one file:
their slot numbers differ by n per position), the directory's stripe (s % n) and, from a segment
beyond the first, k. These headers are checked like any others (magic, checksum, fingerprint,
payload size), so this is evidence only a header the store itself wrote can give, and it outranks
placement.json: a damaged or stale marker is rebuilt from it. 16 headers per file, 2 files per
directory: a few dozen 4 KiB preads at attach.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import numpy as np

from .. import header
from ...layout import HEADER_NBYTES, SlotLayout

PROBE = 16  # headers read per segment file


class Witness(NamedTuple):
    stripe: Optional[int]
    n_dirs: Optional[int]
    slots_per_segment: Optional[int]


NONE = Witness(None, None, None)


def _one(values: set) -> Optional[int]:
    return next(iter(values)) if len(values) == 1 else None


def _headers(path: str, layout: SlotLayout, fingerprint: bytes) -> list[tuple[int, int]]:
    """(position, slot number) of the valid headers among the file's first PROBE slots."""
    slot = layout.slot_nbytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        n = min(PROBE, os.fstat(fd).st_size // slot)
        raw = np.zeros((max(n, 1), HEADER_NBYTES), dtype=np.uint8)
        for k in range(n):
            b = os.pread(fd, HEADER_NBYTES, k * slot)
            raw[k, :len(b)] = np.frombuffer(b, dtype=np.uint8)
    except OSError:
        return []
    finally:
        os.close(fd)
    if n == 0:
        return []
    raw = raw[:n]
    own = raw.reshape(-1).view(header.DTYPE)["slot"].copy()
    p = header.parse(raw, fingerprint, own, int(layout.object_nbytes.sum()), layout.geometry.units)
    return [(int(k), int(own[k])) for k in np.flatnonzero(p.valid)]


def witness(ns: str, layout: SlotLayout, fingerprint: bytes, n_hint: int) -> Witness:
    """What ns's headers say; n_hint (the configured count) is used when they cannot tell n."""
    try:
        rows = sorted(int(e[4:-4]) for e in os.listdir(ns) if e.startswith("seg-") and
                      e.endswith(".dat") and e[4:-4].isdigit())
    except OSError:
        return NONE
    seen = {r: _headers(os.path.join(ns, f"seg-{r:06d}.dat"), layout, fingerprint)
            for r in rows[:2]}
    steps = set()
    for obs in seen.values():
        for (k1, s1), (k2, s2) in zip(obs, obs[1:]):
            steps.add((s2 - s1) / (k2 - k1))
    n = _one(steps)
    n = int(n) if n is not None and n >= 1 and n == int(n) else None
    use = n or n_hint
    stripe = _one({s % use for obs in seen.values() for _, s in obs})
    sps = set()
    for r, obs in seen.items():
        for k, s in obs:
            if r > 0 and (s // use - k) % r == 0 and (s // use - k) // r > k:
                sps.add((s // use - k) // r)
    return Witness(stripe, n, _one(sps))
