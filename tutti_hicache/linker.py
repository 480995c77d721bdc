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
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from .config import TuttiConfig
from .engine import extension
from .identity import make_identity
from .layout import PageGeometry
from .store import ObjectStore

logger = logging.getLogger("tutti_hicache.linker")


class LoadFailed(RuntimeError):
    pass


@dataclass
class _Batch:
    """Per-batch layer state: CPU flags for "enqueued", CUDA events for "landed"."""
    layers: int
    enqueued: list = field(default_factory=list)
    events: list = field(default_factory=list)
    error: Optional[BaseException] = None

    def __post_init__(self):
        self.enqueued = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers


class LayerCounter:
    """SGLang's layer counter interface (num_layers, consumer_index, set_consumer, wait_until),
    ordered on the GPU: wait_until(l) blocks the CPU only until layer l's copy is enqueued,
    then makes the current stream wait on that copy's event."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.consumer_index = -1
        self.producer_index = -1
        self._batches: dict[int, _Batch] = {}
        self._lock = threading.Lock()

    def update_producer(self) -> int:
        with self._lock:
            self.producer_index += 1
            self._batches[self.producer_index] = _Batch(self.num_layers)
            return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int, event=None) -> None:
        b = self._batches[index]
        b.events[layer] = event
        b.enqueued[layer].set()

    def fail(self, index: int, error: BaseException) -> None:
        b = self._batches.get(index)
        if b is None:
            return
        b.error = b.error or error
        for ev in b.enqueued:
            ev.set()  # the forward runs on (wrong) bytes; finish() reports the failure

    def wait_until(self, layer: int) -> None:
        b = self._batches.get(self.consumer_index)
        if b is None:
            return
        b.enqueued[layer].wait()
        if b.events[layer] is not None:
            torch.cuda.current_stream().wait_event(b.events[layer])

    def finish(self, index: int) -> bool:
        """Wait until every layer of batch `index` has landed in device memory."""
        b = self._batches.get(index)
        if b is None:
            return True
        for ev in b.enqueued:
            ev.wait()
        for ev in b.events:
            if ev is not None:
                ev.synchronize()
        with self._lock:
            del self._batches[index]
        return b.error is None

    def reset(self) -> None:
        with self._lock:
            self.producer_index = self.consumer_index = -1
            self._batches.clear()


def _kv_transfer(transfers):
    for t in transfers:
        if t.name == PoolName.KV or str(getattr(t.name, "value", t.name)) == "kv":
            return t
    raise ValueError("tutti linker: no KV transfer in " + repr([t.name for t in transfers]))


class _Staging:
    """A ring of page-aligned pinned host slots (registered with the engine) plus one device
    slot; each ring slot remembers the event of the copy that last read it."""

    def __init__(self, slot_bytes: int, depth: int, device: torch.device, cuda: bool):
        ext = extension()
        self.slot_bytes = slot_bytes
        self.bufs = [ext.AlignedBuffer(slot_bytes) for _ in range(depth)]
        self.host = [torch.frombuffer(b, dtype=torch.uint8) for b in self.bufs]
        self.cuda = cuda
        if cuda:
            for t in self.host:
                torch.cuda.cudart().cudaHostRegister(t.data_ptr(), slot_bytes, 0)
        self.device = torch.empty(slot_bytes, dtype=torch.uint8, device=device) if cuda else None
        self.events = [None] * depth
        self.next = 0

    def regions(self) -> list[tuple[int, int]]:
        return [(b.address, b.nbytes) for b in self.bufs]

    def take(self) -> int:
        """Next ring slot, once the copy that last read it has finished."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        if self.events[k] is not None:
            self.events[k].synchronize()
            self.events[k] = None
        return k

    def close(self) -> None:
        if self.cuda:
            for t in self.host:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.host.clear()
        self.bufs.clear()


class TuttiLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components=None, extra_config=None,
                 forward_stream=None, **kwargs):
        self.forward_stream = forward_stream
        self.cfg = TuttiConfig.from_sources(extra_config or {})
        self._check_components(components)
        pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.kv_pool = pool
        self.pools = {PoolName.KV: pool}
        self.page_size = params.page_size
        self.mla, self.k_bufs, self.v_bufs, geometry = self._map_pool(pool, params.page_size)
        self.num_layers = geometry.num_layers
        self.layer_done_counter = LayerCounter(self.num_layers)
        tp_rank, tp_size = self._tp(params)
        self.writer = not self.mla or tp_rank == 0
        ident = make_identity(
            self.cfg, model=_model_name(server_args), geometry=geometry, dtype=pool.dtype,
            pp=(params.pp_rank, params.pp_size), cp=(params.attn_cp_rank, params.attn_cp_size),
            tp=(tp_rank, tp_size), heads=self._heads(pool))
        self.store = ObjectStore(self.cfg, geometry, ident, writer=self.writer)
        self.device = self.k_bufs[0].device
        self.cuda = self.device.type == "cuda"
        self.io = self._io_stream()
        self.obj_stride = self.store.layer_object_stride()
        self._make_staging(geometry)
        self._queued: dict[str, tuple] = {}
        self._results: deque = deque()
        self._backlog = 0
        self._rw = threading.Condition()
        self._loads_in_flight = 0
        self._load_q: queue.Queue = queue.Queue()
        self._offload_q: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, args=(self._load_q, self._run_load),
                                          daemon=True, name="tutti-load"),
                         threading.Thread(target=self._loop, args=(self._offload_q, self._run_offload),
                                          daemon=True, name="tutti-offload")]
        for t in self._threads:
            t.start()
        self._warn_settings(server_args)
        logger.info("tutti linker: %s pool, %d layers, page %d, %d pages on disk, %s engine, "
                    "I/O stream: %s", "MLA" if self.mla else "MHA", self.num_layers,
                    self.page_size, len(self.store), self.store.engine.name,
                    getattr(self.io, "kind", "cpu"))

    # ------------------------------------------------------------ setup
    @staticmethod
    def _check_components(components) -> None:
        names = {getattr(c, "name", str(c)) for c in (components or [])}
        if names and names != {"FULL"}:
            raise ValueError(f"tutti linker serves dense MHA/MLA models (FULL component only); "
                             f"got {sorted(names)}")

    @staticmethod
    def _map_pool(pool, page_size: int):
        kind = type(pool).__name__
        if getattr(pool, "k_scale_buffer", None) is not None or \
                getattr(pool, "kv_cache_layout", None) == "vectorized_5d":
            raise ValueError(f"tutti linker: {kind} with scales or a 5D layout is not supported")
        if kind == "MLATokenToKVPool":
            bufs = list(pool.kv_buffer)
            g = PageGeometry("mla", len(bufs), page_size, bufs[0][0].numel() * bufs[0].element_size(), 0)
            return True, bufs, None, g
        if kind != "MHATokenToKVPool" or getattr(pool, "use_hnd", False):
            raise ValueError(f"tutti linker: {kind}{' (HND)' if getattr(pool, 'use_hnd', False) else ''}"
                             " is not supported (MHATokenToKVPool NHD or MLATokenToKVPool)")
        k, v = list(pool.k_buffer), list(pool.v_buffer)
        for t in k + v:
            if not t.is_contiguous():
                raise ValueError("tutti linker: device K/V buffers must be contiguous")
        kb = k[0][0].numel() * k[0].element_size()
        vb = v[0][0].numel() * v[0].element_size()
        return False, k, v, PageGeometry("mha", len(k), page_size, kb, vb)

    def _heads(self, pool):
        if self.mla:
            return None
        return [pool.head_num, pool.head_dim, getattr(pool, "v_head_dim", pool.head_dim)]

    @staticmethod
    def _tp(params) -> tuple[int, int]:
        group = params.attn_tp_cache_group or params.tp_cache_group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return (torch.distributed.get_rank(group=group),
                    torch.distributed.get_world_size(group=group))
        return 0, 1

    def _io_stream(self):
        if not self.cuda:
            return None
        from .green import io_stream
        return io_stream(self.cfg.io_sms, self.device) if self.cfg.io_sms else \
            _PriorityStream(self.device)

    def _make_staging(self, g: PageGeometry) -> None:
        per_page_layer = g.objects_per_layer * self.obj_stride
        self.stage_pages = max(1, (self.cfg.stage_mb << 20) // per_page_layer)
        self.stage = _Staging(self.stage_pages * per_page_layer, self.cfg.stage_depth,
                              self.device, self.cuda)
        per_page = len(g.object_nbytes) * self.obj_stride
        self.out_pages = max(1, (self.cfg.stage_mb << 20) // per_page)
        self.out = _Staging(self.out_pages * per_page, 2, self.device, self.cuda)
        self.store.register_memory(self.stage.regions() + self.out.regions())

    def _warn_settings(self, server_args) -> None:
        if self.page_size == 1:
            logger.warning("tutti linker: --page-size 1 makes every token its own page and "
                           "object; use --page-size 64 (or larger)")
        prefill_graph = server_args is not None and not getattr(server_args, "disable_cuda_graph", False) \
            and not getattr(server_args, "disable_prefill_cuda_graph", True) \
            and getattr(server_args, "cuda_graph_backend_prefill", "disabled") not in ("disabled", None)
        if prefill_graph:
            logger.warning("tutti linker: prefill CUDA graphs wait for every layer before replay, "
                           "which removes the layer-wise overlap; use --disable-prefill-cuda-graph")

    # ------------------------------------------------------------ lookup / load
    def lookup(self, rid: str, transfers) -> list[int]:
        n = self.store.prefix_len(list(_kv_transfer(transfers).keys or []))
        return list(range(1, n + 1))

    def load(self, rid: str, transfers) -> bool:
        kv = _kv_transfer(transfers)
        keys = list(kv.keys or [])
        if not keys or kv.device_indices is None or len(kv.device_indices) != len(keys) * self.page_size:
            return False
        if rid in self._queued:
            raise ValueError(f"tutti linker: request {rid} is already queued")
        entries = self.store.pin(keys)
        if any(e is None for e in entries):
            self.store.unpin(entries)
            return False
        self._queued[rid] = (entries, kv.device_indices)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        item = self._queued.pop(rid, None)
        if item is None:
            return False
        self.store.unpin(item[0])
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1
        items = list(self._queued.values())
        self._queued.clear()
        entries = [e for es, _ in items for e in es]
        page_ids = torch.cat([di[:: self.page_size] // self.page_size for _, di in items])
        index = self.layer_done_counter.update_producer()
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        with self._rw:
            self._loads_in_flight += 1
        self._load_q.put((index, entries, page_ids, ready))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        if counter_index < 0:
            return True
        return self.layer_done_counter.finish(counter_index)

    # ------------------------------------------------------------ the load pipeline
    def _run_load(self, job) -> None:
        index, entries, page_ids, ready = job
        try:
            plan = self.store.plan_pages(entries)
            if ready is not None:
                self.io.stream.wait_event(ready)
            for layer in range(self.num_layers):
                for c0 in range(0, len(entries), self.stage_pages):
                    rows = slice(c0, min(len(entries), c0 + self.stage_pages))
                    self._load_chunk(plan, layer, rows, page_ids[rows])
                self.layer_done_counter.complete(index, layer, self._mark())
        except BaseException as e:  # the forward must never hang; finish() reports it
            logger.error("tutti linker: load of %d pages failed: %s", len(entries), e)
            self.layer_done_counter.fail(index, e)
        finally:
            self.store.unpin(entries)
            with self._rw:
                self._loads_in_flight -= 1
                self._rw.notify_all()

    def _load_chunk(self, plan, layer: int, rows: slice, page_ids) -> None:
        n = rows.stop - rows.start
        per_page = self.k_objs * self.obj_stride
        k = self.stage.take()
        dst = self.stage.bufs[k].address + np.arange(n, dtype=np.uint64) * np.uint64(per_page)
        ok = self.store.read_layer(plan, layer, dst, rows)
        if not ok.all():
            raise LoadFailed(f"layer {layer}: {int((~ok).sum())} of {n} pages unreadable or corrupt")
        host = self.stage.host[k][: n * per_page]
        if not self.cuda:
            self._scatter(host, layer, page_ids)
            return
        with torch.cuda.stream(self.io.stream):
            dev = self.stage.device[: n * per_page]
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.stage.events[k] = ev  # the ring slot is free once this copy is done
            self._scatter(dev, layer, page_ids)

    @property
    def k_objs(self) -> int:
        return 1 if self.mla else 2

    def _scatter(self, staging, layer: int, page_ids) -> None:
        from . import triton_kernels as tk
        if self.mla:
            fn = tk.scatter_layer_mla if self.cuda else _ref_mla_scatter
            fn(staging, self.k_bufs[layer], page_ids, self.page_size, self.obj_stride)
        else:
            fn = tk.scatter_layer if self.cuda else tk.scatter_layer_ref
            fn(staging, self.k_bufs[layer], self.v_bufs[layer], page_ids, self.page_size,
               self.obj_stride)

    def _mark(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.io.stream)
        return ev

    # ------------------------------------------------------------ offload
    def offload(self, transfers, session_id: Optional[str] = None, **kwargs) -> bool:
        kv = _kv_transfer(transfers)
        keys = list(kv.keys or [])
        if not self.writer:  # MLA: rank 0 writes for every rank
            self._results.append(_Done(True))
            return True
        todo = [i for i, k in enumerate(keys) if k not in self.store]
        if not todo:
            self._results.append(_Done(True))
            return True
        if self._backlog + len(todo) > self.cfg.offload_backlog_pages:
            return False
        page_ids = kv.device_indices[:: self.page_size] // self.page_size
        if len(todo) < len(keys):
            page_ids = page_ids[torch.tensor(todo, device=page_ids.device)]
        job = _Offload([keys[i] for i in todo], page_ids, self.record_offload_ready())
        self._backlog += len(todo)
        self._results.append(job)
        self._offload_q.put(job)
        return True

    def _run_offload(self, job: "_Offload") -> None:
        ok = True
        try:
            for ev in job.events:
                ev.synchronize()
            for c0 in range(0, len(job.keys), self.out_pages):
                ok &= self._offload_chunk(job.keys[c0:c0 + self.out_pages],
                                          job.page_ids[c0:c0 + self.out_pages])
        except BaseException as e:
            logger.error("tutti linker: offload of %d pages failed: %s", len(job.keys), e)
            ok = False
        finally:
            self._backlog -= len(job.keys)
            job.finish(ok)

    def _offload_chunk(self, keys: list, page_ids) -> bool:
        from . import triton_kernels as tk
        n = len(keys)
        m = self.num_layers * self.k_objs
        k = self.out.take()
        host = self.out.host[k][: n * m * self.obj_stride]
        if self.cuda:
            with torch.cuda.stream(self.io.stream):
                dev = self.out.device[: n * m * self.obj_stride]
                fn = tk.gather_pages_mla if self.mla else tk.gather_pages
                args = (self.k_bufs,) if self.mla else (self.k_bufs, self.v_bufs)
                fn(dev, *args, page_ids, self.page_size, self.obj_stride)
                host.copy_(dev, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            ev.synchronize()
        else:
            tk.gather_pages_ref(host, self.k_bufs, None if self.mla else self.v_bufs, page_ids,
                                self.page_size, self.obj_stride)
        addrs = (self.out.bufs[k].address + np.arange(n * m, dtype=np.uint64) * np.uint64(self.obj_stride)
                 ).reshape(n, m)
        with self._rw:  # never write while a layer-wise read batch is in flight
            while self._loads_in_flight:
                self._rw.wait()
        exact = self.obj_stride == int(self.store.layout.object_nbytes[0])  # 4 KiB multiples
        return bool(self.store.write_pages(keys, addrs, exact).all())

    def num_completed_offloads(self) -> int:
        n = 0
        for r in self._results:
            if not r.done:
                break
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        return bool(self._results.popleft().ok)

    # ------------------------------------------------------------ lifecycle
    def _loop(self, q: queue.Queue, fn) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                fn(job)
            finally:
                q.task_done()

    def reset(self) -> None:
        """Quiesce: finish queued loads and offloads. Data on disk is kept."""
        for rid in list(self._queued):
            self.cancel_queued_load(rid)
        self._load_q.join()
        self._offload_q.join()
        self._results.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        for q in (self._load_q, self._offload_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout=60)
        self.store.close()
        self.stage.close()
        self.out.close()


@dataclass
class _Done:
    ok: bool
    done: bool = True


class _Offload:
    def __init__(self, keys, page_ids, events):
        self.keys, self.page_ids, self.events = keys, page_ids, events
        self.ok, self.done = False, False

    def finish(self, ok: bool) -> None:
        self.ok, self.done = ok, True


class _PriorityStream:
    kind = "priority"

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device=device, priority=-1)


def _ref_mla_scatter(staging, kv_buf, page_ids, page_size, obj_stride):
    from . import triton_kernels as tk
    tk.scatter_layer_ref(staging, kv_buf, None, page_ids, page_size, obj_stride)


def _model_name(server_args) -> str:
    for attr in ("served_model_name", "model_path"):
        v = getattr(server_args, attr, None) if server_args is not None else None
        if v:
            return str(v)
    return ""
