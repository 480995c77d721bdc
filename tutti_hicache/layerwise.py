"""The layer-wise restore pipeline behind TuttiLinker, free of SGLang so it can be driven directly
(the GPU benchmark runs it under SGLang 0.5.17, which has no UnifiedCacheLinker).

At a glance:
    lw = LayerwiseKV(cfg, geometry, identity, k_bufs, v_bufs, page_size, writer)
    lw.lookup(keys) -> n                    leading pages present (memory only)
    lw.load(rid, keys, device_indices)      pin and queue; no I/O
    lw.start() -> index                     every queued page, layer by layer, on the [loader]:
        one engine stream over every layer (and staging chunk), each chunk into a pinned ring
        slot, the next layer's requests queued behind this one's (read_ahead), per-layer
        checksums verified as pages land, one H2D copy, one scatter kernel on the I/O stream,
        one CUDA event -> counter.complete(index, layer)
    lw.counter.wait_until(l)                waits until layer l is enqueued, then a GPU-side wait
    lw.finish(index) -> bool                every layer landed
    lw.offload(keys, device_indices, ready_events) -> bool,  num_completed() / pop_completed()
    lw.cancel(rid), lw.reset(), lw.close()

k_bufs / v_bufs: per-layer device tensors [rows, heads, dim] (SGLang's NHD pools; MLA passes
v_bufs=None and its [rows, 1, kv_cache_dim] buffers as k_bufs). Page p covers rows
[p*page_size, (p+1)*page_size); device_indices are token rows, page-aligned.
CPU work per batch is O(layers); on a machine without CUDA the same pipeline runs with plain
copies and the torch reference scatter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import TuttiConfig
from .engine import extension
from .layout import PageGeometry, strided
from .profiler import SlackTable
from .statsfile import StatsFile
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
        self.waited = -1  # last layer the forward waited for (its progress)
        self._batches: dict[int, _Batch] = {}
        self._lock = threading.Lock()

    def update_producer(self) -> int:
        with self._lock:
            self.producer_index += 1
            self._batches[self.producer_index] = _Batch(self.num_layers)
            return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index
        self.waited = -1

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
        self.waited = layer
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


class LayerwiseKV:
    def __init__(self, cfg: TuttiConfig, geometry: PageGeometry, identity: dict, k_bufs: list,
                 v_bufs: Optional[list], page_size: int, writer: bool = True):
        self.cfg = cfg
        self.k_bufs, self.v_bufs = list(k_bufs), (list(v_bufs) if v_bufs is not None else None)
        self.mla = v_bufs is None
        self.page_size = page_size
        self.num_layers = geometry.num_layers
        self.writer = writer
        self.counter = LayerCounter(self.num_layers)
        self.store = ObjectStore(cfg, geometry, identity, writer=writer)
        self.device = self.k_bufs[0].device
        self.cuda = self.device.type == "cuda"
        self.io = self._io_stream()
        self.obj_stride = self.store.layer_object_stride()
        self._make_staging(geometry)
        self.page_nbytes = self.num_layers * self.k_objs * self.obj_stride
        self._stats = {"loads": 0, "load_pages": 0, "load_bytes": 0, "load_seconds": 0.0,
                       "load_failures": 0, "first_load_seconds": None, "offloads": 0,
                       "offload_pages": 0, "offload_seconds": 0.0, "warmup_seconds": 0.0}
        self._stats_lock = threading.Lock()
        self._stats_file = StatsFile(cfg.stats_file)
        self._warm_kernels()
        self._queued: dict[str, tuple] = {}
        self._results: deque = deque()
        self._backlog_lock = threading.Lock()  # offload() and the offload thread both change it
        self._backlog = 0
        self.slack = SlackTable.load(cfg.slack_table) if cfg.slack_table else None
        self.windows_opened = 0
        self.read_ahead = max(1, min(cfg.read_ahead, cfg.stage_depth - 1))
        self._load_q: queue.Queue = queue.Queue()
        self._offload_q: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, args=(self._load_q, self._run_load),
                                          daemon=True, name="tutti-load"),
                         threading.Thread(target=self._loop, args=(self._offload_q, self._run_offload),
                                          daemon=True, name="tutti-offload")]
        for t in self._threads:
            t.start()

    @property
    def offload_backlog(self) -> int:
        """Pages queued for offload and not yet written."""
        with self._backlog_lock:
            return self._backlog

    @property
    def k_objs(self) -> int:
        return 1 if self.mla else 2

    def _io_stream(self):
        if not self.cuda:
            return None
        from .green import io_stream
        return io_stream(self.cfg.io_sms, self.device)

    def _make_staging(self, g: PageGeometry) -> None:
        per_page_layer = g.objects_per_layer * self.obj_stride
        self.stage_pages = max(1, (self.cfg.stage_mb << 20) // per_page_layer)
        self.stage = _Staging(self.stage_pages * per_page_layer, self.cfg.stage_depth,
                              self.device, self.cuda)
        per_page = len(g.object_nbytes) * self.obj_stride
        self.out_pages = max(1, (self.cfg.stage_mb << 20) // per_page)
        self.out = _Staging(self.out_pages * per_page, 2, self.device, self.cuda)
        self.store.register_memory(self.stage.regions() + self.out.regions())

    def _warm_kernels(self) -> None:
        """Load the gather and scatter kernels at attach, so the first restore after a server
        start pays no compilation or module load: page 0's objects are gathered and scattered
        back onto themselves on the I/O stream (no byte of the pool changes)."""
        if not self.cuda:
            return
        t0 = time.perf_counter()
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        with torch.cuda.stream(self.io.stream):
            dev = self.out.device
            self._gather(dev, ids)
            per_layer = self.k_objs * self.obj_stride
            for layer in range(self.num_layers):
                self._scatter(dev[layer * per_layer:(layer + 1) * per_layer], layer, ids)
        self.io.stream.synchronize()
        self._stats["warmup_seconds"] = time.perf_counter() - t0

    def stats(self) -> dict:
        """The store's counters plus the linker's: loads (pages, bytes, seconds from the first read
        to the last layer handed to the GPU, failures, the first load after start), offloads."""
        with self._stats_lock:
            mine = dict(self._stats)
        return {**self.store.stats(), "linker": mine}

    def _account(self, **add) -> None:
        with self._stats_lock:
            for k, v in add.items():
                self._stats[k] += v
        self._stats_file.dump(self.stats())

    # ------------------------------------------------------------ lookup / load
    def lookup(self, keys: list) -> int:
        return self.store.prefix_len(list(keys))

    def load(self, rid: str, keys: list, device_indices) -> bool:
        keys = list(keys)
        if not keys or device_indices is None or len(device_indices) != len(keys) * self.page_size:
            return False
        if rid in self._queued:
            raise ValueError(f"tutti linker: request {rid} is already queued")
        entries = self.store.pin(keys)
        if any(e is None for e in entries):
            self.store.unpin(entries)
            return False
        self._queued[rid] = (entries, device_indices)
        return True

    def cancel(self, rid: str) -> bool:
        item = self._queued.pop(rid, None)
        if item is None:
            return False
        self.store.unpin(item[0])
        return True

    def start(self, input_tokens: int = 0) -> int:
        """Start every queued load; input_tokens (new tokens of the batch, 0 = unknown) picks the
        slack-table row for write windows (unknown: the smallest, most conservative one)."""
        if not self._queued:
            return -1
        items = list(self._queued.values())
        self._queued.clear()
        entries = [e for es, _ in items for e in es]
        page_ids = torch.cat([di[:: self.page_size] // self.page_size for _, di in items])
        index = self.counter.update_producer()
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._load_q.put((index, entries, page_ids, ready, input_tokens))
        return index

    def finish(self, index: int) -> bool:
        return True if index < 0 else self.counter.finish(index)

    # ------------------------------------------------------------ the load pipeline
    def _run_load(self, job) -> None:
        """Reads hold every directory of the batch against writes from start to the last layer,
        except in slack-table windows opened while the reads are ahead of the forward.
        Every (layer, staging chunk) of the batch is one store stream: `read_ahead` chunks are
        admitted at once, so the next layer's requests wait at the devices behind this layer's
        and the queue never drains between layers; each chunk lands, is verified, copied and
        scattered in layer order."""
        index, entries, page_ids, ready, input_tokens = job
        t0 = time.perf_counter()
        try:
            self._load(index, entries, page_ids, ready, input_tokens)
            seconds = time.perf_counter() - t0  # the first read to the last layer handed over
            if self._stats["first_load_seconds"] is None:
                self._stats["first_load_seconds"] = seconds
            self._account(loads=1, load_pages=len(entries), load_bytes=len(entries) * self.page_nbytes,
                          load_seconds=seconds)
        except BaseException as e:  # the forward must never hang; finish() reports it
            logger.error("tutti linker: load of %d pages failed: %s", len(entries), e)
            self.counter.fail(index, e)
            self._account(load_failures=1)
        finally:
            self.store.unpin(entries)

    def _load(self, index, entries, page_ids, ready, input_tokens) -> None:
        plan = self.store.plan_pages(entries)
        window = self._window(input_tokens, len(entries) * self.page_size)
        if ready is not None:
            self.io.stream.wait_event(ready)
        n, per_page = len(entries), self.k_objs * self.obj_stride
        chunks = [(layer, slice(c0, min(n, c0 + self.stage_pages)))
                  for layer in range(self.num_layers) for c0 in range(0, n, self.stage_pages)]
        depth = len(self.stage.bufs)
        slots = [(self.stage.next + i) % depth for i in range(len(chunks))]  # take() order
        dsts = [strided(self.stage.bufs[k].address, rows.stop - rows.start, per_page)
                for (_, rows), k in zip(chunks, slots)]
        # the stream holds the batch's directories for reads until it is closed (and then
        # nothing lands in the staging slots any more)
        with self.store.stream_layers(plan, chunks, dsts) as stream:
            admitted = 0
            for i, (layer, rows) in enumerate(chunks):
                while admitted < min(len(chunks), i + self.read_ahead):
                    if self.stage.take() != slots[admitted]:  # waits for its last copy
                        raise RuntimeError("tutti linker: staging ring out of order")
                    admitted += 1
                stream.allow(admitted)
                ok = stream.wait(i)
                if not ok.all():
                    raise LoadFailed(f"layer {layer}: {int((~ok).sum())} of {len(ok)} pages "
                                     "unreadable or corrupt")
                self._copy_chunk(slots[i], layer, len(ok), page_ids[rows])
                if rows.stop < n:
                    continue
                self.counter.complete(index, layer, self._mark())
                if window > 0 and layer + 1 < self.num_layers and layer - self.counter.waited >= 2:
                    self.windows_opened += 1
                    stream.lend(window)  # settles what was admitted, then one write window

    def _window(self, input_tokens: int, prefix_tokens: int) -> float:
        if self.slack is None:
            return 0.0
        return self.slack.window(input_tokens, prefix_tokens)[0]

    def _copy_chunk(self, k: int, layer: int, n: int, page_ids) -> None:
        """Ring slot k holds layer `layer` of n pages: to the device pool (H2D + scatter)."""
        host = self.stage.host[k][: n * self.k_objs * self.obj_stride]
        if not self.cuda:
            self._scatter(host, layer, page_ids)
            return
        with torch.cuda.stream(self.io.stream):
            dev = self.stage.device[: host.numel()]
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.stage.events[k] = ev  # the ring slot is free once this copy is done
            self._scatter(dev, layer, page_ids)

    def _scatter(self, staging, layer: int, page_ids) -> None:
        from . import triton_kernels as tk
        fn = tk.scatter_layer if self.cuda else tk.scatter_layer_ref
        v_buf = None if self.mla else self.v_bufs[layer]
        fn(staging, self.k_bufs[layer], v_buf, page_ids, self.page_size, self.obj_stride)

    def _gather(self, dev, page_ids) -> None:
        """Every layer of pages `page_ids` into device staging `dev` (on the current stream)."""
        from . import triton_kernels as tk
        tk.gather_pages(dev, self.k_bufs, self.v_bufs, page_ids, self.page_size, self.obj_stride)

    def _mark(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.io.stream)
        return ev

    # ------------------------------------------------------------ offload
    def offload(self, keys: list, device_indices, ready_events: list) -> bool:
        """Queue pages for writing once `ready_events` fired; False when the backlog is full."""
        keys = list(keys)
        if not self.writer:  # MLA: rank 0 writes for every rank
            self._results.append(_Done(True))
            return True
        todo = [i for i, k in enumerate(keys) if k not in self.store]
        if not todo:
            self._results.append(_Done(True))
            return True
        with self._backlog_lock:
            if self._backlog + len(todo) > self.cfg.offload_backlog_pages:
                return False
            self._backlog += len(todo)  # reserved: given back when the job ends
        try:
            page_ids = device_indices[:: self.page_size] // self.page_size
            if len(todo) < len(keys):
                page_ids = page_ids[torch.tensor(todo, device=page_ids.device)]
            job = _Offload([keys[i] for i in todo], page_ids, list(ready_events))
        except BaseException:
            with self._backlog_lock:
                self._backlog -= len(todo)
            raise
        self._results.append(job)
        self._offload_q.put(job)
        return True

    def _run_offload(self, job: "_Offload") -> None:
        ok = True
        t0 = time.perf_counter()
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
            with self._backlog_lock:
                self._backlog -= len(job.keys)
            job.finish(ok)
            self._account(offloads=1, offload_pages=len(job.keys) if ok else 0,
                          offload_seconds=time.perf_counter() - t0)

    def _offload_chunk(self, keys: list, page_ids) -> bool:
        from . import triton_kernels as tk
        n = len(keys)
        m = self.num_layers * self.k_objs
        k = self.out.take()
        host = self.out.host[k][: n * m * self.obj_stride]
        if self.cuda:
            with torch.cuda.stream(self.io.stream):
                dev = self.out.device[: n * m * self.obj_stride]
                self._gather(dev, page_ids)
                host.copy_(dev, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            ev.synchronize()
        else:
            tk.gather_pages_ref(host, self.k_bufs, self.v_bufs, page_ids, self.page_size,
                                self.obj_stride)
        addrs = strided(self.out.bufs[k].address, n * m, self.obj_stride).reshape(n, m)
        # the store's scheduler keeps these writes off directories a load batch is reading
        exact = self.obj_stride == int(self.store.layout.object_nbytes[0])  # 4 KiB multiples
        return bool(self.store.write_pages(keys, addrs, exact).all())

    def num_completed(self) -> int:
        n = 0
        for r in self._results:
            if not r.done:
                break
            n += 1
        return n

    def pop_completed(self) -> bool:
        return bool(self._results.popleft().ok)

    # ------------------------------------------------------------ lifecycle
    def _loop(self, q: queue.Queue, fn) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                fn(job)
            except Exception:  # the worker outlives any one job (each job reports its own failure)
                logger.exception("tutti linker: worker job failed")
            finally:
                q.task_done()

    def reset(self) -> None:
        """Quiesce: finish queued loads and offloads. Data on disk is kept."""
        for rid in list(self._queued):
            self.cancel(rid)
        self._load_q.join()
        self._offload_q.join()
        self._results.clear()
        self.counter.reset()

    def close(self) -> None:
        self.reset()
        self._stats_file.dump(self.stats(), force=True)
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
        self.ok = ok
        self.done = True  # last: a reader that sees done sees ok



