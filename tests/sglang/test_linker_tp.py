"""Two processes as two TP ranks (a gloo process group, as SGLang's TP workers have one) over one
store, on the linker path: real UnifiedRadixCache + TuttiLinker per rank, same directories.

MHA: each rank holds its own heads, so both write the same token sequence with different bytes and
each restores exactly its own (no cross-talk). MLA: the latent KV is the same on every rank; rank 0
writes, rank 1 writes nothing and restores rank 0's pages byte for byte.
"""

import multiprocessing as mp
import socket

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # spawned ranks import SGLang (about 10 s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, dirs: list, mla: bool, q, fp8: bool = False) -> None:
    try:
        import torch
        import torch.distributed as dist

        from tutti_hicache.testing import sglang as h
        h.ensure_sglang()
        from tutti_hicache.testing.linker_rig import Rig
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        toks = list(range(100, 124))  # 6 pages
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        a = Rig(dirs, mla=mla, dtype=dtype)
        slots = a.fill(len(toks), seed=0 if mla else 1 + rank)  # MLA: the same latent on both ranks
        want = a.snapshot(slots)
        a.insert(toks, slots)
        writer = a.linker.kv.writer
        a.commit_offloads(1)
        written = a.linker.store.stats()["write_pages"]
        dist.barrier()  # both ranks' offloads are on disk
        a.close()
        b = Rig(dirs, mla=mla, dtype=dtype)  # a restart of the rank over the same directories
        hit, failed = b.restore(toks)
        exact = bool(b.loads) and all(torch.equal(x, y) for x, y in zip(b.snapshot(b.loads[-1]), want))
        ident = b.linker.store.identity
        b.close()
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, dict(writer=writer, written=written, hit=hit, failed=len(failed), exact=exact,
                          tp=ident.get("tp"), dtype=ident.get("dtype"))))
    except BaseException as e:  # report instead of leaving the parent waiting
        q.put((rank, repr(e)))
        raise


def _run_ranks(tmp_path, mla: bool, fp8: bool = False) -> dict:
    return _spawn(_rank, lambda r, port, q: (r, port, [str(tmp_path)], mla, q, fp8))


def _spawn(target, args) -> dict:
    """target(*args(rank, port, queue)) in two spawned processes; {rank: what each put}."""
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=args(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for r, res in out.items():
        assert isinstance(res, dict), f"rank {r}: {res}"
    return out


def test_mha_tp_ranks_restore_their_own_heads(sglang, tmp_path):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    out = _run_ranks(tmp_path, mla=False)
    for r in (0, 1):
        assert out[r]["writer"] and out[r]["written"] == 6
        assert out[r]["hit"] == 24 and out[r]["failed"] == 0
        assert out[r]["exact"], f"rank {r} restored bytes that are not its own"
        assert out[r]["tp"] == [r, 2]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_e4m3"])
def test_mla_rank0_writes_rank1_reads(sglang, tmp_path, fp8):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    out = _run_ranks(tmp_path, mla=True, fp8=fp8)
    assert out[0]["dtype"] == out[1]["dtype"] == ("float8_e4m3fn" if fp8 else "bfloat16")
    assert out[0]["writer"] and out[0]["written"] == 6
    assert not out[1]["writer"] and out[1]["written"] == 0
    for r in (0, 1):
        assert out[r]["hit"] == 24 and out[r]["failed"] == 0 and out[r]["exact"]


def _cp_rank(rank: int, port: int, d: str, q) -> None:
    """One of two attention-CP ranks (attention TP size 1 each, CP size 2), as SGLang builds them
    for --attn-cp-size 2: real UnifiedRadixCache + TuttiLinker. Both store a document and agree
    on its hit; then rank 0's store loses a page before the load."""
    try:
        import datetime
        import time
        from types import SimpleNamespace

        import torch
        import torch.distributed as dist

        from tutti_hicache.testing import sglang as h
        h.ensure_sglang()
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context
        from array import array
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        tp_groups = [dist.new_group([0]), dist.new_group([1])]  # attention TP: one rank each
        cp_group = dist.new_group([0, 1])  # attention CP: both
        page = 4
        cfg = {"linker": "TuttiLinker", "linker_module_path": "tutti_hicache.linker",
               "linker_extra_config": {"tutti_dirs": [d], "tutti_capacity_gb": 0.02, "tutti_stage_mb": 1}}
        get_context().override_server_args(
            model_path="dummy", page_size=page, enable_unified_cache_external_linker=True,
            unified_cache_external_linker_backend="dynamic", unified_cache_external_linker_config=cfg).install()
        pool = MHATokenToKVPool(size=256, page_size=page, dtype=torch.bfloat16, head_num=2, head_dim=8,
                                layer_num=4, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        alloc = PagedTokenToKVPoolAllocator(256, page, torch.bfloat16, "cpu", pool, need_sort=False)
        r2t = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                 page_size=page, tree_components=(ComponentType.FULL,),
                                 tp_cache_group=dist.group.WORLD, attn_tp_cache_group=tp_groups[rank],
                                 attn_cp_cache_group=cp_group, attn_cp_rank=rank, attn_cp_size=2)
        cache = UnifiedRadixCache(params)
        linker = create_unified_cache_linker(None, params, backend="dynamic", config=cfg,
                                             components=set(cache.components), forward_stream=None)
        cache.init_cache_linker(linker)
        pool.register_layer_transfer_counter(linker.layer_done_counter)
        toks = list(range(100, 124))  # 6 pages
        slots = alloc.alloc(len(toks))
        for layer in range(4):
            pool.k_buffer[layer][slots] = torch.randn(pool.k_buffer[layer][slots].shape).bfloat16()
            pool.v_buffer[layer][slots] = torch.randn(pool.v_buffer[layer][slots].shape).bfloat16()
        cache.insert(InsertParams(key=RadixKey(array("q", toks)), value=slots))
        end = time.time() + 60
        while linker.num_completed_offloads() < 1 and time.time() < end:
            time.sleep(0.01)
        cache.check_hicache_events()
        cache.reset()  # the device tree flushed: the pages are on disk only
        req = SimpleNamespace(rid="r1", kv=None, swa_branching_seqlen=None, last_node=None, extra_key=None,
                              session=None, swa_host_hit_length=0, mamba_host_hit_length=0)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks + [1, 2])), req=req))
        req.last_node = m.last_device_node
        if rank == 0:  # this rank's own writes evict a page between the agreed lookup and the load
            linker.store.forget([list(linker.store.entries())[3]])
        loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                         host_hit_length=m.host_hit_length, req=req))
        idx = cache.ready_to_load_host_cache()
        linker.layer_done_counter.set_consumer(idx)
        failed = cache.finish_external_linker_loads([SimpleNamespace(rid="r1")])
        q.put((rank, dict(ranks=linker.kv._loader._ranks, hit=m.host_hit_length, loaded=int(loaded[0]),
                          failed=[r.rid for r in failed])))
        linker.close()
        dist.destroy_process_group()
    except BaseException as e:  # report instead of leaving the parent waiting
        q.put((rank, repr(e)))
        raise


def test_attention_cp_ranks_take_one_branch_when_a_page_left_one_ranks_store(sglang, tmp_path):
    """SGLang intersects the lookups and reduces finish() over the attention CP and TP groups.
    With --attn-cp-size 2 the linker counted its ranks from attention TP alone (1): the rank
    whose page left its store after the agreed lookup refused the load and recomputed, the other
    loaded, and the finish() all-reduce that only the loading rank entered never completed.
    Now both ranks queue the load and both report it failed (SGLang recomputes on both)."""
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    out = _spawn(_cp_rank, lambda r, port, q: (r, port, str(tmp_path), q))
    assert out[0]["ranks"] == out[1]["ranks"] == 2
    assert out[0]["hit"] == out[1]["hit"] == 24
    assert out[0]["loaded"] == out[1]["loaded"] == 24  # one branch on both ranks
    assert out[0]["failed"] == out[1]["failed"] == ["r1"]
