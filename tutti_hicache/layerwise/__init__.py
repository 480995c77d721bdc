"""The layer-wise restore pipeline behind TuttiLinker, free of SGLang so it can be driven directly
(the GPU benchmark runs it under SGLang 0.5.17, which has no UnifiedCacheLinker).

At a glance:
    lw = LayerwiseKV(cfg, geometry, identity, k_bufs, v_bufs, page_size, writer, observer=None,
                     copy_recent=True)       copy_recent: pages the last batch restored may be
                                            copied from their slots (loader.py; the linker turns
                                            it off where a forward can bypass set_consumer)
    lw.lookup(keys) -> n                    leading pages present (memory only)
    lw.load(rid, keys, device_indices)      pin and queue; no I/O (each page from DRAM where the
                                            DRAM tier holds it, hosttier.py; else the SSD)
    lw.from_dram(rid) -> bool               every page of rid's queued load is in DRAM
    lw.start() -> index                     every queued page, layer by layer, on the [loader]:
        one engine stream over every layer (and staging chunk), each chunk into a pinned ring
        slot, the next layer's requests queued behind this one's (read_ahead), per-layer
        checksums verified as pages land, one H2D copy, one scatter kernel on the I/O stream,
        one CUDA event -> counter.complete(index, layer)
    lw.counter.wait_until(l)                waits until layer l is enqueued, then a GPU-side wait
    lw.finish(index) -> bool                every layer landed (its pages: the next batch's
                                            copy sources, loader.py)
    lw.offload(keys, device_indices, ready_events) -> bool,  num_completed() / pop_completed()
    lw.cancel(rid), lw.drain_loads(), lw.reset(), lw.close()
    lw.stats() -> dict                      the store's counters plus the linker's (stats.py);
                                            tutti_stats_file writes them
    lw.observer                             what watches the pipeline (observe.py): `observer`
                                            if given (e.g. timeline.Trace, a benchmark's), else
                                            tutti_timeline_file's Timeline (one JSON line per
                                            load: when each chunk landed, each layer was handed
                                            over and the forward waited for it), else nothing

The parts: counter.py (LayerCounter), staging.py (pinned rings), loader.py (the load pipeline
and its thread), offloader.py (the offload queue, its backlog and its thread), stats.py (the
linker's counters and stats file), observe.py (the observer's hook points), timeline.py (the
timeline file and the benchmark's trace), windows.py (write windows), worker.py.
k_bufs / v_bufs: per-layer device tensors [rows, heads, dim] (SGLang's NHD pools; MLA passes
v_bufs=None and its [rows, 1, kv_cache_dim] buffers as k_bufs; see devicemap.py). Page p covers
rows [p*page_size, (p+1)*page_size); device_indices are token rows, page-aligned.
CPU work per batch is O(layers); on a machine without CUDA the same pipeline runs with plain
copies and the torch reference scatter.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from ..config import TuttiConfig
from ..layout import PageGeometry
from ..profiler import SlackTable
from ..store import ObjectStore
from .counter import LayerCounter
from .hosttier import HostTier, default_bytes
from .loader import Loader, LoadFailed
from .observe import Observer, observer_for
from .offloader import Offloader
from .staging import Staging
from .stats import LinkerStats
from .timeline import now_ns
from .windows import LayerTimes, Windows

__all__ = ["LayerwiseKV", "LayerCounter", "LoadFailed"]
logger = logging.getLogger("tutti_hicache.linker")


class LayerwiseKV:
    def __init__(self, cfg: TuttiConfig, geometry: PageGeometry, identity: dict, k_bufs: list,
                 v_bufs: Optional[list], page_size: int, writer: bool = True,
                 observer: Optional[Observer] = None, copy_recent: bool = True, ranks: int = 1):
        self.cfg = cfg
        self.k_bufs, self.v_bufs = list(k_bufs), (list(v_bufs) if v_bufs is not None else None)
        self.mla = v_bufs is None
        self.page_size = page_size
        self.num_layers = geometry.num_layers
        self.writer = writer
        self.device = self.k_bufs[0].device
        self.cuda = self.device.type == "cuda"
        self.times = LayerTimes(self.cuda)
        online = self.times if cfg.write_windows == "online" else None  # the forwards' progress
        self.observer = observer if observer is not None else observer_for(cfg, online)
        self.counter = LayerCounter(self.num_layers, online, self.observer)
        self.store = ObjectStore(cfg, geometry, identity, writer=writer)
        self.io = self._io_stream()
        self.obj_stride = self.store.layer_object_stride()
        per_page_layer = geometry.objects_per_layer * self.obj_stride
        self.stage_pages = max(1, (cfg.stage_mb << 20) // per_page_layer)
        self.stage = Staging(self.stage_pages * per_page_layer, cfg.stage_depth, self.device,
                             self.cuda)
        per_page = len(geometry.object_nbytes) * self.obj_stride
        self.out_pages = max(1, (cfg.stage_mb << 20) // per_page)
        # one out slot gathered while offload_writers chunks are written (offloader.py)
        self.out = Staging(self.out_pages * per_page, cfg.offload_writers + 1, self.device,
                           self.cuda)
        self.store.register_memory(self.stage.regions() + self.out.regions())
        self.host = self._host_tier(cfg, geometry)
        self.slack = SlackTable.load(cfg.slack_table) if cfg.slack_table else None
        self.windows = Windows(cfg.write_windows, self.slack, self.times,
                               sum(geometry.object_nbytes[:geometry.objects_per_layer]) // page_size)
        self._stats = LinkerStats(self.store, cfg.stats_file, self.windows, self.host)
        self._loader = Loader(self.store, self.counter, self.stage, self.stage_pages, self.k_bufs,
                              self.v_bufs, page_size, self.io, cfg, self.windows, self._stats,
                              self.observer, self.host, copy_recent, ranks)
        self._offloader = Offloader(self.store, self.out, self.out_pages, self.k_bufs, self.v_bufs,
                                    page_size, self.io, writer, cfg.offload_backlog_pages,
                                    self._stats, self.host)
        self._warm_kernels()

    def _host_tier(self, cfg: TuttiConfig, geometry: PageGeometry) -> Optional[HostTier]:
        """The DRAM tier (hosttier.py) of tutti_host_gb, or None (0, or no page fits)."""
        nbytes = int(cfg.host_gb * (1 << 30)) if cfg.host_gb >= 0 else default_bytes(self.cuda)
        per_page = self.num_layers * self.k_objs * self.obj_stride
        if nbytes < per_page:
            return None
        host = HostTier(nbytes, self.num_layers, self.k_objs, self.obj_stride, self.device, self.cuda)
        logger.info("tutti linker: DRAM tier of %.2f GiB (%d pages) in front of the SSD store",
                    host.nbytes / 2**30, host.slots)
        return host

    def _io_stream(self):
        if not self.cuda:
            return None
        from ..green import io_stream
        return io_stream(self.cfg.io_sms, self.device)

    def _warm_kernels(self) -> None:
        """Load the gather and scatter kernels at attach, so the first restore after a server
        start pays no compilation or module load: page 0's objects are gathered and scattered
        back onto themselves on the I/O stream (no byte of the pool changes)."""
        if not self.cuda:
            return
        t0 = time.perf_counter()
        with torch.cuda.stream(self.io.stream):
            dev = self.out.device
            self._offloader.gather(dev, torch.zeros(1, dtype=torch.int64, device=self.device))
            self._loader.warm(dev)
        self.io.stream.synchronize()
        self._stats.add(warmup_seconds=time.perf_counter() - t0)
        if self.host is not None:  # its kernel once its memory is pinned (a thread)
            self.host.when_online(self._loader.warm_host)

    def stats(self) -> dict:
        """The store's counters plus the linker's: loads (pages, bytes, seconds from the first read
        to the last layer handed to the GPU, failures, the first load after start), offloads, the
        pages offloaded and not yet durable (offload_backlog_pages), the DRAM tier's counters."""
        out = self._stats.snapshot()
        out["linker"]["offload_backlog_pages"] = self._offloader.backlog
        return out

    @property
    def k_objs(self) -> int:
        return 1 if self.mla else 2

    @property
    def read_ahead(self) -> int:
        """Staging chunks admitted to a load's read stream at once (tutti_read_ahead, capped by
        the staging ring)."""
        return self._loader.read_ahead

    @property
    def windows_opened(self) -> int:
        """Slack-table write windows lent by loads so far."""
        return self._loader.windows_opened

    @property
    def offload_backlog(self) -> int:
        """Pages queued for offload and not yet written."""
        return self._offloader.backlog

    @property
    def threads(self) -> tuple:
        """The loader's and the offloader's threads."""
        return self._loader.worker.thread, self._offloader.worker.thread

    # ------------------------------------------------------------ lookup / load
    def lookup(self, keys: list) -> int:
        t0 = now_ns()
        keys = list(keys)
        n = self.store.prefix_len(keys)
        if self.host is not None and n < len(keys):  # a page may be in DRAM only (not yet written)
            here = self.store.present(keys) | self.host.present(keys)
            n = int(np.argmin(here)) if not here.all() else len(keys)
        self.observer.looked_up(t0, now_ns())
        return n

    def load(self, rid: str, keys: list, device_indices) -> bool:
        self.observer.load_called()
        return self._loader.load(rid, keys, device_indices)

    def from_dram(self, rid: str) -> bool:
        """Whether rid's queued load takes every page from the DRAM tier (SGLang then files its
        hit under `host`; a load with any SSD page under `storage`)."""
        return self._loader.from_dram(rid)

    def cancel(self, rid: str) -> bool:
        return self._loader.cancel(rid)

    def start(self, input_tokens: int = 0) -> int:
        """Start every queued load; input_tokens (new tokens of the batch, 0 = unknown) picks the
        slack-table row for write windows (unknown: the smallest, most conservative one)."""
        return self._loader.start(input_tokens)

    def finish(self, index: int) -> bool:
        if index < 0:
            return True
        ok = self.counter.finish(index)
        self._loader.finished(index, ok)
        return ok

    def drain_loads(self) -> None:
        """Wait until every started load has finished and released its read hold."""
        self._loader.worker.drain()

    # ------------------------------------------------------------ offload
    def offload(self, keys: list, device_indices, ready_events: list) -> bool:
        """Queue pages for writing once `ready_events` fired (a full backlog: a failed result)."""
        t0 = now_ns()
        ok = self._offloader.offload(keys, device_indices, ready_events)
        self.observer.offloaded(t0, len(keys))
        return ok

    def num_completed(self) -> int:
        return self._offloader.num_completed()

    def pop_completed(self) -> bool:
        return self._offloader.pop_completed()

    # ------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Quiesce: finish queued loads and offloads. Data on disk is kept."""
        self._loader.cancel_all()
        self._loader.worker.drain()
        self._offloader.worker.drain()
        self._offloader.clear_results()
        self.counter.reset()

    def close(self) -> None:
        self.observer.close()  # e.g. the timeline's last forwards' records
        self.reset()
        self._stats.close()
        self._loader.worker.stop()
        self._loader.close()
        self._offloader.close()
        if self.host is not None:
            self.host.close()
        self.store.close()
        self.stage.close()
        self.out.close()
