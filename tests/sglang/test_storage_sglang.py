"""TuttiStorage against the real SGLang classes on CPU (the installed version: 0.5.23 or 0.5.17).

Real MHA/MLA host pools in every layout, driven through SGLang's own controller methods
(_page_backup, _storage_hit_query, _page_transfer) with 200 pages (two 128-page batches),
zero-copy (batch_*_v1) and generic (batch_get/batch_set) paths, restart in between, byte-exact.
"""

import multiprocessing as mp
import threading

import pytest

torch = pytest.importorskip("torch")

from tutti_hicache.testing import controller as HC  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 16
N = 200
CASES = [("mha", l) for l in ("layer_first", "page_first", "page_first_direct", "page_head")]
CASES += [("mla", l) for l in ("layer_first", "page_first", "page_first_direct")]


def make_pool(h, kind, layout, n_pages=2 * N + 8):
    # MHA: 2 layers x 2 heads x 64 dims bf16 = 4 KiB objects (zero copy); MLA: 48 dims (bounce)
    if kind == "mha":
        return h.make_mha_host_pool(layout, 2, 2, 64, PAGE, torch.bfloat16, n_pages)
    return h.make_mla_host_pool(layout, 2, 32, 16, PAGE, torch.bfloat16, n_pages)


def tutti(h, dirs, kind, layout, tp_rank=0, tp_size=1, **extra):
    from tutti_hicache.storage import TuttiStorage
    cfg = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": 0.25, "tutti_segment_gb": 1 / 64,
           "tutti_rescan_interval_s": 0.0, **extra}
    sc = h.make_storage_config(tp_rank=tp_rank, tp_size=tp_size, is_mla=kind == "mla",
                               is_page_first_layout=layout == "page_first", extra_config=cfg)
    return TuttiStorage(sc, {}), sc


def controller(h, backend, pool, sc, zero_copy=True):
    return HC.make_controller(backend, pool, PAGE, sc, zero_copy=zero_copy)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "generic"])
@pytest.mark.parametrize("kind,layout", CASES)
def test_roundtrip_through_the_controller(sglang, store_dirs, kind, layout, zero_copy):
    h = sglang
    pool = make_pool(h, kind, layout)
    src, dst = pool.alloc(N * PAGE), pool.alloc(N * PAGE)
    h.fill_random(pool, src, seed=1)
    want = h.page_bytes(pool, src)
    keys = h.make_page_keys(N, seed=2)
    st, sc = tutti(h, store_dirs, kind, layout)
    assert HC.controller_backup(controller(h, st, pool, sc, zero_copy), keys, src) == N
    st.close()
    st, sc = tutti(h, store_dirs, kind, layout)  # a restart: the index comes from disk
    ctrl = controller(h, st, pool, sc, zero_copy)
    assert HC.controller_hit_query(ctrl, keys) == N
    assert HC.controller_transfer(ctrl, keys, dst) == N * PAGE
    assert h.page_bytes(pool, dst) == want
    stats = st.tutti_stats()
    assert stats["hits"] == N and stats["checksum_failures"] == 0
    st.close()


def test_missing_page_stops_the_prefix(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, "mha", "layer_first")
    src, dst = pool.alloc(N * PAGE), pool.alloc(N * PAGE)
    h.fill_random(pool, src, seed=3)
    keys = h.make_page_keys(N, seed=4)
    st, sc = tutti(h, [tmp_path], "mha", "layer_first")
    ctrl = controller(h, st, pool, sc)
    assert HC.controller_backup(ctrl, keys, src) == N
    st.store.forget([keys[150]])
    assert HC.controller_hit_query(ctrl, keys) == 150
    done = HC.controller_transfer(ctrl, keys, dst)
    assert done == 150 * PAGE  # the second batch counts up to its first miss
    assert h.page_bytes(pool, dst[: 150 * PAGE]) == h.page_bytes(pool, src[: 150 * PAGE])
    st.close()


def test_a_get_reads_only_the_leading_run_sglang_uses(sglang, tmp_path):
    """SGLang takes batch_get_v1's answer up to its first False and drops the rest: with the
    batch's first page gone between the hit query and the get, nothing is read and the prefetch
    metrics count nothing (7 pages were read and counted, unused); with a later page gone, only
    the pages before it."""
    h = sglang
    pool = make_pool(h, "mha", "layer_first")
    src, dst = pool.alloc(8 * PAGE), pool.alloc(8 * PAGE)
    h.fill_random(pool, src, seed=1)
    keys = h.make_page_keys(8, seed=2)
    st, sc = tutti(h, [tmp_path], "mha", "layer_first")
    ctrl = controller(h, st, pool, sc)
    assert HC.controller_backup(ctrl, keys, src) == 8
    st.get_stats()
    page_bytes = st.hostmap.geometry.page_nbytes
    st.store.forget([keys[0]])
    r0 = st.tutti_stats()["read_bytes"]
    assert HC.controller_transfer(ctrl, keys, dst) == 0
    assert st.tutti_stats()["read_bytes"] == r0 and st.get_stats().prefetch_pgs == []
    st.store.forget([keys[5]])
    assert st.batch_get_v1(keys[1:], dst[PAGE:]) == [True] * 4 + [False] * 3
    assert st.tutti_stats()["read_bytes"] == r0 + 4 * page_bytes and st.get_stats().prefetch_pgs == [4]
    assert h.page_bytes(pool, dst[PAGE:5 * PAGE]) == h.page_bytes(pool, src[PAGE:5 * PAGE])
    st.close()


def test_a_failed_second_attach_leaves_no_closed_store_behind(sglang, tmp_path):
    """register_mem_pool_host again (another pool) closes the first store; when the new attach
    then fails (here its page does not fit tutti_capacity_gb), the backend holds no store, so
    every call is a clean miss. It used to keep the closed store: batch_exists counted its pages
    and no get could read one."""
    h = sglang
    st, sc = tutti(h, [tmp_path], "mha", "layer_first", tutti_capacity_gb=0.002)
    a = h.make_mha_host_pool("layer_first", 2, 2, 64, PAGE, torch.bfloat16, 20)
    st.register_mem_pool_host(a)
    idx = a.alloc(8 * PAGE)
    h.fill_random(a, idx, seed=1)
    keys = h.make_page_keys(8, seed=2)
    assert st.batch_set_v1(keys, idx) == [True] * 8
    b = h.make_mha_host_pool("layer_first", 64, 8, 128, PAGE, torch.bfloat16, 4)  # 4 MiB pages
    with pytest.raises(ValueError, match="tutti_capacity_gb"):
        st.register_mem_pool_host(b)
    assert st.store is None
    assert st.batch_exists(keys) == 0 and st.batch_get_v1(keys, a.alloc(8 * PAGE)) == [False] * 8
    st.register_mem_pool_host(a)  # an attach that works finds the pages again
    assert st.batch_exists(keys) == 8
    st.close()


def test_dynamic_factory_path(sglang, tmp_path):
    h = sglang
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tutti_hicache.storage import TuttiStorage
    pool = make_pool(h, "mha", "page_first_direct")
    extra = {"backend_name": "tutti", "module_path": "tutti_hicache.storage",
             "class_name": "TuttiStorage", "interface_v1": 1, "tutti_dirs": [str(tmp_path)],
             "tutti_capacity_gb": 0.1}
    sc = h.make_storage_config(extra_config=extra)
    be = StorageBackendFactory.create_backend("dynamic", sc, pool)
    assert isinstance(be, TuttiStorage)
    be.register_mem_pool_host(pool)
    assert be.batch_exists(["00" * 32]) == 0
    be.close()


def test_bad_config_is_a_value_error_naming_the_key(sglang, tmp_path):
    h = sglang
    from tutti_hicache.storage import TuttiStorage
    for extra, key in (({"tutti_dirs": [str(tmp_path)], "tutti_capcity_gb": 1}, "tutti_capcity_gb"),
                       ({}, "tutti_dirs"),
                       ({"tutti_dirs": [str(tmp_path)], "tutti_threads": "x"}, "tutti_threads")):
        with pytest.raises(ValueError, match=key):
            TuttiStorage(h.make_storage_config(extra_config=extra), {})
    st, _ = tutti(h, [tmp_path], "mha", "layer_first", tutti_capacity_gb=1e-6)
    with pytest.raises(ValueError, match="tutti_capacity_gb"):
        st.register_mem_pool_host(make_pool(h, "mha", "layer_first", 4))


def test_wrong_host_indices_are_a_clean_miss(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 8)
    st, _ = tutti(h, [tmp_path], "mha", "layer_first")
    st.register_mem_pool_host(pool)
    idx = pool.alloc(2 * PAGE)
    keys = h.make_page_keys(2)
    assert st.batch_set_v1(keys, idx[:-1]) == [False, False]  # wrong length
    assert st.batch_set_v1(keys, idx + 1) == [False, False]  # not page-aligned
    assert st.batch_set_v1(keys, idx + 10**9) == [False, False]  # outside the pool
    assert st.batch_set_v1(keys, idx) == [True, True]
    assert st.batch_get_v1([keys[0], "not-a-key"], idx) == [True, False]
    st.close()


def test_concurrent_reads_and_writes(sglang, tmp_path):
    """SGLang's io-aux (reads) and backup (writes) threads call the backend at the same time."""
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 3 * 64 + 4)
    st, _ = tutti(h, [tmp_path], "mha", "layer_first")
    st.register_mem_pool_host(pool)
    a, b, c = (pool.alloc(64 * PAGE) for _ in range(3))
    h.fill_random(pool, a, seed=5)
    h.fill_random(pool, c, seed=6)
    ka, kc = h.make_page_keys(64, 7), h.make_page_keys(64, 8)
    assert all(st.batch_set_v1(ka, a))
    errors = []

    def reader():
        for _ in range(10):
            if not all(st.batch_get_v1(ka, b)):
                errors.append("read")

    def writer():
        for i in range(10):
            if not all(st.batch_set_v1([k + f"{i}" for k in kc], c)):
                errors.append("write")

    ts = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and h.page_bytes(pool, b) == h.page_bytes(pool, a)
    st.close()


def test_get_stats_is_sglangs_storage_metrics(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 8)
    st, _ = tutti(h, [tmp_path], "mha", "layer_first")
    st.register_mem_pool_host(pool)
    idx = pool.alloc(4 * PAGE)
    st.batch_set_v1(h.make_page_keys(4), idx)
    st.batch_get_v1(h.make_page_keys(4), idx)
    m = st.get_stats()
    assert type(m).__name__ == "StorageMetrics"
    assert m.backup_pgs == [4] and m.prefetch_pgs == [4] and len(m.prefetch_bandwidth) == 1
    assert st.get_stats().prefetch_pgs == []  # drained
    st.clear()
    assert st.batch_exists(h.make_page_keys(4)) == 0
    st.close()


def test_unsupported_pool_is_refused_loudly(sglang, tmp_path):
    from tutti_hicache.hostmap import HostMap, UnsupportedPool

    class Odd:
        layout = "page_unified"
        kv_cache_dim = 8

    with pytest.raises(UnsupportedPool, match="page_unified"):
        HostMap.from_pool(Odd())


def test_failure_injector_never_escapes(sglang, tmp_path, monkeypatch):
    """SGLang's own failure injector wraps the backend: no exception, hits only byte-exact."""
    h = sglang
    import sglang.srt.mem_cache.hicache_storage as hs
    if not hasattr(hs, "HiCacheStorageFailureInjector"):
        pytest.skip("this SGLang version has no failure injector (added after 0.5.17)")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    pool = make_pool(h, "mha", "layer_first")
    src, dst = pool.alloc(N * PAGE), pool.alloc(N * PAGE)
    h.fill_random(pool, src, seed=9)
    want = h.page_bytes(pool, src)
    extra = {"backend_name": "tutti", "module_path": "tutti_hicache.storage",
             "class_name": "TuttiStorage", "interface_v1": 1, "tutti_dirs": [str(tmp_path)],
             "tutti_capacity_gb": 0.25}
    sc = h.make_storage_config(extra_config=extra)
    be = StorageBackendFactory.create_backend("dynamic", sc, pool)
    assert type(be).__name__ == "HiCacheStorageFailureInjector"
    ctrl = controller(h, be, pool, sc)
    keys = h.make_page_keys(N, 10)
    for _ in range(5):
        HC.controller_backup(ctrl, keys, src)
    for _ in range(5):
        pool.kv_buffer.view(-1)[:0]
        done = HC.controller_transfer(ctrl, keys, dst) // PAGE
        assert h.page_bytes(pool, dst[: done * PAGE]) == want[:done]
    be.close()


def _mp_worker(kind, tp_rank, dirs, seed, q):
    try:
        from tutti_hicache.testing import sglang as h
        h.ensure_sglang()
        from tutti_hicache.storage import is_storage_writer
        layout = "layer_first"
        pool = make_pool(h, kind, layout, 40)
        st, sc = tutti(h, dirs, kind, layout, tp_rank=tp_rank, tp_size=2)
        st.register_mem_pool_host(pool)
        idx = pool.alloc(32 * PAGE)
        h.fill_random(pool, idx, seed)
        ok = st.batch_set_v1(h.make_page_keys(32, 99), idx) if is_storage_writer(sc) else []
        q.put((all(ok), h.page_bytes(pool, idx)))
    except BaseException as e:  # report instead of leaving the parent waiting
        q.put((False, repr(e)))
        raise
    q.get()
    st.close()


def _spawn(kind, tp_rank, dirs, seed):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_mp_worker, args=(kind, tp_rank, [str(d) for d in dirs], seed, q))
    p.start()
    return p, q


@pytest.mark.slow  # spawned processes re-import SGLang (about 10 s)
def test_mla_writer_rank_and_reader_rank_share_pages(sglang, tmp_path):
    """MLA is rank-replicated: tp0 writes, tp1 (another process) finds and reads the same pages."""
    h = sglang
    p, q = _spawn("mla", 0, [tmp_path], seed=11)
    try:
        ok, want = q.get(timeout=120)
        assert ok, want
        pool = make_pool(h, "mla", "layer_first", 40)
        st, sc = tutti(h, [tmp_path], "mla", "layer_first", tp_rank=1, tp_size=2)
        from tutti_hicache.storage import is_storage_writer
        assert not is_storage_writer(sc)
        st.register_mem_pool_host(pool)
        keys = h.make_page_keys(32, 99)
        assert st.batch_exists(keys) == 32  # found at attach (index rebuilt from headers)
        dst = pool.alloc(32 * PAGE)
        assert all(st.batch_get_v1(keys, dst))
        assert h.page_bytes(pool, dst) == want
        assert st.batch_set_v1(h.make_page_keys(2, 5), dst[:2 * PAGE]) == [False, False]
        st.close()
    finally:
        q.put("done")
        p.join(60)


@pytest.mark.slow  # spawned processes re-import SGLang (about 10 s)
def test_mha_tp_ranks_share_directories_without_cross_talk(sglang, tmp_path):
    """Two MHA tp ranks (two processes) store the same keys with different head shards."""
    h = sglang
    p, q = _spawn("mha", 1, [tmp_path], seed=12)
    try:
        ok1, want1 = q.get(timeout=120)
        assert ok1, want1
        pool = make_pool(h, "mha", "layer_first", 80)
        st, _ = tutti(h, [tmp_path], "mha", "layer_first", tp_rank=0, tp_size=2)
        st.register_mem_pool_host(pool)
        keys = h.make_page_keys(32, 99)
        assert st.batch_exists(keys) == 0  # rank 1's pages are not rank 0's
        src, dst = pool.alloc(32 * PAGE), pool.alloc(32 * PAGE)
        h.fill_random(pool, src, seed=13)
        assert all(st.batch_set_v1(keys, src))
        assert all(st.batch_get_v1(keys, dst))
        got = h.page_bytes(pool, dst)
        assert got == h.page_bytes(pool, src) and got != want1
        st.close()
    finally:
        q.put("done")
        p.join(60)


def test_stats_file_is_written(sglang, tmp_path):
    import json
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 8)
    st, _ = tutti(h, [tmp_path / "s"], "mha", "layer_first",
                  tutti_stats_file=str(tmp_path / "stats-{pid}.json"))
    st.register_mem_pool_host(pool)
    idx = pool.alloc(2 * PAGE)
    st.batch_set_v1(h.make_page_keys(2), idx)
    st.batch_get_v1(h.make_page_keys(2), idx)
    st.close()
    (path,) = tmp_path.glob("stats-*.json")
    stats = json.loads(path.read_text())
    assert stats["hits"] == 2 and stats["write_pages"] == 2 and stats["checksum_failures"] == 0


def test_timeline_file_traces_the_host_tiers_calls(sglang, store_dirs, tmp_path):
    """tutti_timeline_file on the host tier: one line per exists/get/set call SGLang's own
    controller makes, which timeline.host_summary groups into a restore of every page read,
    SGLang's hit query before it, and the backup's pages; a read of pages never stored is a
    get that found nothing."""
    from tutti_hicache.benchmarks import timeline
    h = sglang
    pool = make_pool(h, "mha", "layer_first")
    src, dst = pool.alloc(N * PAGE), pool.alloc(N * PAGE)
    h.fill_random(pool, src, seed=1)
    keys = h.make_page_keys(N, seed=2)
    template = str(tmp_path / "timeline-host-{pid}.jsonl")
    st, sc = tutti(h, store_dirs, "mha", "layer_first", tutti_timeline_file=template)
    ctrl = controller(h, st, pool, sc)
    assert HC.controller_backup(ctrl, keys, src) == N
    assert HC.controller_hit_query(ctrl, keys) == N
    assert HC.controller_transfer(ctrl, keys, dst) == N * PAGE
    assert st.batch_get_v1(h.make_page_keys(2, seed=9), dst[:2 * PAGE]) == [False, False]
    st.close()
    assert h.page_bytes(pool, dst) == h.page_bytes(pool, src)
    files = sorted(str(p) for p in tmp_path.glob("timeline-host-*.jsonl"))
    calls = timeline.host_calls(files)
    assert {c["host_op"] for c in calls} == {"exists", "get", "set"}
    assert all(c["t1_ns"] >= c["t0_ns"] for c in calls)
    page_bytes = st.hostmap.geometry.page_nbytes
    out = timeline.host_summary(files, page_bytes)
    assert out["sets"]["pages"] == N and out["exists"]["calls"] >= 1
    pages = [r["pages"] for r in out["restores"]]
    assert sum(pages) == N and pages[0] > 0  # the miss adds a get of 0 pages, not pages
    first = out["restores"][0]
    assert first["exists_to_get_ms"] is not None and first["exists_to_get_ms"] >= 0
    assert first["GBps"] > 0
    assert timeline.host_summary([str(tmp_path / "none.jsonl")], page_bytes) == {}


# ------------------------------------------------------------------ two writers on one store
# `--dp-size 2`, or two servers on one node with the same tutti_dirs: both are writers of one
# identity. 4 rows of 16 slots (2 layers x K, V x 4 KiB objects + the header).
SLOT = 4096 + 4 * 4096
TWO = {"tutti_segment_gb": 16 * SLOT / 2**30, "tutti_capacity_gb": 64 * SLOT / 2**30}


def _own_slots_accounted(st) -> bool:
    """Every slot of the rows this process owns holds an own entry, is free or reserved."""
    ix = st.store._index
    own = {int(s) for r in st.store.owned_rows() for s in st.store._ns.row_slots(r)}
    placed = {e.slot for e in ix.entries.values() if e.owned} | {s for s, _ in ix.free} \
        | set(ix.reserved.values()) | ix.zombies
    return own <= placed


def test_rows_handed_to_another_writer_are_read_verified_with_verify_off(sglang, tmp_path):
    """A (tutti_verify=false) backs up 64 pages, B arrives and A hands it half its rows; B's
    writes then evict A's pages there. A's lookups may still name those keys, but what it reads
    back under them is its own bytes or a miss: never B's bytes (the handed-over pages used to
    stay 'fresh', read without a checksum: 32 of 64 pages came back as B's)."""
    h = sglang
    a, sca = tutti(h, [tmp_path], "mha", "layer_first", tutti_verify=False, **TWO)
    pa = make_pool(h, "mha", "layer_first", n_pages=200)
    a.register_mem_pool_host(pa)
    src = pa.alloc(64 * PAGE)
    h.fill_random(pa, src, seed=1)
    want = h.page_bytes(pa, src)
    keys = h.make_page_keys(64, seed=10)
    ca = HC.make_controller(a, pa, PAGE, sca, zero_copy=True, register=False)
    assert HC.controller_backup(ca, keys, src) == 64
    b, scb = tutti(h, [tmp_path], "mha", "layer_first", **TWO)
    pb = make_pool(h, "mha", "layer_first", n_pages=200)
    b.register_mem_pool_host(pb)
    a.store.rebalance()  # what A's re-scan thread does within a second
    assert len(a.store.owned_rows()) < a.store.n_rows
    bsrc = pb.alloc(64 * PAGE)
    h.fill_random(pb, bsrc, seed=2)
    cb = HC.make_controller(b, pb, PAGE, scb, zero_copy=True, register=False)
    HC.controller_backup(cb, h.make_page_keys(64, seed=20), bsrc)
    assert b.store.stats()["evictions"] > 0
    dst = pa.alloc(64 * PAGE)
    done = HC.controller_transfer(ca, keys, dst) // PAGE
    got = h.page_bytes(pa, dst)
    assert 0 < done < 64 and got[:done] == want[:done]
    b.close()
    a.close()


def test_two_writers_storing_the_same_pages_lose_no_slots(sglang, tmp_path):
    """Both back up the same prefix before either re-scanned the other; A's re-scan learns B's
    newer copies: A's own slots of those pages go back to its free list, so A still keeps as
    many pages as it owns slots (they used to be lost until a restart)."""
    h = sglang
    a, sca = tutti(h, [tmp_path], "mha", "layer_first", **TWO)
    b, scb = tutti(h, [tmp_path], "mha", "layer_first", **TWO)
    pa, pb = make_pool(h, "mha", "layer_first", 100), make_pool(h, "mha", "layer_first", 100)
    a.register_mem_pool_host(pa)
    b.register_mem_pool_host(pb)
    ca = HC.make_controller(a, pa, PAGE, sca, zero_copy=True, register=False)
    cb = HC.make_controller(b, pb, PAGE, scb, zero_copy=True, register=False)
    shared = h.make_page_keys(24, seed=5)
    ia, ib = pa.alloc(24 * PAGE), pb.alloc(24 * PAGE)
    h.fill_random(pa, ia, 1)
    h.fill_random(pb, ib, 1)
    assert HC.controller_backup(ca, shared, ia) == 24 and HC.controller_backup(cb, shared, ib) == 24
    a.store.rescan()
    assert _own_slots_accounted(a)
    owned = sum(len(a.store._ns.row_slots(r)) for r in a.store.owned_rows())
    more = h.make_page_keys(owned, seed=6)
    im = pa.alloc(owned * PAGE)
    h.fill_random(pa, im, 2)
    assert all(a.batch_set_v1(more, im))
    assert sum(k in a.store for k in more) == owned and a.store.stats()["evictions"] == 0
    a.close()
    b.close()


def test_a_write_racing_the_rescan_of_the_same_page_keeps_the_index_whole(sglang, tmp_path):
    """A writes page K while its re-scan learns B's copy of K; A's publish then indexes its own.
    B clearing its copy and reusing the slot must leave A's K (and every later re-scan) intact."""
    h = sglang
    a, _ = tutti(h, [tmp_path], "mha", "layer_first")
    b, _ = tutti(h, [tmp_path], "mha", "layer_first")
    pa, pb = make_pool(h, "mha", "layer_first", 40), make_pool(h, "mha", "layer_first", 40)
    a.register_mem_pool_host(pa)
    b.register_mem_pool_host(pb)
    k = h.make_page_keys(1, seed=7)
    ia, ib = pa.alloc(PAGE), pb.alloc(PAGE)
    h.fill_random(pa, ia, 1)
    h.fill_random(pb, ib, 1)
    w = a.store.begin_pages(k)  # A's batch_set_v1 in its three steps, B's write and A's re-scan between
    a.store.land_pages(w, 0, 1, a.hostmap.page_addresses(ia, 1), a.hostmap.aligned)
    assert b.batch_set_v1(k, ib) == [True]
    a.store.rescan()
    assert a.store.publish_pages([w])[0].tolist() == [True]
    b.clear()
    a.store.rescan()
    assert a.batch_exists(k) == 1
    for seed in (8, 9, 10):  # B reuses its slot; A's re-scans of that row go on without error
        assert b.batch_set_v1(h.make_page_keys(1, seed=seed), ib) == [True]
        a.store.rescan()
        assert h.make_page_keys(1, seed=seed)[0] in a.store
    assert _own_slots_accounted(a)
    a.close()
    b.close()
