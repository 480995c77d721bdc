"""Counters that must count what happened, not what was asked:
  - SGLang's backup metrics (TuttiStorage.get_stats: backup_pgs, backup_bandwidth) count the
    pages a batch_set_v1 wrote, not the ones it skipped because the store already held them;
  - the linker's offload_write_failures counts every offload that failed, with or without the
    DRAM tier, once; a refused offload (backlog full) counts as offload_refusals;
  - the linker's load_failures counts a TP batch that fails in start() (its pages left the store
    after the lookup);
  - the DRAM tier counts a hit (host_hit_pages) and moves the page from probation to protected
    when a load starts, not when load() pins it: a cancelled or refused load does neither, and
    the pin still keeps the page's slot from eviction until the load ran.
A real store on temp directories; real SGLang host pools for TuttiStorage; LayerwiseKV on CPU."""

from __future__ import annotations

import pytest

from tutti_hicache.layerwise.hosttier import HostTier

torch = pytest.importorskip("torch")

from test_layerwise import GEOM, PAGE, forward, make_lw, offload_all, restore  # noqa: E402

HOST_GB = 0.004  # the test geometry's 32 KiB pages: 131 DRAM slots


def _keys(n, tag="p"):
    return [f"{tag}{i:063d}" for i in range(n)]


def _rows(n, first=1):
    return torch.arange(PAGE * first, PAGE * (first + n))


# ----------------------------------------------------------------- SGLang's backup metrics


@pytest.mark.sglang
def test_backup_metrics_count_pages_written_not_pages_already_stored(sglang, tmp_path):
    from tutti_hicache.storage import TuttiStorage
    h = sglang
    pool = h.make_mha_host_pool("layer_first", 2, 2, 64, PAGE, torch.bfloat16, 24)
    sc = h.make_storage_config(extra_config={"tutti_dirs": [str(tmp_path)],
                                             "tutti_capacity_gb": 0.05,
                                             "tutti_rescan_interval_s": 0.0})
    st = TuttiStorage(sc, {})
    st.register_mem_pool_host(pool)
    idx = pool.alloc(16 * PAGE)
    keys = h.make_page_keys(16)
    assert all(st.batch_set_v1(keys[:8], idx[:8 * PAGE]))
    m = st.get_stats()
    assert m.backup_pgs == [8] and len(m.backup_bandwidth) == 1
    # the same pages again: all stored already (True), none written, so no backup to report
    assert all(st.batch_set_v1(keys[:8], idx[:8 * PAGE]))
    m = st.get_stats()
    assert st.tutti_stats()["write_pages"] == 8
    assert m.backup_pgs == [] and m.backup_bandwidth == []  # was [8] at hundreds of GB/s
    # half old, half new: the 4 written pages, and the bandwidth of those only
    assert all(st.batch_set_v1(keys[4:12], idx[4 * PAGE:12 * PAGE]))
    m = st.get_stats()
    assert st.tutti_stats()["write_pages"] == 12
    assert m.backup_pgs == [4] and len(m.backup_bandwidth) == 1  # was [8]
    st.close()


@pytest.mark.sglang
def test_a_read_only_rank_reports_no_backup(sglang, tmp_path):
    """MLA rank 1 writes nothing (rank 0 writes for all): False per page, no backup metric."""
    from tutti_hicache.storage import TuttiStorage
    h = sglang
    pool = h.make_mla_host_pool("layer_first", 2, 32, 16, PAGE, torch.bfloat16, 8)
    sc = h.make_storage_config(tp_rank=1, tp_size=2, is_mla=True,
                               extra_config={"tutti_dirs": [str(tmp_path)],
                                             "tutti_capacity_gb": 0.05,
                                             "tutti_rescan_interval_s": 0.0})
    st = TuttiStorage(sc, {})
    st.register_mem_pool_host(pool)
    assert st.batch_set_v1(h.make_page_keys(4), pool.alloc(4 * PAGE)) == [False] * 4
    assert st.get_stats().backup_pgs == []
    st.close()


# ----------------------------------------------------------------- the linker's failures


@pytest.mark.parametrize("host_gb", [0, HOST_GB], ids=["ssd_only", "dram_tier"])
def test_every_failed_offload_counts_once(tmp_path, host_gb):
    """The store's write scheduler refuses every chunk (a 2 MiB chunk against a 1 MiB write
    backlog): no page reaches the SSD. Without the DRAM tier SGLang gets False; with it the
    offload completed (its pages are in DRAM) before the writes failed. Either way: one failed
    offload, counted once (without the tier it was not counted at all)."""
    lw, _, _ = make_lw(tmp_path, tutti_stage_mb=2, tutti_write_backlog_mb=1, tutti_host_gb=host_gb)
    keys = _keys(128)
    assert lw.offload(keys, _rows(128), [])
    lw._offloader.worker.drain()
    assert lw.num_completed() == 1 and lw.pop_completed() == (host_gb > 0)
    st = lw.stats()
    assert not lw.store.present(keys).any() and st["write_failures"] == 128
    lk = st["linker"]
    assert (lk["offloads"], lk["offload_pages"], lk["offload_write_failures"]) == (1, 0, 1)
    lw.close()


def test_a_refused_offload_is_counted(tmp_path):
    """A full backlog refuses the offload (a failed result for SGLang, no write attempted)."""
    lw, _, _ = make_lw(tmp_path, tutti_offload_backlog_pages=4)
    assert lw.offload(_keys(8), _rows(8), [])
    assert lw.num_completed() == 1 and lw.pop_completed() is False
    lk = lw.stats()["linker"]
    assert (lk["offloads"], lk["offload_write_failures"], lk["offload_refusals"]) == (0, 0, 1)
    lw.close()


def test_a_tp_batch_whose_pages_left_the_store_after_lookup_counts_as_a_load_failure(tmp_path):
    lw, _, _ = make_lw(tmp_path, ranks=2)
    keys, rows = _keys(8), _rows(8)
    offload_all(lw, keys, rows)
    assert lw.lookup(keys) == 8
    lw.store.clear()  # the pages leave the store after the lookup (eviction, a clear)
    assert lw.load("r", keys, rows)  # queued: the other rank agreed on the hit
    assert forward(lw, lw.start()) is False
    lk = lw.stats()["linker"]
    assert (lk["loads"], lk["load_pages"], lk["load_failures"]) == (0, 0, 1)  # was 0 failures
    lw.close()


# ----------------------------------------------------------------- DRAM hits


def _tier(lw):
    assert lw.host is not None and lw.host.online.wait(60)
    return lw.host


def _counts(lw):
    lk = lw.stats()["linker"]
    return {k: lk[k] for k in ("host_hit_pages", "load_host_pages", "host_probation_pages",
                               "host_protected_pages")}


def test_cancelled_and_refused_loads_neither_count_dram_hits_nor_promote(tmp_path):
    lw, k, v = make_lw(tmp_path, tutti_host_gb=HOST_GB)
    _tier(lw)
    keys, rows = _keys(8), _rows(8)
    offload_all(lw, keys, rows)
    lw._offloader.worker.drain()
    on_probation = {"host_hit_pages": 0, "load_host_pages": 0, "host_probation_pages": 8,
                    "host_protected_pages": 0}
    assert _counts(lw) == on_probation
    for i in range(3):  # SGLang aborts the requests before their batch starts
        assert lw.load(f"c{i}", keys, rows)
        assert lw.cancel(f"c{i}")
    assert _counts(lw) == on_probation  # was 24 hits and every page protected
    # a load refused because one of its SSD pages left the store since the lookup
    more = _keys(2, "q")
    offload_all(lw, more, _rows(2, 9))
    lw._offloader.worker.drain()
    lw.store.forget(more[1:])
    lw.host.forget(more[1:])
    assert not lw.load("gone", keys + more, _rows(10))
    assert _counts(lw) == {**on_probation, "host_probation_pages": 9}  # was 9 more hits
    # a load that runs: its DRAM pages are hits, served from DRAM, and protected from now on
    assert restore(lw, keys, rows)
    assert _counts(lw) == {"host_hit_pages": 8, "load_host_pages": 8, "host_probation_pages": 1,
                           "host_protected_pages": 8}
    # no page is left pinned by the cancelled or refused loads
    assert lw.host.forget(keys + more[:1]) == 9
    lw.close()


def test_a_loads_dram_pages_stay_pinned_until_it_ran(tmp_path):
    """Between load() and the run nothing may evict the load's DRAM pages, although they are
    still on probation (the first to go): the load serves their bytes from DRAM."""
    lw, k, v = make_lw(tmp_path, tutti_host_gb=8 * GEOM.num_layers * 2 * 4096 / (1 << 30))
    host = _tier(lw)
    assert host.slots == 8
    keys, rows = _keys(8), _rows(8)
    offload_all(lw, keys, rows)
    lw._offloader.worker.drain()
    want = [t[PAGE:9 * PAGE].clone() for t in k + v]
    assert lw.load("r", keys, rows)
    assert (host.reserve(_keys(8, "x"), hot=True) == -1).all()  # every slot is pinned
    assert host.present(keys).all() and _counts(lw)["host_probation_pages"] == 8
    for t in k + v:
        t[PAGE:] = -7
    assert forward(lw, lw.start())
    assert all(torch.equal(t[PAGE:9 * PAGE], w) for t, w in zip(k + v, want))
    assert _counts(lw)["load_host_pages"] == 8
    lw.close()


def test_the_dram_tier_states_its_size_in_gib():
    with pytest.raises(ValueError, match=r"GiB holds no page"):
        HostTier(100, 2, 2, 4096, torch.device("cpu"), False)


def test_dram_hits_count_the_pages_read_from_dram_not_those_copied_in_the_pool(tmp_path):
    """host_hit_pages counts the DRAM pages a load reads; a page a batch takes twice (two
    requests) or takes from the last batch's pool pages is copied in the device pool, not read
    from DRAM, and counts as a copy (load_copied_pages), not a hit. Before, both counted."""
    lw, k, v = make_lw(tmp_path, tutti_host_gb=HOST_GB)
    _tier(lw)
    keys = _keys(8)
    offload_all(lw, keys, _rows(8))
    lw._offloader.worker.drain()
    assert lw.host.present(keys).all()
    for rid, first in (("r1", 20), ("r2", 30)):  # one batch, two requests, the same 8 pages
        assert lw.load(rid, keys, _rows(8, first))
    assert forward(lw, lw.start(), decode=False)
    lw.drain_loads()
    s = lw.stats()["linker"]
    assert (s["host_hit_pages"], s["load_host_pages"], s["load_copied_pages"]) == (8, 8, 8)  # was 16 hits
    assert restore(lw, keys, _rows(8, 40), rid="r3")  # no forward since: copied from r1's pages
    lw.drain_loads()
    s = lw.stats()["linker"]
    assert (s["host_hit_pages"], s["load_host_pages"], s["load_copied_pages"]) == (8, 8, 16)  # was 24
    assert _counts(lw)["host_protected_pages"] == 8  # every load touched them all the same
    lw.close()


def test_a_full_tier_counts_only_the_pages_it_had_no_room_for():
    """host_full_pages: the keys left without a slot, not those after the first that were
    already resident (they needed none)."""
    t = HostTier(2 * 2 * 2 * 4096, 2, 2, 4096, torch.device("cpu"), False)  # 2 slots
    s = t.reserve(["a", "b"], hot=False)
    t.publish(["a", "b"], s, True, keep_pinned=True)  # both pinned: nothing to evict
    assert (t.reserve(["c", "a", "b", "d"], hot=False) == -1).all()
    assert t.stats()["host_full_pages"] == 2  # c and d (was 4)
