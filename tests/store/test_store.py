"""ObjectStore with real I/O: round trips, restart, eviction, pins, dedupe, corruption, sharing."""

import multiprocessing as mp
import os

import numpy as np
import pytest

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import engine_for, extension
from tutti_hicache.layout import PageGeometry
from tutti_hicache.store import ObjectStore

E = extension()
GEOM = PageGeometry("mha", 4, 16, 2 * 64 * 2, 2 * 64 * 2)  # 8 objects of 4 KiB per page
IDENT = {"model": "unit", "tp": [0, 1]}


def cfg_for(dirs, **kw):
    base = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": 64 * 36864 / 2**30,
            "tutti_segment_gb": 1 / 1024, "tutti_rescan_interval_s": 0.0}
    base.update(kw)
    return TuttiConfig.from_sources(base, env={})


class Pages:
    """n host pages of GEOM in an aligned buffer, with random content."""

    def __init__(self, n, seed, geometry=GEOM, offset=0):
        m = len(geometry.object_nbytes)
        self.obj = geometry.object_nbytes[0]
        self.buf = E.AlignedBuffer(n * m * self.obj + offset + 4096)
        self.a = np.frombuffer(self.buf, dtype=np.uint8)
        if seed is not None:
            self.a[:] = np.random.default_rng(seed).integers(1, 256, self.a.size, dtype=np.uint8)
        self.addrs = (self.buf.address + offset + np.arange(n * m, dtype=np.uint64) * self.obj).reshape(n, m)
        self.n, self.m, self.offset = n, m, offset

    def page(self, i):
        s = self.offset + i * self.m * self.obj
        return self.a[s:s + self.m * self.obj]


def keys(n, tag="k"):
    return [f"{tag}{i:063x}"[-64:] for i in range(n)]


@pytest.fixture
def store(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    yield s
    s.close()


def test_roundtrip_and_restart(store_dirs):
    src, ks = Pages(20, seed=1), keys(20)
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    assert s.write_pages(ks, src.addrs, True).all()
    s.close()
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    assert len(s) == 20 and s.prefix_len(ks + ["missing"]) == 20
    dst = Pages(20, seed=None)
    assert s.read_pages(ks, dst.addrs, True).all()
    assert all((dst.page(i) == src.page(i)).all() for i in range(20))
    s.close()


def test_two_copies_of_a_key_on_disk_open_as_the_newer_and_a_free_slot(store_dirs):
    """A key written twice (forgotten in between, as the e2e harness's misplace control does, or
    stored by two writers): reopened, the newer copy is served and the older one's slot is free
    again, so the store still fills every slot it owns."""
    a, b, ks = Pages(1, seed=1), Pages(1, seed=2), keys(1)
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    assert s.write_pages(ks, a.addrs, True).all()
    s.forget(ks)
    assert s.write_pages(ks, b.addrs, True).all()
    slots = s.capacity_slots
    s.close()
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    dst = Pages(1, seed=None)
    assert len(s) == 1 and s.read_pages(ks, dst.addrs, True).all() and (dst.page(0) == b.page(0)).all()
    more, src = keys(slots - 1, tag="m"), Pages(slots - 1, seed=3)
    assert s.write_pages(more, src.addrs, True).all()
    assert len(s) == slots and s.stats()["evictions"] == 0
    s.close()


def test_bounce_path_for_unaligned_memory(store):
    src, dst = Pages(5, seed=2, offset=8), Pages(5, seed=None, offset=24)
    assert store.write_pages(keys(5), src.addrs, False).all()
    assert store.read_pages(keys(5), dst.addrs, False).all()
    assert all((dst.page(i) == src.page(i)).all() for i in range(5))


class WriteCounter:
    """An engine (give it to the store) that counts the write requests submitted through it."""

    def __init__(self, engine):
        self.engine, self.writes = engine, 0

    def __getattr__(self, name):  # read_stream(), counters(), close(), ... go to the engine
        return getattr(self.engine, name)

    def submit(self, op, file, *args):
        self.writes += len(file) if op == "write" else 0
        return self.engine.submit(op, file, *args)


def test_dedupe_writes_nothing_twice(store_dirs):
    """The second write of the same pages sends no write request. Counted per write request, not
    by the engine's bytes: those include the reads of the grower thread, which scans the headers
    of a row it claims ahead of need whenever the CPU runs it (on a busy machine, also between
    the two writes)."""
    cfg = cfg_for(store_dirs)
    engine = WriteCounter(engine_for(cfg))
    store = ObjectStore(cfg, GEOM, IDENT, engine=engine)
    src = Pages(4, seed=3)
    assert store.write_pages(keys(4), src.addrs, True).all()
    assert engine.writes > 0
    before = engine.writes
    assert store.write_pages(keys(4), src.addrs, True).all()
    assert engine.writes == before
    assert store.stats()["dedup_skips"] == 4
    store.close()


def test_capacity_is_a_hard_bound_with_lru_eviction(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    src = Pages(16, seed=4)
    for round_ in range(6):
        assert s.write_pages(keys(16, f"r{round_}"), src.addrs, True).all()
    st = s.stats()
    assert st["pages"] == st["capacity_slots"] == 64 and st["evictions"] == 32
    assert s.prefix_len(keys(16, "r5")) == 16 and s.prefix_len(keys(16, "r1")) == 0
    used = sum(os.path.getsize(os.path.join(r, f)) for d in store_dirs
               for r, _, fs in os.walk(d) for f in fs if f.endswith(".dat"))
    assert used <= s.cfg.capacity_bytes
    s.close()


def test_pinned_pages_survive_eviction(store):
    src = Pages(16, seed=5)
    for r in range(4):
        store.write_pages(keys(16, f"a{r}"), src.addrs, True)
    pinned = keys(16, "a0")  # the least recently used
    entries = store.pin(pinned)
    store.write_pages(keys(16, "b"), src.addrs, True)
    assert store.prefix_len(pinned) == 16
    store.unpin(entries)


def test_corrupt_payload_is_a_miss_and_dropped(store):
    src, ks = Pages(3, seed=6), keys(3)
    store.write_pages(ks, src.addrs, True)
    path, off = store.locate(ks[1])
    with open(path, "r+b") as f:
        f.seek(off + 4096 + 100)
        b = f.read(1)
        f.seek(off + 4096 + 100)
        f.write(bytes([b[0] ^ 0x40]))
    dst = Pages(3, seed=None)
    ok = store.read_pages(ks, dst.addrs, True)
    assert ok.tolist() == [True, False, True]
    assert store.stats()["checksum_failures"] == 1 and ks[1] not in store


def flip_layer_byte(s, key: str, layer: int, at: int, mask: int) -> None:
    """XOR one byte of a page's first object of `layer` on disk (a silent corruption)."""
    path, off = s.locate(key)
    pos = off + int(s.layout.object_offsets[GEOM.layer_objects(layer)[0]]) + at
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def layer_destination(s, n: int):
    """(object stride, layers, an aligned buffer of every layer's n pages (K and V), its view
    [layer, page, object, stride])."""
    stride, layers = s.layer_object_stride(), GEOM.num_layers
    dst = E.AlignedBuffer(layers * n * 2 * stride)
    return stride, layers, dst, np.frombuffer(dst, np.uint8).reshape(layers, n, 2, stride)


def test_stream_layers_verdicts_per_chunk_with_uneven_chunks(store_dirs):
    """Every layer in two chunks of 5 and 7 pages (requests built for all chunks at once), a
    corrupt page 8 in layer 1: wait_whole gives each chunk's verdict, whole and all pages ok
    (the bytes-compared path) everywhere but layer 1's second chunk, where only page 8 is bad and
    is dropped from the index; every other page lands byte-exact, and a waited chunk is final."""
    s = ObjectStore(cfg_for(store_dirs, tutti_verify=True), GEOM, IDENT)
    n, m = 12, len(GEOM.object_nbytes)
    src, ks = Pages(n, seed=23), keys(n, "u")
    assert s.write_pages(ks, src.addrs, True).all()
    flip_layer_byte(s, ks[8], 1, 17, 0x01)
    entries = s.pin(ks)
    try:
        stride, layers, dst, got = layer_destination(s, n)
        chunks = [(layer, rows) for layer in range(layers) for rows in (slice(0, 5), slice(5, n))]
        dsts = [dst.address + np.uint64(layer * n * 2 * stride)
                + np.arange(rows.start, rows.stop, dtype=np.uint64) * np.uint64(2 * stride)
                for layer, rows in chunks]
        verdicts = []
        with s.stream_layers(s.plan_pages(entries), chunks, dsts) as stream:
            stream.allow(len(chunks))
            for i in range(len(chunks)):
                ok, whole = stream.wait_whole(i)
                assert stream._stream.final(i)
                verdicts.append((ok.copy(), whole))
        want = src.a[:n * m * src.obj].reshape(n, m, src.obj)
        for (layer, rows), (ok, whole) in zip(chunks, verdicts):
            bad = layer == 1 and rows.start == 5
            assert whole == (not bad) and len(ok) == rows.stop - rows.start
            assert ok.tolist() == [p != 8 for p in range(rows.start, rows.stop)] if bad else ok.all()
            k, v = GEOM.layer_objects(layer)
            pages = np.arange(rows.start, rows.stop)[ok]
            assert (got[layer, pages, 0] == want[pages, k]).all()
            assert (got[layer, pages, 1] == want[pages, v]).all()
        assert ks[8] not in s and all(k in s for i, k in enumerate(ks) if i != 8)
    finally:
        s.unpin(entries)
        s.close()


def test_corrupt_header_is_not_served_after_restart(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    src, ks = Pages(3, seed=7), keys(3)
    s.write_pages(ks, src.addrs, True)
    path, off = s.locate(ks[0])
    s.close()
    with open(path, "r+b") as f:
        f.seek(off + 90)  # inside the key
        f.write(b"Z")
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    assert ks[0] not in s and s.prefix_len(ks[1:]) == 2
    assert s.stats()["pages"] == 2
    s.close()


def test_other_identity_sees_nothing(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    src = Pages(2, seed=8)
    s.write_pages(keys(2), src.addrs, True)
    s.close()
    for ident in ({"model": "unit", "tp": [1, 2]}, {"model": "other", "tp": [0, 1]},
                  {"model": "unit", "tp": [0, 1], "revision": "v2"}):
        o = ObjectStore(cfg_for(store_dirs), GEOM, ident)
        assert len(o) == 0
        o.close()
    o = ObjectStore(cfg_for(store_dirs), PageGeometry("mha", 4, 16, 256, 256, "page_first"), IDENT)
    assert len(o) == 0
    o.close()


def test_changed_directory_set_heals(tmp_path):
    """A directory dropped from the list: attach succeeds, the rest is re-homed (test_heal.py)."""
    a, b = tmp_path / "a", tmp_path / "b"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    src = Pages(4, seed=3)
    s.write_pages(keys(4), src.addrs, True)
    s.close()
    s = ObjectStore(cfg_for([a]), GEOM, IDENT)
    assert s.rehome_wait(60)
    assert sorted(s.entries()) == sorted(keys(4)[::2])  # slots 0 and 2 lived in a
    s.close()


def test_striping_over_two_dirs(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    src = Pages(10, seed=9)
    s.write_pages(keys(10), src.addrs, True)
    slots = sorted(e.slot for e in s.entries().values())
    assert slots == list(range(10))
    for d in dirs:
        assert any(f.endswith(".dat") for _, _, fs in os.walk(d) for f in fs)
    s.close()


def test_files_are_private(store):
    src = Pages(1, seed=10)
    store.write_pages(keys(1), src.addrs, True)
    for d in store.ns_dirs:
        for root, dirs, files in os.walk(d):
            assert os.stat(root).st_mode & 0o777 == 0o700, root
            for f in files:
                assert os.stat(os.path.join(root, f)).st_mode & 0o777 == 0o600, f


def _writer(dirs, n, q):
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    src = Pages(n, seed=11)
    q.put(bool(s.write_pages(keys(n, "w"), src.addrs, True).all()))
    q.get()  # hold the rows until the parent has read
    s.close()


def test_second_process_reads_what_the_first_published(tmp_path):
    """One writer process, one reader (writer=False, like an MLA non-writer rank)."""
    dirs = [tmp_path / "s"]
    reader = ObjectStore(cfg_for(dirs), GEOM, IDENT, writer=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(dirs, 12, q))
    p.start()
    try:
        assert q.get(timeout=60)
        assert reader.prefix_len(keys(12, "w")) == 0  # not seen yet: asks for a re-scan
        reader.rescan()
        assert reader.prefix_len(keys(12, "w")) == 12
        dst = Pages(12, seed=None)
        assert reader.read_pages(keys(12, "w"), dst.addrs, True).all()
        src = Pages(12, seed=11)
        assert all((dst.page(i) == src.page(i)).all() for i in range(12))
    finally:
        q.put("done")
        p.join(30)
        reader.close()


def test_two_writers_share_without_clobbering(tmp_path):
    """Two writer processes of one identity (DP replicas) own disjoint rows (flock)."""
    dirs = [tmp_path / "s"]
    a = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(dirs, 20, q))
    p.start()
    try:
        assert q.get(timeout=60)
        src = Pages(20, seed=12)
        assert a.write_pages(keys(20, "a"), src.addrs, True).all()
        a.rescan()
        assert a.prefix_len(keys(20, "w")) == 20 and a.prefix_len(keys(20, "a")) == 20
        dst = Pages(20, seed=None)
        assert a.read_pages(keys(20, "w"), dst.addrs, True).all()
        other = Pages(20, seed=11)
        assert all((dst.page(i) == other.page(i)).all() for i in range(20))
        mine = {e.slot for k, e in a.entries().items() if k.startswith("a")}
        theirs = {e.slot for k, e in a.entries().items() if k.startswith("w")}
        assert not mine & theirs
    finally:
        q.put("done")
        p.join(30)
        a.close()


def test_writers_share_rows_fairly(tmp_path):
    """A second writer on a namespace the first has fully claimed gets its share back."""
    dirs = [tmp_path / "s"]
    a = ObjectStore(cfg_for(dirs), GEOM, IDENT)  # 64 slots: rows of 28 -> 3 rows
    src = Pages(16, seed=13)
    for r in range(5):  # fill: a claims every row
        assert a.write_pages(keys(16, f"a{r}"), src.addrs, True).all()
    assert len(a.owned_rows()) == a.n_rows
    b = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    a.rebalance()  # what a's re-scan thread does (with a fresh count of the writers)
    assert len(a.owned_rows()) == -(-a.n_rows // 2)
    assert b.write_pages(keys(4, "b"), src.addrs[:4], True).all()
    assert b.owned_rows() and not b.owned_rows() & a.owned_rows()
    for k in keys(16, "a4"):  # a's pages in released rows stay readable, now foreign to a
        assert k in a
    b.close()
    a.close()


def test_last_row_with_an_empty_directory_still_grows(tmp_path):
    """57 slots over 2 dirs with 28-slot segments: row 1 holds 1 slot in dir 0 and none in dir 1."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    s = ObjectStore(cfg_for(dirs, tutti_capacity_gb=57 * 36864 / 2**30), GEOM, IDENT)
    assert s.capacity_slots == 57 and s.n_rows == 2
    src = Pages(19, seed=14)
    for r in range(4):
        assert s.write_pages(keys(19, f"g{r}"), src.addrs, True).all()
    assert len(s) == 57 and s.stats()["write_failures"] == 0
    assert not (tmp_path / "b" / s.ns_dirs[1].split("/")[-1] / "seg-000001.dat").exists()
    s.close()


def test_a_closed_store_is_freed_without_the_cycle_collector(store_dirs):
    """No part of the store refers back to it: a closed store goes with its last reference.
    (A store left to the cycle collector may be collected in a forked child, where freeing the
    parent's engine blocks forever.)"""
    import gc
    import weakref
    gc.disable()
    try:
        s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
        src = Pages(2, seed=15)
        assert s.write_pages(keys(2), src.addrs, True).all()
        s.close()
        ref = weakref.ref(s)
        del s
        assert ref() is None
    finally:
        gc.enable()


def test_a_write_in_chunks_stays_invisible_until_one_header_batch_publishes_it(store_dirs):
    """begin_pages + land_pages per chunk write tombstones and payloads only: neither this store
    nor a second one opened on the same directories sees the pages; publish_pages writes all
    their headers in one batch, after which they read back byte-exact, also after a restart."""
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    src, ks = Pages(24, seed=11), keys(24, "l")
    calls = []
    orig = s._io.write_headers
    s._io.write_headers = lambda keys_, *a: calls.append(len(keys_)) or orig(keys_, *a)
    w = s.begin_pages(ks)
    for c0 in (16, 0, 8):  # chunks in any order
        s.land_pages(w, c0, c0 + 8, src.addrs[c0:c0 + 8], True)
    assert not calls and s.prefix_len(ks) == 0 and not any(s.present(ks))
    other = ObjectStore(cfg_for(store_dirs), GEOM, IDENT, writer=False)
    assert other.prefix_len(ks) == 0
    other.close()
    [ok] = s.publish_pages([w])
    assert ok.all() and len(ok) == 24
    assert calls == [24] and s.prefix_len(ks) == 24 and s.stats()["write_pages"] == 24
    s.close()
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    dst = Pages(24, seed=None)
    assert s.read_pages(ks, dst.addrs, True).all()
    assert all((dst.page(i) == src.page(i)).all() for i in range(24))
    s.close()


def test_a_chunk_that_failed_or_never_landed_is_given_back_at_publish(store):
    """Of one begun write of 8 keys (2 already present): a chunk whose payload writes failed and
    a chunk never landed are not published (their slots go back and are reused); the chunk that
    landed is stored; present keys are ok."""
    src, ks = Pages(8, seed=12), keys(8, "f")
    assert store.write_pages(ks[:2], src.addrs[:2], True).all()
    w = store.begin_pages(ks)
    orig = store._io.write_payloads
    store._io.write_payloads = lambda f, o, a, al: np.zeros(len(f), dtype=bool)
    store.land_pages(w, 0, 4, src.addrs[:4], True)  # keys 2, 3 fail (0, 1 are present)
    store._io.write_payloads = orig
    store.land_pages(w, 4, 6, src.addrs[4:6], True)  # 6, 7 never land
    [ok] = store.publish_pages([w])
    assert ok.tolist() == [True, True, False, False, True, True, False, False]
    assert [store.present([k])[0] for k in ks] == ok.tolist()
    st = store.stats()
    assert st["write_failures"] == 4 and st["write_pages"] == 2 + 2 and st["dedup_skips"] == 2
    assert store.write_pages(ks, src.addrs, True).all()  # the slots came back
    dst = Pages(8, seed=None)
    assert store.read_pages(ks, dst.addrs, True).all()
    assert all((dst.page(i) == src.page(i)).all() for i in range(8))


def test_a_read_only_store_lands_nothing(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT, writer=False)
    src = Pages(2, seed=13)
    w = s.begin_pages(keys(2))
    s.land_pages(w, 0, 2, src.addrs, True)
    assert w is None and s.publish_pages([w]) == [None] and s.prefix_len(keys(2)) == 0
    s.close()


def test_a_segment_another_writer_created_first_is_opened_not_refused(store_dirs, monkeypatch):
    """Two writers grow an empty store at once: between this one's check that a row's file is
    missing and its exclusive create, the other made it. That is the row's file, opened as it
    is (the grower used to fail and refuse every write for 10 s)."""
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    try:
        row = s._ns.n_rows - 1
        assert not s._files.open_row(row, create=False)  # not made yet
        real = s._ns.create_segment

        def the_other_writer_first(path, n_slots):
            real(path, n_slots)  # the other writer's create
            real(path, n_slots)  # this one's: O_EXCL, FileExistsError
        monkeypatch.setattr(s._ns, "create_segment", the_other_writer_first)
        assert s._files.open_row(row, create=True)
    finally:
        s.close()


def test_a_writer_registering_while_another_counts_stays_counted(tmp_path, monkeypatch):
    """Another writer's count takes the lock of every registry file it finds and removes those it
    gets. Between a new writer's create and its flock, it got the new file and unlinked it: the new
    writer then held a lock on a file nobody could see, and the others' fair share of rows never
    counted it (seen under a stress of concurrent attaches; also the flock itself could fail)."""
    from tutti_hicache.store import rows as rows_mod
    dirs = [tmp_path / "s"]
    a = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    real_flock, raced = rows_mod.fcntl.flock, []

    def count_first(fd, op):  # a's count runs between b's create and b's flock
        mine = f"/writers/{os.getpid()}." in os.readlink(f"/proc/self/fd/{fd}")
        if mine and op & rows_mod.fcntl.LOCK_NB and not raced:
            raced.append(None)
            raced[0] = a._rows._live_writers()
        return real_flock(fd, op)
    monkeypatch.setattr(rows_mod.fcntl, "flock", count_first)
    b = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    monkeypatch.setattr(rows_mod.fcntl, "flock", real_flock)
    try:
        assert raced and b._rows._registry[0] is not None
        assert a._rows._live_writers() == 2 and b._rows._live_writers() == 2
    finally:
        b.close()
        a.close()
