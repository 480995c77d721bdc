"""A TuttiLinker rank built from real SGLang 0.5.23 objects on CPU (tests and CPU checks).

    rig = Rig(dirs, mla=False, dtype=torch.bfloat16, page=4, **tutti_settings)
                                                    device pool (fp8 dtypes: SGLang stores bytes)
                                                    + allocator + UnifiedRadixCache + TuttiLinker
                                                    (through `dynamic`) over dirs
    slots = rig.fill(n_tokens, seed); rig.snapshot(slots); rig.insert(tokens, slots)
    rig.commit_offloads(n); rig.restore(tokens, rid, decode=True) -> (host hit length, failed
                                                    requests); rig.close()

restore() runs SGLang's own path: match_prefix -> init_load_back -> ready_to_load_host_cache ->
the forward's per-layer get_key_buffer (the counter's waits) -> finish_external_linker_loads.
The TP rank comes from torch.distributed when a process group is initialized (as in a server).
"""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace

import torch

P, LAYERS = 4, 4


class Rig:
    """One rank: device pool + allocator + UnifiedRadixCache + TuttiLinker over `dirs`."""

    def __init__(self, dirs, mla=False, dtype=torch.bfloat16, page=P, args=None, **extra):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context
        cfg = {"linker": "TuttiLinker", "linker_module_path": "tutti_hicache.linker",
               "linker_extra_config": {"tutti_dirs": [str(d) for d in dirs],
                                       "tutti_capacity_gb": 0.02, "tutti_stage_mb": 1, **extra}}
        self.override = get_context().override_server_args(**{
            "model_path": "dummy", "page_size": page, "enable_unified_cache_external_linker": True,
            "unified_cache_external_linker_backend": "dynamic",
            "unified_cache_external_linker_config": cfg, **(args or {})})
        self.override.install()
        if mla:
            self.pool = MLATokenToKVPool(size=256, page_size=page, dtype=dtype, kv_lora_rank=16,
                                         qk_rope_head_dim=8, layer_num=LAYERS, device="cpu",
                                         enable_memory_saver=False)
        else:
            self.pool = MHATokenToKVPool(size=256, page_size=page, dtype=dtype, head_num=2,
                                         head_dim=8, layer_num=LAYERS, device="cpu",
                                         enable_memory_saver=False, enable_alt_stream=False)
        self.alloc = PagedTokenToKVPoolAllocator(256, page, dtype, "cpu", self.pool, need_sort=False)
        r2t = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=self.alloc,
                                 page_size=page, tree_components=(ComponentType.FULL,))
        self.cache = UnifiedRadixCache(params)
        self.linker = create_unified_cache_linker(None, params, backend="dynamic", config=cfg,
                                                  components=set(self.cache.components), forward_stream=None)
        self.cache.init_cache_linker(self.linker)
        self.pool.register_layer_transfer_counter(self.linker.layer_done_counter)
        self.loads = []
        real_load = self.linker.load
        self.linker.load = lambda rid, tr: (self.loads.append(tr[0].device_indices.clone()), real_load(rid, tr))[1]
        self.mla = mla

    def buffers(self, layer):
        return [self.pool.kv_buffer[layer]] if self.mla else [self.pool.k_buffer[layer], self.pool.v_buffer[layer]]

    def fill(self, n_tokens, seed):
        g = torch.Generator().manual_seed(seed)
        slots = self.alloc.alloc(n_tokens)
        for l in range(LAYERS):
            for b in self.buffers(l):
                if b.dtype == torch.uint8:  # an fp8 pool's storage: any bytes
                    b[slots] = torch.randint(0, 256, b[slots].shape, generator=g, dtype=torch.uint8)
                else:
                    b[slots] = torch.randn(b[slots].shape, generator=g).to(b.dtype)
        return slots

    def snapshot(self, slots):
        return [b[slots].clone() for l in range(LAYERS) for b in self.buffers(l)]

    def insert(self, toks, slots):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        self.cache.insert(InsertParams(key=RadixKey(array("q", toks)), value=slots))

    def commit_offloads(self, expect, timeout=30):
        end = time.time() + timeout
        while self.linker.num_completed_offloads() < expect and time.time() < end:
            time.sleep(0.01)
        assert self.linker.num_completed_offloads() >= expect
        self.cache.check_hicache_events()

    def restore(self, toks, rid="r1", decode=True):
        """match -> init_load_back -> start -> the forward's per-layer waits -> finish; then
        (decode) the decode batch that follows a prefill."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        req = SimpleNamespace(rid=rid, kv=None, swa_branching_seqlen=None, last_node=None, extra_key=None,
                              session=None, swa_host_hit_length=0, mamba_host_hit_length=0)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks + [1, 2])), req=req))
        req.last_node = m.last_device_node
        self.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=req))
        idx = self.cache.ready_to_load_host_cache()
        self.linker.layer_done_counter.set_consumer(idx)
        for l in range(LAYERS):
            self.pool.get_key_buffer(l)
        failed = self.cache.finish_external_linker_loads([SimpleNamespace(rid=rid)])
        if decode:
            self.linker.layer_done_counter.set_consumer(-1)
        return m.host_hit_length, failed

    def close(self):
        self.cache.release_host_resources() if hasattr(self.cache, "release_host_resources") else self.linker.close()
        self.override.restore()  # the server args it published go with it (later tests see none)
