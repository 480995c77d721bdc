"""Corruption on disk: bit flips, truncations, foreign and out-of-range headers, fsck.

Every injected fault must turn the affected pages into misses (False, not present), raise the
counters (checksum_failures, bad headers), never serve wrong bytes and never raise into the
caller; `tutti-hicache fsck` finds the damage and `--repair` removes it. Page bytes are a
function of the key (page_content) so every read is compared byte for byte. Randomness is
seeded (SEED); failures print the seed and the injected positions.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from tutti_hicache.testing.pagedata import page_content
from tutti_hicache.store import header
from tutti_hicache.cli import main as cli_main
from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.identity import make_identity
from tutti_hicache.layout import HEADER_NBYTES, PageGeometry
from tutti_hicache.store import ObjectStore

E = extension()
SEED = int(os.environ.get("TUTTI_CORRUPTION_SEED", "6061"))
GEOM = PageGeometry("mha", 4, 16, 256, 256)  # 8 objects of 4 KiB, 36 KiB slots
SLOT = 36864
CAP_SLOTS = 64  # 28 slots per 1 MiB segment: rows 0, 1 full, row 2 cut to 8 slots


def ident_for(geometry=GEOM, **kw):
    cfg = TuttiConfig(**kw)
    return make_identity(cfg, model="corruption", geometry=geometry, dtype="bfloat16",
                         pp=(0, 1), cp=(0, 1), tp=(0, 1), heads=[2, 64, 64])


IDENT = ident_for()


def cfg_for(dirs, **kw):
    base = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": CAP_SLOTS * SLOT / 2**30,
            "tutti_segment_gb": 1 / 1024, "tutti_rescan_interval_s": 0.0}
    base.update(kw)
    return TuttiConfig.from_sources(base, env={})




class Pages:
    """Host memory for n pages of `geometry` (objects back to back, 4 KiB-aligned if `shift` 0).

    `addrs` point into `buf`: keep the Pages object alive while the store uses them."""

    def __init__(self, n, geometry=GEOM, shift=0):
        self.sizes = np.array(geometry.object_nbytes, dtype=np.int64)
        self.page = int(self.sizes.sum())
        self.buf = E.AlignedBuffer(n * self.page + shift + 4096)
        self.a = np.frombuffer(self.buf, dtype=np.uint8)
        starts = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.uint64)
        self.addrs = (self.buf.address + shift + np.arange(n, dtype=np.uint64)[:, None]
                      * np.uint64(self.page) + starts[None, :])
        self.shift, self.n = shift, n

    def view(self, i):
        s = self.shift + i * self.page
        return self.a[s:s + self.page]

    def fill(self, keys):
        for i, k in enumerate(keys):
            self.view(i)[:] = page_content(k, self.page)
        return self


def keys_of(n, tag="k"):
    return [f"{tag}-{i:04d}" for i in range(n)]


def write(store, keys, geometry=GEOM):
    for s in range(0, len(keys), 16):
        part = keys[s:s + 16]
        src = Pages(len(part), geometry).fill(part)  # keep the memory alive during the write
        assert store.write_pages(part, src.addrs, True).all()


def read_all(store, keys, geometry=GEOM, aligned=True):
    """Read every key; returns (ok per key, wrong: keys served with wrong bytes)."""
    ok_all, wrong = [], []
    for s in range(0, len(keys), 16):
        part = keys[s:s + 16]
        dst = Pages(len(part), geometry, shift=0 if aligned else 24)
        ok = store.read_pages(part, dst.addrs, aligned)
        for i, k in enumerate(part):
            if ok[i] and not np.array_equal(dst.view(i), page_content(k, dst.page)):
                wrong.append(k)
        ok_all += ok.tolist()
    return np.array(ok_all, dtype=bool), wrong


def assert_new_pages_round_trip(store, n=40):
    """n fresh pages written now (into freed or damaged slots) read back exact."""
    write(store, keys_of(n, "new"))
    ok, wrong = read_all(store, keys_of(n, "new"))
    assert ok.all() and not wrong


def where(store, key):
    """(segment path, byte offset of the slot) of a present key."""
    return store.locate(key)


def flip(path, pos, bit):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def read_header(path, off):
    with open(path, "rb") as f:
        f.seek(off)
        return np.frombuffer(f.read(HEADER_NBYTES), dtype=np.uint8).copy().reshape(1, -1)


def write_header(path, off, raw):
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(np.ascontiguousarray(raw).tobytes())


def reseal(raw):
    """Recompute the header checksum: whatever was changed now passes the checksum test."""
    rec = raw.reshape(-1).view(header.DTYPE)
    rec["hcheck"] = header._header_checksums(raw)
    return raw


def bad_headers(store):
    return store.stats()["bad_headers"]


def dat_files(dirs):
    return sorted(os.path.join(r, f) for d in dirs for r, _, fs in os.walk(d) for f in fs
                  if f.endswith(".dat"))


@pytest.fixture
def filled(store_dirs):
    """A closed store of 60 pages (three rows), its keys, and the slot locations."""
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    ks = keys_of(60)
    write(s, ks)
    loc = {k: where(s, k) for k in ks}
    s.close()
    return store_dirs, ks, loc


# --------------------------------------------------------------------------- payload flips
@pytest.mark.parametrize("aligned", [True, False], ids=["zero_copy", "bounce"])
def test_payload_bit_flips_are_misses(store_dirs, aligned):
    rng = random.Random(f"{SEED}-payload-{aligned}")
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    try:
        ks = keys_of(60)
        write(s, ks)
        hit = rng.sample(ks, 30)
        log = []
        for k in hit:  # one bit in one object of the page (no padding in GEOM)
            path, off = where(s, k)
            obj = rng.randrange(len(GEOM.object_nbytes))
            pos = off + int(s.layout.object_offsets[obj]) + rng.randrange(4096)
            bit = rng.randrange(8)
            flip(path, pos, bit)
            log.append((k, pos, bit))
        ok, wrong = read_all(s, ks, aligned=aligned)
        assert not wrong, (SEED, wrong)
        expect = np.array([k not in hit for k in ks])
        assert (ok == expect).all(), (SEED, log)
        st = s.stats()
        assert st["checksum_failures"] == len(hit) and st["pages"] == len(ks) - len(hit)
        assert not any(k in s for k in hit)
        assert_new_pages_round_trip(s, len(hit))  # into the dropped slots
    finally:
        s.close()


def test_payload_flips_seen_by_the_layer_reads(tmp_path):
    """The linker's per-layer reads check each layer against its own checksum."""
    rng = random.Random(f"{SEED}-layers")
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    try:
        ks = keys_of(12)
        write(s, ks)
        bad_layer = {}
        for k in ks[::2]:
            layer = rng.randrange(GEOM.num_layers)
            path, off = where(s, k)
            obj = 2 * layer + rng.randrange(2)
            flip(path, off + int(s.layout.object_offsets[obj]) + rng.randrange(4096), rng.randrange(8))
            bad_layer[k] = layer
        entries = s.pin(ks)
        plan = s.plan_pages(entries)
        stride = s.layer_object_stride()
        dst = E.AlignedBuffer(len(ks) * 2 * stride)
        a = np.frombuffer(dst, dtype=np.uint8)
        addr = dst.address + np.arange(len(ks), dtype=np.uint64) * np.uint64(2 * stride)
        with s.stream_layers(plan, [(layer, slice(None)) for layer in range(GEOM.num_layers)],
                             [addr] * GEOM.num_layers) as layers:  # one layer at a time, one buffer
            for layer in range(GEOM.num_layers):
                a[:] = 0
                layers.allow(layer + 1)
                ok = layers.wait(layer)
                for i, k in enumerate(ks):
                    want_ok = bad_layer.get(k) != layer
                    assert ok[i] == want_ok or (not ok[i] and k in bad_layer), (SEED, k, layer)
                    if ok[i]:
                        want = page_content(k, s.layout.geometry.page_nbytes)[
                            layer * 2 * 4096:(layer + 1) * 2 * 4096]
                        assert np.array_equal(a[i * 2 * stride:(i + 1) * 2 * stride], want), \
                            (k, layer)
        s.unpin(entries)
        assert s.stats()["checksum_failures"] == len(bad_layer)
        assert not any(k in s for k in bad_layer)
    finally:
        s.close()


@pytest.mark.parametrize("padded", [False, True], ids=["checked-in-cpp", "checked-in-python"])
def test_a_corrupt_layer_fails_its_chunk_and_only_it(tmp_path, padded):
    """Layers pass whole and verified in order until the corrupt one, which does not; without the
    corrupt page every layer passes. Unpadded objects are checked by the C++ stream as they
    land, padded ones (checksums computed in Python) by wait_whole()."""
    g = PageGeometry("mha", 4, 16, 200, 200) if padded else GEOM  # 3200-byte objects: padded
    s = ObjectStore(cfg_for([tmp_path]), g, ident_for(g))
    try:
        ks = keys_of(6)
        for k in ks:
            src = Pages(1, g).fill([k])
            assert s.write_pages([k], src.addrs, not padded).all()
        path, off = where(s, ks[3])
        flip(path, off + int(s.layout.object_offsets[4]) + 5, 2)  # layer 2's K object
        for keys, want in ((ks, [True, True, False]), (ks[:3] + ks[4:], [True] * g.num_layers)):
            entries = s.pin(keys)
            stride = s.layer_object_stride()
            dst = E.AlignedBuffer(len(keys) * 2 * stride)
            addr = dst.address + np.arange(len(keys), dtype=np.uint64) * np.uint64(2 * stride)
            chunks = [(layer, slice(None)) for layer in range(g.num_layers)]
            wholes = []
            with s.stream_layers(s.plan_pages(entries), chunks, [addr] * g.num_layers) as layers:
                for layer in range(g.num_layers):
                    layers.allow(layer + 1)
                    wholes.append(layers.wait_whole(layer)[1])
                    if not wholes[-1]:
                        break
            s.unpin(entries)
            assert wholes == want
    finally:
        s.close()


def test_bit_flips_in_padding_are_harmless(tmp_path):
    """Bytes between an object's end and the next 4 KiB boundary are not page bytes."""
    g = PageGeometry("mha", 2, 16, 200, 200)  # 3200-byte objects, 896 bytes of padding each
    rng = random.Random(f"{SEED}-padding")
    s = ObjectStore(cfg_for([tmp_path]), g, ident_for(g))
    try:
        ks = keys_of(8)
        for k in ks:
            src = Pages(1, g).fill([k])
            assert s.write_pages([k], src.addrs, False).all()
        for k in ks:
            path, off = where(s, k)
            obj = rng.randrange(4)
            flip(path, off + int(s.layout.object_offsets[obj]) + 3200 + rng.randrange(896),
                 rng.randrange(8))
        ok, wrong = read_all(s, ks, g, aligned=False)
        assert ok.all() and not wrong and s.stats()["checksum_failures"] == 0
    finally:
        s.close()


# ---------------------------------------------------------------------------- header flips
def test_header_bit_flips_are_misses_after_restart(filled):
    dirs, ks, loc = filled
    rng = random.Random(f"{SEED}-header")
    hit = rng.sample(ks, 25)
    log = []
    for k in hit:  # anywhere in the 4 KiB: fields, key, unit checksums, padding, hcheck
        path, off = loc[k]
        pos, bit = rng.randrange(HEADER_NBYTES), rng.randrange(8)
        flip(path, off + pos, bit)
        log.append((k, pos, bit))
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert sorted(s.entries()) == sorted(set(ks) - set(hit)), (SEED, log)
        assert bad_headers(s) == len(hit)
        ok, wrong = read_all(s, ks)
        assert not wrong and (ok == np.array([k not in hit for k in ks])).all()
        assert_new_pages_round_trip(s)  # a bad header is a free slot: new pages land there
    finally:
        s.close()


def test_header_garbage_and_zeroing(filled):
    dirs, ks, loc = filled
    rng = np.random.default_rng(SEED)
    path, off = loc[ks[3]]
    write_header(path, off, rng.integers(0, 256, (1, HEADER_NBYTES), dtype=np.uint8))
    path, off = loc[ks[4]]
    write_header(path, off, np.zeros((1, HEADER_NBYTES), np.uint8))  # a tombstone
    path, off = loc[ks[5]]
    raw = read_header(path, off)
    raw[0, 4000:4088] = 0xAB  # the header's unused tail: the checksum no longer matches
    write_header(path, off, raw)
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert ks[3] not in s and ks[4] not in s and ks[5] not in s and len(s) == 57
        assert bad_headers(s) == 2  # the tombstone is a free slot, not a bad header
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.sum() == 57
    finally:
        s.close()


def test_stats_report_bad_headers(filled):
    dirs, ks, loc = filled
    path, off = loc[ks[0]]
    flip(path, off + 8, 0)
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert s.stats().get("bad_headers") == 1
    finally:
        s.close()


# ------------------------------------------------- headers with a valid checksum, wrong content
def test_header_of_another_slot_is_refused(filled):
    """A header (or a whole slot) copied to another slot: checksum fine, slot number wrong."""
    dirs, ks, loc = filled
    a, b = ks[10], ks[40]  # different rows
    pa, oa = loc[a]
    pb, ob = loc[b]
    with open(pa, "rb") as f:
        f.seek(oa)
        whole = f.read(SLOT)
    with open(pb, "r+b") as f:
        f.seek(ob)
        f.write(whole)
    c, d = ks[11], ks[12]
    write_header(*loc[d], read_header(*loc[c]))  # header only: d's payload under c's header
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert a in s and b not in s and c in s and d not in s
        assert s.entries()[a].slot != s.entries()[c].slot
        assert bad_headers(s) == 2
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.sum() == 58
    finally:
        s.close()


def test_header_with_a_foreign_fingerprint_is_refused(filled):
    dirs, ks, loc = filled
    other = header.fingerprint(ident_for(revision="v2"))
    path, off = loc[ks[7]]
    raw = read_header(path, off)
    raw[0, 16:32] = np.frombuffer(other, np.uint8)
    write_header(path, off, reseal(raw))
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert ks[7] not in s and len(s) == 59 and bad_headers(s) == 1
    finally:
        s.close()


def _field(raw, name, value):
    raw.reshape(-1).view(header.DTYPE)[name] = value
    return raw


OUT_OF_RANGE = {
    "magic": lambda r: _field(r, "magic", b"TUTTISLU"),
    "version_2": lambda r: _field(r, "version", 2),
    "version_0": lambda r: _field(r, "version", 0),
    "header_nbytes": lambda r: _field(r, "header_nbytes", 8192),
    "payload_short": lambda r: _field(r, "payload_nbytes", 8 * 4096 - 1),
    "payload_long": lambda r: _field(r, "payload_nbytes", 2**63),
    "slot_huge": lambda r: _field(r, "slot", 2**64 - 1),
    "key_len_0": lambda r: _field(r, "key_len", 0),
    "key_len_257": lambda r: _field(r, "key_len", 257),
    "key_len_max": lambda r: _field(r, "key_len", 65535),
    "n_units_0": lambda r: _field(r, "n_units", 0),
    "n_units_5": lambda r: _field(r, "n_units", 5),
    "n_units_max": lambda r: _field(r, "n_units", 65535),
    "key_not_utf8": lambda r: _utf8_bad(r),
}


def _utf8_bad(raw):
    klen = int(raw.reshape(-1).view(header.DTYPE)["key_len"][0])
    raw[0, 80 + klen - 2:80 + klen] = (0xC0, 0xAF)  # an overlong encoding
    return raw


@pytest.mark.parametrize("what", sorted(OUT_OF_RANGE))
def test_header_fields_out_of_range_are_refused(filled, what):
    dirs, ks, loc = filled
    path, off = loc[ks[20]]
    write_header(path, off, reseal(OUT_OF_RANGE[what](read_header(path, off))))
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert ks[20] not in s and len(s) == 59 and bad_headers(s) == 1
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.sum() == 59
        write(s, keys_of(10, "new"))  # and the store keeps working
    finally:
        s.close()


def test_header_with_a_huge_sequence_number_does_not_break_writes(filled):
    dirs, ks, loc = filled
    path, off = loc[ks[0]]
    write_header(path, off, reseal(_field(read_header(path, off), "seq", 2**64 - 1)))
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        new = keys_of(4, "new")
        src = Pages(4).fill(new)
        ok = s.write_pages(new, src.addrs, True)  # raises today
        assert ok.all() and all(k in s for k in new)
    finally:
        s.close()


# ------------------------------------------------------------------------------ truncations
def test_truncation_under_a_live_store(store_dirs):
    """A segment cut short while the store is open: pages past the cut are misses."""
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    try:
        ks = keys_of(28)  # row 0
        write(s, ks)
        slot = {k: s.entries()[k].slot for k in ks}
        path, _ = where(s, ks[0])
        os.truncate(path, 10 * SLOT + 5000)  # inside slot 10's payload
        ok, wrong = read_all(s, ks)
        assert not wrong
        assert (ok == np.array([slot[k] < 10 for k in ks])).all(), ok
        # writes go on (the file grows back), and what is written reads back
        write(s, keys_of(20, "new"))
        ok, wrong = read_all(s, keys_of(20, "new"))
        assert ok.all() and not wrong
    finally:
        s.close()


@pytest.mark.parametrize("cut", ["zero", "mid_slot", "mid_header"])
def test_truncated_segment_after_restart(filled, cut):
    dirs, ks, loc = filled
    path = loc[ks[0]][0]  # row 0: slots 0..27
    size = {"zero": 0, "mid_slot": 7 * SLOT + 9000, "mid_header": 7 * SLOT + 100}[cut]
    os.truncate(path, size)
    lost = {k for k in ks if loc[k][0] == path and loc[k][1] + SLOT > size}
    for writer in (False, True):
        s = ObjectStore(cfg_for(dirs), GEOM, IDENT, writer=writer)
        try:
            # a slot cut inside its payload keeps its header: listed, but its read fails
            assert set(ks) - lost <= set(s.entries()) <= set(ks)
            ok, wrong = read_all(s, ks)
            assert not wrong and (ok == np.array([k not in lost for k in ks])).all()
            if writer:  # the row is sized back to its slots, and the store keeps working
                assert os.path.getsize(path) == 28 * SLOT
                write(s, keys_of(30, "new"))
                ok, wrong = read_all(s, keys_of(30, "new"))
                assert ok.all() and not wrong
        finally:
            s.close()


def test_deleted_segment_of_one_directory(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    ks = keys_of(40)
    write(s, ks)
    loc = {k: where(s, k) for k in ks}
    s.close()
    gone = loc[ks[1]][0]  # row 0 of directory b (odd slots)
    os.unlink(gone)
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        lost = {k for k in ks if loc[k][0] == gone}
        assert lost and sorted(s.entries()) == sorted(set(ks) - lost)
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.sum() == len(ks) - len(lost)
        assert_new_pages_round_trip(s)
    finally:
        s.close()


# ------------------------------------------------------------------------- verify=false
def test_verify_off_still_checks_pages_written_by_a_previous_process(filled):
    dirs, ks, loc = filled
    path, off = loc[ks[2]]
    flip(path, off + 4096 + 123, 3)  # as if the payload never reached the device
    s = ObjectStore(cfg_for(dirs, tutti_verify=False), GEOM, IDENT)
    try:
        ok, wrong = read_all(s, ks)
        assert not wrong, f"wrong bytes served for {wrong}"
    finally:
        s.close()


# ------------------------------------------------------------------- failed write batches
def test_failed_write_batch_is_not_reported_stored_later(tmp_path, monkeypatch):
    s = ObjectStore(cfg_for([tmp_path], tutti_durability="sync"), GEOM, IDENT)
    try:
        ks = keys_of(4)
        src = Pages(4).fill(ks)
        real = os.fdatasync

        def eio(fd):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", eio)
        try:
            ok = s.write_pages(ks, src.addrs, True)
        except OSError:
            ok = np.zeros(4, bool)
        assert not ok.any()
        monkeypatch.setattr(os, "fdatasync", real)
        ok = s.write_pages(ks, src.addrs, True)
        assert all(k in s for k in ks[:int(ok.sum())]) and ok.all()
        got, wrong = read_all(s, ks)
        assert got.all() and not wrong
    finally:
        s.close()


# -------------------------------------------------------------------------------------- fsck
def test_fsck_finds_and_repair_drops_bad_payloads(filled, capsys):
    dirs, ks, loc = filled
    rng = random.Random(f"{SEED}-fsck")
    hit = sorted(rng.sample(ks, 5))
    for k in hit:
        path, off = loc[k]
        flip(path, off + 4096 + rng.randrange(8 * 4096), rng.randrange(8))
    d = [str(x) for x in dirs]
    assert cli_main(["fsck", *d]) == 1
    out = capsys.readouterr().out
    assert "60 pages checked, 5 bad payloads" in out and "0 unreadable headers" in out
    assert sorted(line.split()[-1] for line in out.splitlines() if "bad:" in line) == hit
    assert cli_main(["fsck", *d, "--repair"]) == 0
    assert "5 bad payloads dropped" in capsys.readouterr().out
    assert cli_main(["fsck", *d]) == 0
    assert "55 pages checked, 0 bad payloads, 0 unreadable headers" in capsys.readouterr().out
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert sorted(s.entries()) == sorted(set(ks) - set(hit))
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.sum() == 55
    finally:
        s.close()


def test_fsck_finds_bad_headers(filled, capsys):
    dirs, ks, loc = filled
    for k in ks[:3]:
        path, off = loc[k]
        flip(path, off + 90, 1)
    assert cli_main(["fsck", *map(str, dirs)]) == 1
    assert "57 pages checked, 0 bad payloads, 3 unreadable headers" in capsys.readouterr().out


def test_fsck_repair_clears_bad_headers(filled, capsys):
    dirs, ks, loc = filled
    path, off = loc[ks[0]]
    flip(path, off + 90, 1)
    d = [str(x) for x in dirs]
    assert cli_main(["fsck", *d, "--repair"]) == 0
    capsys.readouterr()
    assert cli_main(["fsck", *d]) == 0, capsys.readouterr().out


def test_fsck_with_a_truncated_segment(filled, capsys):
    dirs, ks, loc = filled
    row0 = loc[ks[0]][0]
    os.truncate(row0, 0)
    d = [str(x) for x in dirs]
    intact = sorted(k for k in ks if loc[k][0] != row0)
    assert cli_main(["fsck", *d, "--repair"]) == 0  # the file made its row's size again
    assert cli_main(["fsck", *d]) == 0
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert sorted(s.entries()) == intact, "fsck --repair removed healthy pages"
    finally:
        s.close()


def test_fsck_reports_a_damaged_identity_file(filled, capsys):
    dirs, ks, loc = filled
    ns = os.path.dirname(loc[ks[0]][0])
    with open(os.path.join(ns, "identity.json"), "w") as f:
        f.write("{not json")
    assert cli_main(["fsck", *map(str, dirs)]) == 1
