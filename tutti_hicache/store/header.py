"""The 4 KiB slot header: pack many, parse many (vectorized), bounds-check every field.

At a glance:
    fingerprint(identity: dict) -> bytes (16)        identity -> namespace fingerprint
    pack(buf, keys, slots, seqs, checksums, fingerprint, payload_nbytes)
                                                     n headers into a zeroed uint8 array [n, 4096]
    parse(raw [n, 4096], fingerprint, slots, payload_nbytes) -> Parsed
                                                     which headers are valid, and their fields

Format (little-endian), version 1:
    0 magic "TUTTISLT" | 8 version u32 | 12 header_nbytes u32 | 16 fingerprint 16B | 32 seq u64
    40 payload_nbytes u64 (object bytes, padding excluded) | 48 page checksum u64 | 56 slot u64
    64 created_ns u64 | 72 key_len u16 | 74 n_units u16 | 80 key (UTF-8, <= 256 B)
    336 unit checksums u64[n_units] | 4088 XXH3-64 of bytes [0, 4088)
Checksums: a unit is one layer's objects (K then V; MLA one object), or the whole page when the
page is not split by layer. unit checksum = XXH3-64 over the unit's object bytes (padding
excluded); page checksum = XXH3-64 over the little-endian array of unit checksums. The linker
verifies each layer it reads against its unit checksum; the host tier verifies whole pages.
An all-zero header is a tombstone (free slot). A header is trusted only when magic, version,
size, its own checksum, the fingerprint, the slot number, the payload size and the key length
all check out; anything else reads as "no page here". Keys never become file names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ..layout import HEADER_NBYTES, strided

MAGIC = b"TUTTISLT"
VERSION = 1
MAX_KEY_BYTES = 256
_CHECKED = 4088
_KEY_OFFSET = 80
_UNITS_OFFSET = 336
MAX_UNITS = (_CHECKED - _UNITS_OFFSET) // 8  # 469 layers
MAX_SEQ = 1 << 62  # sequence numbers are time_ns-based; anything near 2**64 is damage

DTYPE = np.dtype({
    "names": ["magic", "version", "header_nbytes", "fingerprint", "seq", "payload_nbytes",
              "checksum", "slot", "created_ns", "key_len", "n_units", "key", "hcheck"],
    "formats": ["S8", "<u4", "<u4", "V16", "<u8", "<u8", "<u8", "<u8", "<u8", "<u2", "<u2",
                f"V{MAX_KEY_BYTES}", "<u8"],
    "offsets": [0, 8, 12, 16, 32, 40, 48, 56, 64, 72, 74, _KEY_OFFSET, _CHECKED],
    "itemsize": HEADER_NBYTES,
})


def fingerprint(identity: dict) -> bytes:
    """16-byte fingerprint of an identity (canonical JSON, SHA-256)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()[:16]


def encode_key(key) -> bytes | None:
    """UTF-8 bytes of a key, or None when it is not a usable key (not str, empty, too long)."""
    if not isinstance(key, str) or not key:
        return None
    b = key.encode("utf-8", "surrogatepass")
    return b if len(b) <= MAX_KEY_BYTES else None


def _header_checksums(raw: np.ndarray) -> np.ndarray:
    from ..engine import extension
    n = raw.shape[0]
    return extension().checksum_groups(strided(raw.ctypes.data, n, HEADER_NBYTES),
                                       np.full(n, _CHECKED, np.int64),
                                       np.arange(n + 1, dtype=np.int64))


def pack(raw: np.ndarray, keys: list[bytes], slots, seqs, checksums, units: np.ndarray,
         fp: bytes, payload_nbytes: int, created_ns: int) -> None:
    """Write len(keys) headers into raw (uint8, C-contiguous, shape [n, 4096]).

    units: uint64 [n, n_units] unit checksums."""
    n = len(keys)
    n_units = units.shape[1]
    if n_units > MAX_UNITS:
        raise ValueError(f"a header holds at most {MAX_UNITS} unit checksums, got {n_units}")
    rec = raw[:n].reshape(-1).view(DTYPE)
    rec[...] = np.zeros(1, DTYPE)
    rec["magic"] = MAGIC
    rec["version"] = VERSION
    rec["header_nbytes"] = HEADER_NBYTES
    rec["fingerprint"] = np.frombuffer(fp, dtype="V16")[0]
    rec["seq"] = seqs
    rec["payload_nbytes"] = payload_nbytes
    rec["checksum"] = checksums
    rec["slot"] = slots
    rec["created_ns"] = created_ns
    rec["key_len"] = [len(k) for k in keys]
    rec["n_units"] = n_units
    raw[:n, _UNITS_OFFSET:_UNITS_OFFSET + 8 * n_units] = (
        np.ascontiguousarray(units, dtype="<u8").view(np.uint8).reshape(n, 8 * n_units))
    for i, k in enumerate(keys):
        raw[i, _KEY_OFFSET:_KEY_OFFSET + len(k)] = np.frombuffer(k, dtype=np.uint8)
    rec["hcheck"] = _header_checksums(raw[:n])


@dataclass
class Parsed:
    valid: np.ndarray  # bool [n]
    keys: list  # str or None, [n]
    seq: np.ndarray
    checksum: np.ndarray
    empty: np.ndarray  # bool [n]: all-zero magic (tombstone or never written)
    units: list  # bytes of the unit checksums, [n]


def _unused_bytes_set(raw: np.ndarray, key_len: np.ndarray, n_units: int) -> np.ndarray:
    """True for headers with a non-zero byte where the format has none (padding, key tail,
    unit tail): a header that parses as valid must be exactly what pack() writes."""
    bad = raw[:, 76:_KEY_OFFSET].any(axis=1)
    bad |= raw[:, _UNITS_OFFSET + 8 * n_units:_CHECKED].any(axis=1)
    key_area = raw[:, _KEY_OFFSET:_UNITS_OFFSET]
    tail = np.arange(MAX_KEY_BYTES)[None, :] >= np.minimum(key_len, MAX_KEY_BYTES)[:, None]
    return bad | (key_area.astype(bool) & tail).any(axis=1)


def parse(raw: np.ndarray, fp: bytes, slots: np.ndarray, payload_nbytes: int,
          n_units: int) -> Parsed:
    """Validate n headers (raw uint8 [n, 4096]) expected at `slots` of a namespace."""
    rec = raw.reshape(-1).view(DTYPE)
    ok = rec["magic"] == MAGIC
    ok &= rec["version"] == VERSION
    ok &= rec["header_nbytes"] == HEADER_NBYTES
    ok &= rec["fingerprint"] == np.frombuffer(fp, dtype="V16")[0]
    ok &= rec["slot"] == np.asarray(slots, dtype=np.uint64)
    ok &= rec["payload_nbytes"] == payload_nbytes
    ok &= (rec["key_len"] >= 1) & (rec["key_len"] <= MAX_KEY_BYTES)
    ok &= rec["n_units"] == n_units
    ok &= rec["seq"] < MAX_SEQ
    ok &= ~_unused_bytes_set(raw, rec["key_len"], n_units)
    if ok.any():
        ok &= _header_checksums(raw) == rec["hcheck"]
    keys: list = [None] * len(rec)
    for i in np.flatnonzero(ok):
        kb = raw[i, _KEY_OFFSET:_KEY_OFFSET + int(rec["key_len"][i])].tobytes()
        try:
            keys[i] = kb.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            ok[i] = False
    empty = rec["magic"] == b""
    ub = raw[:, _UNITS_OFFSET:_UNITS_OFFSET + 8 * n_units]
    units = [ub[i].tobytes() if ok[i] else b"" for i in range(len(rec))]
    return Parsed(ok, keys, rec["seq"].copy(), rec["checksum"].copy(), empty, units)
