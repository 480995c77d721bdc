"""The store's bookkeeping at the edges a review found: a row taken over from another writer, a
reused slot whose tombstone never landed, the LRU after a restart, a truncated segment file.
Real files on temporary directories, the store's own scheduler, a second process where the case
needs one."""

import errno
import logging
import multiprocessing as mp
import os

import numpy as np
import pytest

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import engine_for
from tutti_hicache.store import ObjectStore
from tutti_hicache.store import scan as scan_module

from test_store import GEOM, IDENT, Pages, cfg_for, keys

SLOT = 36864  # a GEOM slot: a 4 KiB header and 8 objects of 4 KiB


def cfg_slots(dirs, slots, seg_slots, **kw):
    """A store of `slots` slots in segment files of `seg_slots` slots (rows of seg_slots)."""
    base = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": slots * SLOT / 2**30,
            "tutti_segment_gb": seg_slots * SLOT / 2**30, "tutti_rescan_interval_s": 0.0}
    base.update(kw)
    return TuttiConfig.from_sources(base, env={})


def accounting(store) -> dict:
    """Every slot of the rows the store owns must be in exactly one place: an own entry, the free
    list, a reservation, a zombie or a hold. Returns the slots in none (lost), in more than one
    (dup), and the foreign entries sitting in own rows."""
    ix = store._index
    with store._rows._lock, store._lock:  # Rows' lock first: no claim half done
        slots = set()
        for r in store._rows.owned:
            slots.update(store._ns.row_slots(r).tolist())
        own = [e.slot for e in ix.entries.values() if e.owned]
        placed = own + [f[0] for f in ix.free] + list(ix.reserved.values()) + \
            list(ix.zombies) + list(ix.held)
        count = {s: 0 for s in slots}
        for s in placed:
            if s in count:
                count[s] += 1
        return {"lost": sorted(s for s, c in count.items() if c == 0),
                "dup": sorted(s for s, c in count.items() if c > 1),
                "foreign_in_own": sorted(e.slot for e in ix.entries.values()
                                         if not e.owned and e.slot in slots),
                "free": len(ix.free)}


def reads_back(store, ks, src) -> np.ndarray:
    """Per key, True when it reads back byte-exact from src (same order); a wrong byte raises."""
    dst = Pages(len(ks), seed=None)
    ok = store.read_pages(ks, dst.addrs, True)
    for i in np.flatnonzero(ok):
        assert (dst.page(i) == src.page(i)).all(), f"{ks[i]} served another page's bytes"
    return ok


# ------------------------------------------------------- a row taken over from another writer
def _clearing_writer(dirs, out, go):
    """Writer A: stores 4 pages, waits, clear()s them (SGLang's flush_cache) and exits."""
    s = ObjectStore(cfg_slots(dirs, 8, 4), GEOM, IDENT)
    src = Pages(4, seed=31)
    out.put(bool(s.write_pages(keys(4, "a"), src.addrs, True).all()))
    go.get()
    out.put(s.clear())
    s.close()


def test_a_row_taken_from_another_writer_forgets_the_pages_it_no_longer_holds(tmp_path):
    """B learns A's pages (foreign), A clears them and exits, B takes A's row. The row's headers
    are empty now: B must forget what it learned there and get the slots as free ones. Before,
    B kept the four entries at empty slots: 4 of its 8 slots were in no free list and no LRU
    (never reusable until a restart), the cleared pages were reported present, and a write of one
    was deduplicated (True, nothing written)."""
    dirs = [tmp_path / "s"]
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_clearing_writer, args=(dirs, out, go))
    p.start()
    b = None
    try:
        assert out.get(timeout=60)
        b = ObjectStore(cfg_slots(dirs, 8, 4), GEOM, IDENT)
        learned = b.entries()
        assert set(keys(4, "a")) <= set(learned) and not any(learned[k].owned for k in keys(4, "a"))
        go.put("clear")
        assert out.get(timeout=60) == 4
        p.join(60)
        assert p.exitcode == 0
        b.rebalance()  # count the writers again: B alone, its share is every row
        src = Pages(8, seed=32)
        assert b.write_pages(keys(8, "b"), src.addrs, True).all()
        assert b.owned_rows() == {0, 1}
        acc = accounting(b)
        assert acc["lost"] == [] and acc["dup"] == [] and acc["foreign_in_own"] == []
        assert set(b.entries()) == set(keys(8, "b"))
        assert not b.present(keys(4, "a")).any()
        # a cleared page is stored again, for real (not deduplicated against a stale entry)
        st, a_src = b.stats(), Pages(4, seed=31)
        assert b.write_pages(keys(1, "a"), a_src.addrs[:1], True).all()
        after = b.stats()
        assert after["dedup_skips"] == st["dedup_skips"]
        assert after["write_pages"] == st["write_pages"] + 1
        assert reads_back(b, keys(1, "a"), a_src).all()
    finally:
        if p.is_alive():
            go.put("clear")
            p.join(30)
        if b is not None:
            b.close()


# --------------------------------------------- a reused slot whose tombstone did not land
class FailTombstones:
    """An engine (give it to the store) whose writes of all-zero headers (tombstones) fail with
    EIO, writing nothing, while `armed`."""

    def __init__(self, engine):
        self.engine, self.zero, self.armed = engine, None, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, op, files, offsets, nbytes, addrs, *rest):
        if op == "write" and self.armed and len(files) and (np.asarray(addrs) == self.zero).all():
            return np.full(len(files), -errno.EIO, dtype=np.int32)
        return self.engine.submit(op, files, offsets, nbytes, addrs, *rest)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("how", ["refused", "failed"])
def test_a_reused_slot_whose_tombstone_did_not_land_keeps_its_old_page(tmp_path, how, verify):
    """A write evicts pages whose tombstones are refused by the write backlog (one tombstone
    batch of 257 headers is more than tutti_write_backlog_mb=1 MiB, while each payload chunk of
    16 pages fits: a linker offload's begin / land per chunk / publish) or fail (EIO). Their
    payloads must not be written: the evicted pages' headers are still valid on disk. Nothing is
    published, every reservation comes back as a free slot, and after a restart (verify on or
    off) the evicted pages are back and read byte-exact. Before, the payloads went over them:
    after a restart they were present again over other pages' bytes, every read a checksum
    failure counted as damage (verify off too: pages found at open are always verified, so no
    wrong byte was served, which reads_back checks)."""
    n_old, n_new = 260, 257 if how == "refused" else 20
    dirs = [tmp_path / "s"]
    cfg = cfg_slots(dirs, n_old, n_old, tutti_write_backlog_mb=1)
    engine = FailTombstones(engine_for(cfg))
    s = ObjectStore(cfg, GEOM, IDENT, engine=engine)
    engine.zero = s._io._zero.address
    old, old_src = keys(n_old, "k"), Pages(n_old, seed=41)
    for a in range(0, n_old, 20):
        assert s.write_pages(old[a:a + 20], old_src.addrs[a:a + 20], True).all()
    new, new_src = keys(n_new, "n"), Pages(n_new, seed=42)
    engine.armed = how == "failed"
    before = set(s.entries())
    w = s.begin_pages(new)
    engine.armed = False
    evicted = sorted(before - set(s.entries()))
    assert len(evicted) == n_new
    if how == "refused":
        assert s.gate.stats["refused"] == 1
    for a in range(0, n_new, 16):
        s.land_pages(w, a, min(n_new, a + 16), new_src.addrs[a:a + 16], True)
    [ok] = s.publish_pages([w])
    assert not ok.any() and s.stats()["write_failures"] == n_new
    acc = accounting(s)
    assert acc["lost"] == [] and acc["dup"] == [] and acc["free"] == n_new and not s._index.reserved
    s.close()

    s = ObjectStore(cfg_slots(dirs, n_old, n_old, tutti_verify=verify), GEOM, IDENT)
    try:
        assert set(s.entries()) == set(old)  # the evicted pages' headers were never tombstoned
        assert reads_back(s, old, old_src).all()
        assert s.stats()["checksum_failures"] == 0
    finally:
        s.close()


def test_a_write_that_reuses_no_slot_asks_no_tombstone_budget(tmp_path):
    """begin() went through the write scheduler (a write window to wait for, the backlog to be
    refused by) for a header's bytes per page even when no slot of the batch was reused and
    there was nothing to tombstone."""
    n = 20
    s = ObjectStore(cfg_slots([tmp_path / "s"], n, n), GEOM, IDENT)
    try:
        new, src = keys(n, "n"), Pages(n, seed=43)
        w = s.begin_pages(new)
        assert s.gate.stats["write_chunks"] == 0  # a fresh store: no slot is reused
        s.land_pages(w, 0, n, src.addrs, True)
        [ok] = s.publish_pages([w])
        assert ok.all() and reads_back(s, new, src).all()
        w = s.begin_pages(keys(4, "m"))  # four slots reused: their tombstones are scheduled
        assert s.gate.stats["write_chunks"] > 0 and w.landed.ready.all()
        s.publish_pages([w])
    finally:
        s.close()


# ------------------------------------------------------------------ the LRU after a restart
@pytest.mark.parametrize("chunk", [scan_module.SCAN_CHUNK, 3])
def test_after_a_restart_pages_are_evicted_oldest_first(tmp_path, monkeypatch, chunk):
    """The LRU a restart rebuilds from the headers follows their sequence numbers (the order the
    pages were written), also over several scan chunks. Before, it followed the slots: the
    newest pages, written into the lowest slots, were the first to go."""
    monkeypatch.setattr(scan_module, "SCAN_CHUNK", chunk)
    dirs = [tmp_path / "s"]
    cfg = cfg_slots(dirs, 8, 8)
    s = ObjectStore(cfg, GEOM, IDENT)
    src = Pages(8, seed=51)
    a, b = keys(8, "a"), keys(4, "b")
    assert s.write_pages(a, src.addrs, True).all()
    assert s.write_pages(b, src.addrs[:4], True).all()  # evicts a0..a3, takes their slots 0..3
    assert sorted(s.entries()[k].slot for k in b) == [0, 1, 2, 3]
    s.close()
    s = ObjectStore(cfg, GEOM, IDENT)
    try:
        gone = []
        for i, k in enumerate(keys(8, "c")):  # one page at a time: each evicts one
            have = set(s.entries())
            assert s.write_pages([k], src.addrs[i:i + 1], True).all()
            [g] = have - set(s.entries())
            gone.append(g)
        assert gone == a[4:] + b
    finally:
        s.close()


# ---------------------------------------------------------------- a truncated segment file
def attach_warnings(caplog, path) -> list:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


@pytest.mark.parametrize("writer", [True, False])
def test_a_truncated_segment_file_is_reported_at_attach(tmp_path, caplog, writer):
    """A segment file cut to half (external damage): the pages in the cut half are gone, which
    attach must say: one warning naming the file, and the lost slots in bad_headers. Before,
    nothing: a writer's attach extends the file back with zeros before the header scan, a
    reader's scan took the short reads for empty slots. The writer then fills the slots again."""
    dirs = [tmp_path / "s"]
    cfg = cfg_slots(dirs, 16, 16)
    s = ObjectStore(cfg, GEOM, IDENT)
    src, ks = Pages(16, seed=61), keys(16)
    assert s.write_pages(ks, src.addrs, True).all()
    seg = s.locate(ks[0])[0]
    s.close()
    os.truncate(seg, 8 * SLOT)
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg, GEOM, IDENT, writer=writer)
    try:
        assert len(s) == 8 and s.stats()["bad_headers"] == 8
        assert len(attach_warnings(caplog, seg)) == 1, caplog.text
        assert reads_back(s, ks[:8], src).all()
        if writer:
            more = Pages(8, seed=62)
            st = s.stats()
            assert s.write_pages(keys(8, "m"), more.addrs, True).all()
            assert s.stats()["evictions"] == st["evictions"]  # the cut slots are free again
    finally:
        s.close()


def test_a_segment_file_found_empty_is_not_reported(tmp_path, caplog):
    """A segment file of size 0 is what a creation interrupted between its create and its
    fallocate leaves (or one being created by another writer right now): no page was ever there,
    so attach sizes it without a warning and counts nothing."""
    dirs = [tmp_path / "s"]
    cfg = cfg_slots(dirs, 16, 8)  # two rows of 8
    s = ObjectStore(cfg, GEOM, IDENT)
    src = Pages(4, seed=63)
    assert s.write_pages(keys(4), src.addrs, True).all()
    seg1 = os.path.join(s.ns_dirs[0], "seg-000001.dat")
    s.close()
    if os.path.exists(seg1):
        os.unlink(seg1)
    open(seg1, "wb").close()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg, GEOM, IDENT)
    try:
        assert len(s) == 4 and s.stats()["bad_headers"] == 0
        assert attach_warnings(caplog, seg1) == [], caplog.text
    finally:
        s.close()


def flip_payload_byte(s, key):
    path, off = s.locate(key)
    with open(path, "r+b") as f:
        f.seek(off + 4096 + 100)
        b = f.read(1)
        f.seek(off + 4096 + 100)
        f.write(bytes([b[0] ^ 0x40]))
    return path, off


def header_bytes(path, off):
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(4096)


def test_a_page_dropped_for_a_checksum_failure_stays_gone_after_a_restart(store_dirs):
    """An own page whose payload fails its checksum is dropped and its header tombstoned: a
    restart neither brings it back nor counts it as damage again, and its slot is reused. A
    reader process that finds another writer's page damaged leaves that writer's header alone.
    Before, the page came back at every restart (and failed, and was counted) until its slot
    was reused."""
    cfg = cfg_for(store_dirs)
    s = ObjectStore(cfg, GEOM, IDENT)
    src, ks = Pages(3, seed=71), keys(3)
    assert s.write_pages(ks, src.addrs, True).all()
    path, off = flip_payload_byte(s, ks[1])
    reader = ObjectStore(cfg, GEOM, IDENT, writer=False)  # learns the pages as foreign
    assert reads_back(reader, ks, src).tolist() == [True, False, True]
    st = reader.stats()
    assert st["stale_foreign"] == 1 and st["checksum_failures"] == 0
    reader.close()
    assert header_bytes(path, off).startswith(b"TUTTISLT")  # not the reader's to clear
    assert reads_back(s, ks, src).tolist() == [True, False, True]
    assert s.stats()["checksum_failures"] == 1
    assert header_bytes(path, off) == bytes(4096)
    acc = accounting(s)
    assert acc["lost"] == [] and acc["dup"] == []
    s.close()
    s = ObjectStore(cfg, GEOM, IDENT)
    try:
        assert ks[1] not in s and len(s) == 2
        assert reads_back(s, ks, src).tolist() == [True, False, True]
        assert s.stats()["checksum_failures"] == 0 and s.stats()["bad_headers"] == 0
        more = Pages(s.capacity_slots - 2, seed=72)
        assert s.write_pages(keys(len(more.addrs), "m"), more.addrs, True).all()
        assert s.stats()["evictions"] == 0  # its slot was free
    finally:
        s.close()
