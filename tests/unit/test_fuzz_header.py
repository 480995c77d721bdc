"""Fuzz the slot-header parser (header.parse) and its round trip with header.pack.

Properties, on arbitrary and on mutated 4096-byte headers:
  - parse never raises and answers one row per header, rows independent of each other;
  - a header that parse calls valid re-packs (pack of the fields parse returned, with the expected
    fingerprint, slot, payload size and unit count) into exactly the same 4096 bytes;
  - with the checksum re-sealed after a field change, validity is exactly the rule of the
    format (an independent oracle below), never more permissive.
A header with junk in its unused bytes under a valid checksum is the one case where "valid"
and "round-trips" part ways; it has its own test (test_reserved_bytes_must_be_zero).
Bounded: max_examples per test (about 5,000 headers in all), well under 20 s on 2 cores.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from tutti_hicache.store import header
from tutti_hicache.layout import HEADER_NBYTES

FP = header.fingerprint({"fuzz": 1})
OTHER_FP = header.fingerprint({"fuzz": 2})
N_UNITS = 4
PAYLOAD = 8 * 4096
# Deterministic by default (the same examples every run); TUTTI_FUZZ_RANDOM=1 explores new ones
# (Hypothesis prints the falsifying example and a reproduce_failure line), TUTTI_FUZZ_SCALE=10
# runs ten times the examples.
SCALE = float(os.environ.get("TUTTI_FUZZ_SCALE", "1"))
SETTINGS = dict(deadline=None, derandomize=os.environ.get("TUTTI_FUZZ_RANDOM", "") != "1",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example,
                                       HealthCheck.data_too_large])


def n(examples: int) -> int:
    return max(1, int(examples * SCALE))


U64 = st.integers(0, 2**64 - 1)
SLOTS = st.integers(0, 2**63 - 1)  # the store's slot numbers are int64

keys = st.text(min_size=1, max_size=120).filter(lambda k: header.encode_key(k) is not None) \
    | st.binary(min_size=1, max_size=256).map(lambda b: b.hex()[:256]) \
    | st.just("x" * 256) | st.just("\udc80surrogate") | st.just("é" * 128)


def packed(key: str, slot: int, seq: int, checksum: int, units, created: int,
           fp: bytes = FP, payload: int = PAYLOAD) -> np.ndarray:
    raw = np.zeros((1, HEADER_NBYTES), dtype=np.uint8)
    header.pack(raw, [header.encode_key(key)], [slot], [seq], [checksum],
                np.array([units], dtype=np.uint64), fp, payload, created)
    return raw


def parse1(raw: np.ndarray, slot: int, fp: bytes = FP, payload: int = PAYLOAD,
           n_units: int = N_UNITS):
    return header.parse(np.ascontiguousarray(raw).reshape(1, HEADER_NBYTES), fp,
                        np.array([slot], dtype=np.int64), payload, n_units)


def repack(raw: np.ndarray, p, slot: int) -> np.ndarray:
    """Pack again what parse returned (created_ns is carried over from the bytes)."""
    created = int(raw.reshape(-1).view(header.DTYPE)["created_ns"][0])
    units = np.frombuffer(p.units[0], dtype="<u8")
    return packed(p.keys[0], slot, int(p.seq[0]), int(p.checksum[0]), units, created)


def assert_valid_means_roundtrip(raw: np.ndarray, slot: int) -> None:
    p = parse1(raw, slot)
    assert p.valid.shape == (1,) and len(p.keys) == 1 and len(p.units) == 1
    if p.valid[0]:
        assert isinstance(p.keys[0], str) and len(p.units[0]) == 8 * N_UNITS
        again = repack(raw, p, slot)
        assert np.array_equal(again, raw.reshape(1, -1)), "valid header that does not round-trip"
    else:
        assert p.keys[0] is None and p.units[0] == b""


def oracle(rec, raw: np.ndarray, slot: int) -> bool:
    """The format's rule, written independently of header.parse (checksum assumed sealed)."""
    klen = int(rec["key_len"])
    if not (rec["magic"] == header.MAGIC and rec["version"] == 1
            and rec["header_nbytes"] == HEADER_NBYTES and rec["fingerprint"].tobytes() == FP
            and int(rec["slot"]) == slot and int(rec["payload_nbytes"]) == PAYLOAD
            and 1 <= klen <= 256 and int(rec["n_units"]) == N_UNITS
            and int(rec["seq"]) < header.MAX_SEQ):
        return False
    unused = [raw[0, 76:80], raw[0, 80 + klen:336], raw[0, 336 + 8 * N_UNITS:4088]]
    if any(part.any() for part in unused):  # the format has only zeros there
        return False
    try:
        raw[0, 80:80 + klen].tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


def reseal(raw: np.ndarray) -> np.ndarray:
    raw.reshape(-1).view(header.DTYPE)["hcheck"] = header._header_checksums(raw)
    return raw


good_headers = st.builds(
    packed, keys, st.integers(0, 2**40), U64, U64,
    st.lists(U64, min_size=N_UNITS, max_size=N_UNITS), U64)


# ------------------------------------------------------------------------------ round trip
@pytest.mark.slow  # 500-1200 examples: seconds each on 2 cores
@settings(max_examples=n(500), **SETTINGS)
@given(key=keys, slot=st.integers(0, 2**62), seq=st.integers(0, header.MAX_SEQ - 1), checksum=U64,
       units=st.lists(U64, min_size=N_UNITS, max_size=N_UNITS), created=U64)
def test_pack_parse_round_trip(key, slot, seq, checksum, units, created):
    raw = packed(key, slot, seq, checksum, units, created)
    p = parse1(raw, slot)
    assert p.valid[0] and p.keys[0] == key and not p.empty[0]
    assert int(p.seq[0]) == seq and int(p.checksum[0]) == checksum
    assert np.frombuffer(p.units[0], "<u8").tolist() == units
    assert np.array_equal(repack(raw, p, slot), raw)
    # the same bytes somewhere else, or for someone else, are not a page
    assert not parse1(raw, slot + 1).valid[0]
    assert not parse1(raw, slot, fp=OTHER_FP).valid[0]
    assert not parse1(raw, slot, payload=PAYLOAD + 4096).valid[0]
    assert not parse1(raw, slot, n_units=N_UNITS + 1).valid[0]


def test_pack_refuses_too_many_units():
    with pytest.raises(ValueError):
        packed("k", 0, 1, 2, [0] * (header.MAX_UNITS + 1), 0)


# ------------------------------------------------------------------------- arbitrary bytes
@pytest.mark.slow  # 500-1200 examples: seconds each on 2 cores
@settings(max_examples=n(500), **SETTINGS)
@given(data=st.binary(min_size=HEADER_NBYTES, max_size=HEADER_NBYTES), slot=SLOTS)
@example(data=bytes(HEADER_NBYTES), slot=0)
@example(data=b"\xff" * HEADER_NBYTES, slot=2**63 - 1)
def test_arbitrary_bytes(data, slot):
    raw = np.frombuffer(data, dtype=np.uint8).copy().reshape(1, -1)
    assert_valid_means_roundtrip(raw, slot)
    p = parse1(raw, slot)
    assert bool(p.empty[0]) == (data[:8] == bytes(8))


@settings(max_examples=n(300), **SETTINGS)
@given(prefix=st.binary(min_size=0, max_size=400), slot=st.integers(0, 2**40))
def test_magic_prefixed_garbage(prefix, slot):
    """Garbage that starts like a header: magic, version and size right, the rest random."""
    raw = np.zeros((1, HEADER_NBYTES), dtype=np.uint8)
    head = header.MAGIC + (1).to_bytes(4, "little") + HEADER_NBYTES.to_bytes(4, "little") + FP
    body = (head + prefix)[:HEADER_NBYTES]
    raw[0, :len(body)] = np.frombuffer(body, np.uint8)
    assert_valid_means_roundtrip(raw, slot)
    assert_valid_means_roundtrip(reseal(raw), slot)


# -------------------------------------------------------------------------- mutated headers
@pytest.mark.slow  # 500-1200 examples: seconds each on 2 cores
@settings(max_examples=n(800), **SETTINGS)
@given(raw=good_headers, flips=st.lists(st.tuples(st.integers(0, HEADER_NBYTES - 1),
                                                  st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips_are_never_valid(raw, flips):
    slot = int(raw.reshape(-1).view(header.DTYPE)["slot"][0])
    orig = raw.copy()
    for pos, bit in flips:
        raw[0, pos] ^= np.uint8(1 << bit)
    assume(not np.array_equal(raw, orig))  # an even number of flips of one bit cancels
    p = parse1(raw, slot)
    assert not p.valid[0], f"flips {flips} still parse as a valid header"
    assert_valid_means_roundtrip(raw, slot)


FIELDS = {
    "magic": st.sampled_from([header.MAGIC, b"TUTTISLU", b"\0" * 8, b"tuttislt"]),
    "version": st.sampled_from([0, 1, 2, 2**32 - 1]),
    "header_nbytes": st.sampled_from([0, 4095, 4096, 4097, 8192]),
    "fingerprint": st.sampled_from([FP, OTHER_FP, bytes(16)]),
    "payload_nbytes": st.sampled_from([0, PAYLOAD - 1, PAYLOAD, PAYLOAD + 1, 2**64 - 1]),
    "slot": U64,
    "key_len": st.sampled_from([0, 1, 2, 255, 256, 257, 3000, 65535]),
    "n_units": st.sampled_from([0, N_UNITS - 1, N_UNITS, N_UNITS + 1, header.MAX_UNITS, 65535]),
}


@pytest.mark.slow  # 500-1200 examples: seconds each on 2 cores
@settings(max_examples=n(1200), **SETTINGS)
@given(raw=good_headers, names=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=4),
       data=st.data())
def test_resealed_field_changes_follow_the_format(raw, names, data):
    """Fields set to edge values, checksum re-sealed: valid exactly when the oracle says so."""
    rec = raw.reshape(-1).view(header.DTYPE)
    slot = int(rec["slot"][0])
    for name in sorted(names):
        v = data.draw(FIELDS[name], label=name)
        rec[name] = np.frombuffer(v, dtype="V16")[0] if name == "fingerprint" else v
    klen = int(rec["key_len"][0])
    if 0 < klen <= 256:  # keep the bytes past the key and past the units zero (see module doc)
        raw[0, 80 + klen:336] = 0
    reseal(raw)
    p = parse1(raw, slot)
    assert bool(p.valid[0]) == oracle(rec[0], raw, slot)
    assert_valid_means_roundtrip(raw, slot)


@pytest.mark.slow  # 500-1200 examples: seconds each on 2 cores
@settings(max_examples=n(500), **SETTINGS)
@given(raw=good_headers, key=st.binary(min_size=1, max_size=256))
def test_resealed_arbitrary_key_bytes(raw, key):
    """Any key bytes (invalid UTF-8, NULs, lone surrogates): valid iff decodable, then exact."""
    rec = raw.reshape(-1).view(header.DTYPE)
    slot = int(rec["slot"][0])
    raw[0, 80:336] = 0
    raw[0, 80:80 + len(key)] = np.frombuffer(key, np.uint8)
    rec["key_len"] = len(key)
    reseal(raw)
    p = parse1(raw, slot)
    assert bool(p.valid[0]) == oracle(rec[0], raw, slot)
    if p.valid[0]:
        assert header.encode_key(p.keys[0]) == key
    assert_valid_means_roundtrip(raw, slot)


# --------------------------------------------------------------------- vectorized parsing
@settings(max_examples=n(100), **SETTINGS)
@given(rows=st.lists(st.one_of(
    good_headers,
    st.binary(min_size=HEADER_NBYTES, max_size=HEADER_NBYTES).map(
        lambda b: np.frombuffer(b, np.uint8).copy().reshape(1, -1)),
    good_headers.map(lambda r: (r.__setitem__((0, 100), r[0, 100] ^ 1), r)[1])),
    min_size=1, max_size=24))
def test_batch_parse_equals_row_by_row(rows):
    raw = np.concatenate(rows)
    slots = raw.reshape(-1).view(header.DTYPE)["slot"].astype(np.int64)
    slots[slots < 0] = 0
    batch = header.parse(raw, FP, slots, PAYLOAD, N_UNITS)
    for i in range(len(rows)):
        one = parse1(raw[i:i + 1], int(slots[i]))
        assert batch.valid[i] == one.valid[0] and batch.keys[i] == one.keys[0]
        assert batch.units[i] == one.units[0] and batch.empty[i] == one.empty[0]
        if one.valid[0]:
            assert batch.seq[i] == one.seq[0] and batch.checksum[i] == one.checksum[0]


# ---------------------------------------------------------------------- the unused bytes
@settings(phases=[Phase.explicit], **SETTINGS)  # the explicit examples only: no shrinking
@given(raw=good_headers, pos=st.sampled_from([76, 79, 335, 336 + 8 * N_UNITS, 4087]),
       value=st.integers(1, 255))
@example(raw=packed("k", 3, 1, 2, [5] * N_UNITS, 0), pos=76, value=1)
@example(raw=packed("k", 3, 1, 2, [5] * N_UNITS, 0), pos=335, value=0x41)
@example(raw=packed("k", 3, 1, 2, [5] * N_UNITS, 0), pos=4087, value=0xFF)
def test_reserved_bytes_must_be_zero(raw, pos, value):
    slot = int(raw.reshape(-1).view(header.DTYPE)["slot"][0])
    klen = int(raw.reshape(-1).view(header.DTYPE)["key_len"][0])
    assume(pos >= 80 + klen or pos < 80)
    raw[0, pos] = value
    reseal(raw)
    assert_valid_means_roundtrip(raw, slot)
