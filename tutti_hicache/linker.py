"""TuttiLinker: SGLang's UnifiedCacheLinker on the tutti object store (SSD -> GPU, layer by layer).

At a glance (SGLang's scheduler thread calls; our threads in brackets):
    lookup(rid, transfers) -> [1..n]        restorable prefix lengths, from the in-memory index
    load(rid, transfers) -> bool            pin the pages and queue; no I/O
    start_layer_wise_loading() -> index     hand every queued page to the [loader]:
        per layer: one engine batch reads that layer's objects of all pages into a pinned staging
        ring slot (per-layer checksums verified as pages land), one H2D copy, one scatter kernel
        on the I/O stream (a green-context SM partition on Hopper), one CUDA event
    layer_done_counter.wait_until(l)        forward: waits until layer l is *enqueued*, then makes
                                            the current stream wait on its event (no CPU stall)
    finish_layer_wise_loading(index) -> ok  every layer landed; False -> SGLang aborts the requests
    offload(transfers) -> bool              dedupe by key; [offloader]: gather kernel -> pinned ->
                                            engine writes, never while a load batch is reading
    num_completed_offloads / pop_completed_offload   FIFO results
    cancel_queued_load / reset / close

CPU work per request is O(layers): page arrays are built once per batch (numpy), each layer is
one engine call, one copy, one kernel. On a machine without CUDA the same pipeline runs with
plain copies (no streams, no events) so it can be tested with real SGLang objects on CPU.
The pages share the host tier's on-disk format and identity: a page written by either path is
readable by both when geometry and layout match.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from . import hashwarm
from .config import TuttiConfig
from .devicemap import DeviceMap
from .identity import identity_for, is_writer, weights_of
from .layerwise import LayerwiseKV
from .prefetch import published_weights

logger = logging.getLogger("tutti_hicache.linker")


def _kv_transfer(transfers):
    for t in transfers:
        if t.name == PoolName.KV or str(getattr(t.name, "value", t.name)) == "kv":
            return t
    raise ValueError("tutti linker: no KV transfer in " + repr([t.name for t in transfers]))


class TuttiLinker(UnifiedCacheLinker):
    """SGLang's external-linker contract on LayerwiseKV (see layerwise/ for the pipeline)."""

    def __init__(self, server_args, params, *, components=None, extra_config=None,
                 forward_stream=None, **kwargs):
        self.forward_stream = forward_stream
        cfg = TuttiConfig.from_sources(extra_config or {})
        _check_components(components)
        pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: pool}
        dm = DeviceMap.from_pool(pool, params.page_size)
        geometry = dm.geometry
        tp_rank, tp_size = _tp(params)
        # SGLang hands the linker its ServerArgs; a caller without them: what was published
        model, weights = weights_of(server_args) if server_args is not None else \
            published_weights()
        ident = identity_for(cfg, pool, geometry, model=model or _model_name(server_args),
                             pp=(params.pp_rank, params.pp_size),
                             cp=(params.attn_cp_rank, params.attn_cp_size), tp=(tp_rank, tp_size),
                             weights=weights)
        self.kv = LayerwiseKV(cfg, geometry, ident, dm.k_bufs, dm.v_bufs, params.page_size,
                              writer=is_writer(geometry.kind, tp_rank),
                              copy_recent=_copy_recent(server_args), ranks=_ranks_in_step(params))
        self.layer_done_counter = self.kv.counter
        _warn_settings(server_args, params.page_size)
        hashwarm.start()  # SGLang's page-hash module, built now rather than in the first request
        logger.info("tutti linker: %s pool, %d layers, page %d, %d pages on disk, %s engine, "
                    "I/O stream: %s", "MLA" if dm.mla else "MHA", geometry.num_layers,
                    params.page_size, len(self.kv.store), self.kv.store.engine.name,
                    getattr(self.kv.io, "kind", "cpu"))

    def lookup(self, rid: str, transfers) -> list[int]:
        return list(range(1, self.kv.lookup(_kv_transfer(transfers).keys or []) + 1))

    def load(self, rid: str, transfers) -> bool:
        kv = _kv_transfer(transfers)
        return self.kv.load(rid, kv.keys or [], kv.device_indices)

    def start_layer_wise_loading(self) -> int:
        return self.kv.start()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.kv.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.kv.cancel(rid)

    def offload(self, transfers, session_id: Optional[str] = None, **kwargs) -> bool:
        kv = _kv_transfer(transfers)
        return self.kv.offload(kv.keys or [], kv.device_indices, self.record_offload_ready())

    def num_completed_offloads(self) -> int:
        return self.kv.num_completed()

    def pop_completed_offload(self) -> bool:
        return self.kv.pop_completed()

    def reset(self) -> None:
        self.kv.reset()

    def close(self) -> None:
        self.kv.close()

    @property
    def store(self):
        return self.kv.store


def _check_components(components) -> None:
    names = {getattr(c, "name", str(c)) for c in (components or [])}
    if names and names != {"FULL"}:
        raise ValueError(f"tutti linker serves dense MHA/MLA models (FULL component only); "
                         f"got {sorted(names)}")


def _tp(params) -> tuple[int, int]:
    group = params.attn_tp_cache_group or params.tp_cache_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


def _ranks_in_step(params) -> int:
    """How many ranks take one branch on every load: SGLang intersects their lookups and
    reduces finish() over the attention CP and TP groups (the TP group when neither has two
    ranks), and later pipeline stages follow stage 0's answers. Above 1, a rank whose page left
    the store after the agreed lookup must fail the batch, not refuse the load alone (the
    attention TP group alone said 1 under --attn-cp-size 2: one rank recomputed, the other
    loaded, and their finish() all-reduce never met)."""
    def world(group) -> int:
        if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return 1
        return torch.distributed.get_world_size(group=group)
    attn = [world(getattr(params, g, None)) for g in ("attn_cp_cache_group", "attn_tp_cache_group")]
    n = 1
    for size in attn:
        n *= size
    if n == 1:
        n = world(getattr(params, "tp_cache_group", None))
    return n * max(1, int(getattr(params, "pp_size", 1) or 1))


def _warn_settings(server_args, page_size: int) -> None:
    if page_size == 1:
        logger.warning("tutti linker: --page-size 1 makes every token its own page and object; "
                       "use --page-size 64 (or larger)")
    if server_args is None:
        return
    graph = not getattr(server_args, "disable_cuda_graph", False) and \
        not getattr(server_args, "disable_prefill_cuda_graph", True) and \
        getattr(server_args, "cuda_graph_backend_prefill", "disabled") not in ("disabled", None)
    if graph:
        logger.warning("tutti linker: prefill CUDA graphs wait for every layer before replay, "
                       "which removes the layer-wise overlap; use --disable-prefill-cuda-graph")


def _copy_recent(server_args) -> bool:
    """Whether the loader may copy pages the previous batch restored (layerwise/loader.py): it
    relies on every forward passing through set_consumer. Speculative decoding's verify forwards
    (SGLang calls the target worker without a batch), pipeline stages, HiSparse's KV moves,
    embedding forwards and split prefills do not, nor does KV a PD-disaggregated node receives
    from its peer: with any of them, such pages are read again."""
    if server_args is None:
        return True
    get = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
    off = [name for name, on in (("speculative decoding", get("speculative_algorithm")),
                                 ("pipeline parallelism", (get("pp_size", 1) or 1) > 1),
                                 ("HiSparse", get("enable_hisparse", False)),
                                 ("an embedding model", get("is_embedding", False)),
                                 ("split prefill (PD multiplexing)", get("enable_pdmux", False)),
                                 ("PD disaggregation (KV transferred into the pool)",
                                  get("disaggregation_mode", "null") not in (None, "null"))) if on]
    if off:
        logger.info("tutti linker: with %s, a page the previous batch restored is read again, "
                    "not copied from its slot", " and ".join(off))
    return not off


def _model_name(server_args) -> str:
    for attr in ("served_model_name", "model_path"):
        v = getattr(server_args, attr, None) if server_args is not None else None
        if v:
            return str(v)
    return ""
