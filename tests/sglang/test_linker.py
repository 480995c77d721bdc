"""TuttiLinker with real SGLang 0.5.23 objects on CPU: UnifiedRadixCache, MHA/MLA device pools,
PagedTokenToKVPoolAllocator, driven insert -> offload -> commit -> reset -> match -> load ->
per-layer get_key_buffer -> finish, byte-exact, plus restart, failure, dedupe and FIFO paths.
(The CPU pipeline has no CUDA streams: copies are plain and the scatter is the torch reference.)
"""

import logging
from array import array
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from tutti_hicache.testing.linker_rig import Rig  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture
def sg(sglang):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
    return sglang


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_offload_restart_restore_byte_exact(sg, tmp_path, mla):
    toks = list(range(100, 124))  # 6 pages
    a = Rig([tmp_path], mla=mla)
    slots = a.fill(len(toks), seed=1)
    want = a.snapshot(slots)
    a.insert(toks, slots)
    a.commit_offloads(1)
    assert len(a.linker.store) == 6
    a.cache.reset()  # flush the device tree; the disk keeps the pages
    hit, failed = a.restore(toks)
    assert hit == len(toks) and not failed
    assert all(torch.equal(x, y) for x, y in zip(a.snapshot(a.loads[-1]), want))
    a.close()

    b = Rig([tmp_path], mla=mla)  # a restart: a new linker over the same directories
    hit, failed = b.restore(toks)
    assert hit == len(toks) and not failed
    assert all(torch.equal(x, y) for x, y in zip(b.snapshot(b.loads[-1]), want))
    b.close()


def test_corrupt_page_fails_the_request_not_silently(sg, tmp_path):
    toks = list(range(200, 216))
    a = Rig([tmp_path])
    slots = a.fill(len(toks), seed=2)
    a.insert(toks, slots)
    a.commit_offloads(1)
    a.cache.reset()
    store = a.linker.store
    path, off = store.locate(next(iter(store.entries())))
    with open(path, "r+b") as f:  # a layer-2 byte of one page
        f.seek(off + int(store.layout.object_offsets[4]) + 3)
        b = f.read(1)
        f.seek(off + int(store.layout.object_offsets[4]) + 3)
        f.write(bytes([b[0] ^ 0x10]))
    hit, failed = a.restore(toks)
    assert hit == len(toks)
    assert [r.rid for r in failed] == ["r1"]  # aborted by SGLang, never served
    assert store.stats()["checksum_failures"] == 1
    a.close()


def test_offload_dedupes_and_results_are_fifo(sg, tmp_path):
    a = Rig([tmp_path])
    toks1, toks2 = list(range(300, 308)), list(range(400, 412))
    s1, s2 = a.fill(len(toks1), 3), a.fill(len(toks2), 4)
    a.insert(toks1, s1)
    a.insert(toks2, s2)
    a.commit_offloads(2)
    written = a.linker.store.stats()["write_pages"]
    assert written == 5
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    keys = list(a.linker.store.entries())[:2]
    ok = a.linker.offload([PoolTransfer(name=PoolName.KV, keys=keys, device_indices=s1)])
    assert ok and a.linker.num_completed_offloads() == 1 and a.linker.pop_completed_offload()
    assert a.linker.store.stats()["write_pages"] == written  # nothing written twice
    a.close()


def test_start_cancel_and_idle_finish(sg, tmp_path):
    a = Rig([tmp_path])
    assert a.linker.start_layer_wise_loading() == -1
    assert a.linker.finish_layer_wise_loading(-1)
    toks = list(range(500, 508))
    a.insert(toks, a.fill(len(toks), 5))
    a.commit_offloads(1)
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    keys = list(a.linker.store.entries())
    assert a.linker.lookup("x", [PoolTransfer(name=PoolName.KV, keys=keys + ["0" * 64])]) == [1, 2]
    dst = a.alloc.alloc(8)
    assert a.linker.load("x", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=dst)])
    assert a.linker.cancel_queued_load("x") and not a.linker.cancel_queued_load("x")
    assert a.linker.start_layer_wise_loading() == -1
    assert not a.linker.load("y", [PoolTransfer(name=PoolName.KV, keys=["f" * 64], device_indices=dst[:4])])
    a.close()
    assert not any(t.is_alive() for t in a.linker.kv.threads)


def test_linker_hits_are_reported_as_storage(sg, tmp_path):
    """The plugin's load_back hook: SGLang files an external-linker hit under `host`; a TuttiLinker
    hit came from the SSD, so cached_tokens_details and the storage-hit metrics say `storage`."""
    from sglang.srt.managers.schedule_batch import split_cached_prefix_by_tier
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from tutti_hicache.plugin import _linker_hits_are_storage
    toks = list(range(200, 216))  # 4 pages
    a = Rig([tmp_path])
    a.insert(toks, a.fill(len(toks), seed=3))
    a.commit_offloads(1)
    a.cache.reset()
    req = SimpleNamespace(rid="r", kv=None, swa_branching_seqlen=None, last_node=None, extra_key=None,
                          session=None, swa_host_hit_length=0, mamba_host_hit_length=0,
                          host_hit_is_storage=False)
    m = a.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks + [1, 2])), req=req))
    req.last_node = m.last_device_node
    result = a.cache.linker.load_back(req)
    assert _linker_hits_are_storage(result, a.cache.linker, req) is result
    assert result[0] == len(toks) and req.host_hit_is_storage
    assert split_cached_prefix_by_tier(prefix_len=len(toks), host_hit_len=m.host_hit_length, storage_hit_len=0,
                                       host_hit_is_storage=req.host_hit_is_storage) == (0, 0, len(toks))
    a.linker.cancel_queued_load("r")
    miss = SimpleNamespace(host_hit_is_storage=False)
    _linker_hits_are_storage((0, None), a.cache.linker, miss)
    assert miss.host_hit_is_storage is False
    a.close()


def test_the_dram_tier_serves_hits_byte_exact_and_sglang_files_them_under_host(sg, tmp_path):
    """tutti_host_gb: offloaded pages stay in the linker's DRAM tier; after the device tree is
    flushed they load from DRAM byte-exact and the plugin's hook leaves SGLang's `host`; once the
    DRAM tier lets them go (as after a restart) the same hit comes from the SSD: `storage`."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from tutti_hicache.plugin import _linker_hits_are_storage
    toks = list(range(300, 316))  # 4 pages
    a = Rig([tmp_path], tutti_host_gb=0.01)
    kv = a.linker.kv
    assert kv.host is not None
    slots = a.fill(len(toks), seed=4)
    want = a.snapshot(slots)
    a.insert(toks, slots)
    a.commit_offloads(1)
    a.cache.reset()
    hit, failed = a.restore(toks)
    assert hit == len(toks) and not failed
    assert all(torch.equal(x, y) for x, y in zip(a.snapshot(a.loads[-1]), want))
    assert kv.stats()["linker"]["load_host_pages"] == 4
    for dram in (True, False):
        a.cache.reset()
        if not dram:
            kv.host.clear()
        req = SimpleNamespace(rid=f"q{dram}", kv=None, swa_branching_seqlen=None, last_node=None,
                              extra_key=None, session=None, swa_host_hit_length=0,
                              mamba_host_hit_length=0, host_hit_is_storage=False)
        m = a.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks + [1, 2])), req=req))
        req.last_node = m.last_device_node
        result = a.cache.linker.load_back(req)
        assert _linker_hits_are_storage(result, a.cache.linker, req) is result
        assert result[0] == len(toks) and req.host_hit_is_storage is (not dram)
        a.linker.cancel_queued_load(req.rid)
    a.close()


def _stored(tmp_path, toks, seed, **kw):
    """A rig whose pool pages for `toks` hold seeded bytes, inserted and offloaded, and those bytes."""
    a = Rig([tmp_path], **kw)
    slots = a.fill(len(toks), seed=seed)
    want = a.snapshot(slots)
    a.insert(toks, slots)
    a.commit_offloads(1)
    return a, want


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_dram_tier_copies_up_and_serves_mla_and_fp8_pools_byte_exact(sg, tmp_path, mla, fp8):
    """The DRAM tier over SGLang's own MHA and MLA pools, bf16 and fp8 (SGLang stores fp8 as
    bytes; MLA has one object per layer): after a restart (the tier empty) the first hit reads
    the SSD, the second copies the pages up from the bytes it read, the third loads from DRAM,
    each byte-exact, and nothing is read from the SSD twice."""
    toks = list(range(500, 520))  # 5 pages
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    a, want = _stored(tmp_path, toks, 7, mla=mla, dtype=dtype, tutti_host_gb=0.01)
    a.close()

    b = Rig([tmp_path], mla=mla, dtype=dtype, tutti_host_gb=0.01)  # a restart: the tier is empty
    kv = b.linker.kv
    assert kv.host is not None and not kv.host.present(list(kv.host._slot_of)).any()
    for i, source in enumerate(("ssd", "ssd, copied up", "dram")):
        b.cache.reset()
        before = kv.stats()["linker"]
        hit, failed = b.restore(toks, rid=f"r{i}")
        kv.drain_loads()
        after = kv.stats()["linker"]
        assert hit == len(toks) and not failed, source
        assert all(torch.equal(x, y) for x, y in zip(b.snapshot(b.loads[-1]), want)), source
        from_dram = after["load_host_pages"] - before["load_host_pages"]
        promoted = after["host_promoted_pages"] - before["host_promoted_pages"]
        assert (from_dram, promoted) == {"ssd": (0, 0), "ssd, copied up": (0, 5), "dram": (5, 0)}[source]
    assert kv.store.stats()["read_pages"] == 0  # copy-ups came from the loads' own reads
    b.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_request_matched_while_the_same_document_restores_copies_it(sg, tmp_path, mla, fp8):
    """SGLang's path: request B matches while A's restore of the same prefix and its forward run
    (A's slots stay private to A until it inserts them, so B's match finds nothing on the device
    and asks the linker): B's pages are copied from A's slots, not read again, byte-exact. After
    a decode batch, C reads them from the store."""
    toks = list(range(600, 624))  # 6 pages
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    a, want = _stored(tmp_path, toks, 11, mla=mla, dtype=dtype)
    a.cache.reset()
    kv = a.linker.kv
    for rid, decode, copied in (("A", False, 0), ("B", True, 6), ("C", True, 6)):
        hit, failed = a.restore(toks, rid=rid, decode=decode)
        kv.drain_loads()
        assert hit == len(toks) and not failed, rid
        assert all(torch.equal(x, y) for x, y in zip(a.snapshot(a.loads[-1]), want)), rid
        assert kv.stats()["linker"]["load_copied_pages"] == copied, rid
    assert kv.stats()["linker"]["load_pages"] == 12  # read: A's and C's, not B's
    a.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_request_matched_while_the_same_document_comes_from_dram_copies_it(sg, tmp_path, mla, fp8):
    """The same with the document in the DRAM tier: A takes it from DRAM, B (matched during A's
    forward) copies it from A's slots instead of taking it over the bus again, C (after a decode
    batch) takes it from DRAM; byte-exact each time."""
    toks = list(range(700, 724))  # 6 pages
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    a, want = _stored(tmp_path, toks, 13, mla=mla, dtype=dtype)
    a.close()

    b = Rig([tmp_path], mla=mla, dtype=dtype, tutti_host_gb=0.01)  # a restart: the tier empty
    kv = b.linker.kv
    for rid in ("warm", "copy-up"):  # the second load copies the pages up into the tier
        b.cache.reset()
        hit, failed = b.restore(toks, rid=rid)
        assert hit == len(toks) and not failed, rid
        kv.drain_loads()
    b.cache.reset()
    base = kv.stats()["linker"]
    for rid, decode, copied, from_dram in (("A", False, 0, 6), ("B", True, 6, 6), ("C", True, 6, 12)):
        hit, failed = b.restore(toks, rid=rid, decode=decode)
        kv.drain_loads()
        s = kv.stats()["linker"]
        assert hit == len(toks) and not failed, rid
        assert all(torch.equal(x, y) for x, y in zip(b.snapshot(b.loads[-1]), want)), rid
        assert s["load_copied_pages"] - base["load_copied_pages"] == copied, rid
        assert s["load_host_pages"] - base["load_host_pages"] == from_dram, rid
    b.close()


def test_copies_from_the_last_batch_are_off_where_a_forward_can_bypass_set_consumer(sg):
    """Speculative decoding's verify forwards (the target worker called without a batch),
    pipeline stages and HiSparse can write the pool without set_consumer: there the linker
    builds its pipeline with copy_recent off (test_load_copies.py covers what that does)."""
    from tutti_hicache.linker import _copy_recent
    plain = dict(speculative_algorithm=None, pp_size=1, enable_hisparse=False, is_embedding=False,
                 enable_pdmux=False, disaggregation_mode="null")
    assert _copy_recent(None) and _copy_recent(SimpleNamespace(**plain))
    for change in (dict(speculative_algorithm="EAGLE"), dict(pp_size=2), dict(enable_hisparse=True),
                   dict(is_embedding=True), dict(enable_pdmux=True), dict(disaggregation_mode="decode"),
                   dict(disaggregation_mode="prefill")):
        assert not _copy_recent(SimpleNamespace(**{**plain, **change})), change


@pytest.mark.parametrize("page", [1, 16, 32, 64])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_page_sizes_sglang_backends_use_restore_byte_exact_after_a_restart(sg, tmp_path, caplog, page,
                                                                               mla, fp8):
    """Pages of 16, 32 and 64 tokens (what SGLang's attention backends use for these models), and 1
    (which some MLA backends demand: it works, with one warning that names its cost), over its MHA
    and MLA pools, bf16 and fp8: written, then read by a new linker over the same directories,
    byte for byte; a shorter prompt hits its whole pages only."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    toks = list(range(1000, 1000 + 3 * page))
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        a = Rig([tmp_path], mla=mla, dtype=dtype, page=page)
    warned = [r for r in caplog.records if "--page-size 1" in r.getMessage()]
    assert len(warned) == (1 if page == 1 else 0)
    slots = a.fill(len(toks), seed=page)
    want = a.snapshot(slots)
    a.insert(toks, slots)
    a.commit_offloads(1)
    assert len(a.linker.store) == 3
    a.close()

    # each restart its own rig: the rig's pool (256 tokens) holds one restore of 3 pages of 64
    for n, cached in ((len(toks), len(toks)), (2 * page + page // 2, 2 * page)):
        b = Rig([tmp_path], mla=mla, dtype=dtype, page=page)
        hit, failed = b.restore(toks[:n], rid=f"r{n}")
        assert hit == cached and not failed and [len(x) for x in b.loads] == [cached]
        assert all(torch.equal(x, y[:cached]) for x, y in zip(b.snapshot(b.loads[-1]), want))
        b.close()


def test_decode_context_parallelism_is_refused_not_served_from_other_rows(sg, tmp_path):
    """--dcp-size 2 as SGLang 0.5.23 builds it: a rank-local pool of 4-token pages, an allocator
    of 8-token pages over virtual locations (stored at local row loc // 2), the cache's
    page_size the allocator's. The linker used to accept it and move rows page_id * 8...: other
    pages' rows (SGLang then read stale KV) and rows past the pool's end. It is refused, as
    SGLang's own direct linker refuses it."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from tutti_hicache.linker import TuttiLinker
    dcp, page, size = 2, 4, 64
    pool = MHATokenToKVPool(size=size, page_size=page, dtype=torch.bfloat16, head_num=2, head_dim=8,
                            layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = PagedTokenToKVPoolAllocator(size * dcp, page * dcp, torch.bfloat16, "cpu", pool, need_sort=False)
    r2t = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                             page_size=alloc.page_size, tree_components=(ComponentType.FULL,))
    with pytest.raises(ValueError, match="decode context parallelism"):
        TuttiLinker(None, params, extra_config={"tutti_dirs": [str(tmp_path)], "tutti_capacity_gb": 0.02})
