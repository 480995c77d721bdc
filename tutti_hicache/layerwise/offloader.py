"""The offload queue of the layer-wise path: device pages -> the store, behind SGLang's events.

At a glance ([scheduler] = SGLang's scheduler thread; [offloader] = this module's thread):
    off = Offloader(store, out, out_pages, k_bufs, v_bufs, page_size, io, writer, max_backlog,
                    stats)
    off.offload(keys, device_indices, ready_events) -> bool   [scheduler] False: backlog full
        keys already stored complete at once; the rest wait for ready_events, then per chunk
        of out_pages: [stage] gather kernel -> pinned (D2H) while [write] store.land_pages
        (after one store.begin_pages: slots, tombstones) writes the chunks before, up to out
        slots - 1 (tutti_offload_writers) at once (on idle directories the store's scheduler lets a younger one's chunks join the older
        one's last within the bytes the queues hold, on the engine's write rings; under reads
        it runs one chunk per directory and keeps them off directories a load is reading);
        once every chunk has landed, one store.publish_pages writes all their headers; with the
        DRAM tier the offload completes once every chunk is off the device (its pages in DRAM
        or staged), before its SSD writes end: off.backlog counts the pages not yet durable
    off.num_completed() / off.pop_completed() -> ok            [scheduler] FIFO results
        counted (stats): every job (offloads), its pages once stored (offload_pages), every
        failed job once (offload_write_failures), every refusal of a full backlog
        (offload_refusals)
    off.backlog                                                pages queued and not yet written
    off.clear_results(), off.worker (drain, thread), off.close()

Thread-safety: the backlog is changed by offload() on the scheduler thread and by the offloader
thread when a job ends, so both go through one lock (check and reserve are one step). The
results deque belongs to the scheduler thread; the offloader thread only marks a job done, after
its `ok` (a reader that sees done also sees ok).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import strided
from .staging import Staging
from .stats import LinkerStats
from .worker import Worker

logger = logging.getLogger("tutti_hicache.linker")


@dataclass
class _Done:
    ok: bool
    done: bool = True


class _Offload:
    def __init__(self, keys, page_ids, events):
        self.keys, self.page_ids, self.events = keys, page_ids, events
        self.ok, self.done = False, False
        self.dirty: list = []      # DRAM slots holding this job's pages until their write publishes
        self.all_in_dram = True    # every page got a DRAM slot (else completion waits for the SSD)

    def finish(self, ok: bool) -> None:
        self.ok = ok
        self.done = True  # last: a reader that sees done sees ok


class Offloader:
    def __init__(self, store, out: Staging, out_pages: int, k_bufs: list, v_bufs, page_size: int,
                 io, writer: bool, max_backlog: int, stats: LinkerStats, host=None):
        self._store, self._out, self._out_pages = store, out, out_pages
        self._host = host  # the DRAM tier: offloaded pages are kept there too (hosttier.py)
        self._k_bufs, self._v_bufs, self._page_size = k_bufs, v_bufs, page_size
        self._objs_per_page = len(k_bufs) * (1 if v_bufs is None else 2)
        self._obj_stride = store.layer_object_stride()
        self._io = io  # green.IOStream on a CUDA device; None on CPU
        self._writer = writer
        self._max_backlog = max_backlog
        self._stats = stats
        self._lock = threading.Lock()  # the backlog
        self._backlog = 0
        self._results: deque = deque()
        # one chunk is gathered (and copied to the host) while the ones before it are written,
        # up to one fewer than the out slots at once: a chunk's write starts while the previous
        # chunk's last requests drain, so the devices' queues never empty between chunks
        self._stage = ThreadPoolExecutor(1, thread_name_prefix="tutti-offload-stage")
        self._writes_in_flight = max(1, len(out.bufs) - 1)
        self._writers = ThreadPoolExecutor(self._writes_in_flight,
                                           thread_name_prefix="tutti-offload-write")
        self.worker = Worker("tutti-offload", self._run)

    @property
    def backlog(self) -> int:
        with self._lock:
            return self._backlog

    # ------------------------------------------------------------ [scheduler]
    def offload(self, keys: list, device_indices, ready_events: list) -> bool:
        """Queue pages for writing once `ready_events` fired. A full backlog is a failed result,
        not False: SGLang acts on each rank's answer without reducing it and matches the results
        by position, while it reduces each result over the ranks; a refusal on one rank alone
        would part the ranks' queues of pending offloads."""
        keys = list(keys)
        if not self._writer:  # MLA: rank 0 writes for every rank
            self._results.append(_Done(True))
            return True
        todo = [i for i, k in enumerate(keys) if k not in self._store]
        if not todo:
            self._results.append(_Done(True))
            return True
        with self._lock:
            refused = self._backlog + len(todo) > self._max_backlog
            if not refused:
                self._backlog += len(todo)  # reserved: given back when the job ends
        if refused:
            self._results.append(_Done(False))
            self._stats.add(offload_refusals=1)
            return True
        try:
            ps = self._page_size
            page_ids = device_indices[::ps] // ps
            if len(todo) < len(keys):
                page_ids = page_ids[torch.tensor(todo, device=page_ids.device)]
            events = list(ready_events)
            if page_ids.is_cuda:  # the caller's events came before this index math (SGLang
                ready = torch.cuda.Event()  # records them first): the gather on the I/O stream
                ready.record()  # must not read page ids the current stream has yet to compute
                events.append(ready)
            job = _Offload([keys[i] for i in todo], page_ids, events)
        except BaseException:
            with self._lock:
                self._backlog -= len(todo)
            raise
        self._results.append(job)
        self.worker.put(job)
        return True

    def num_completed(self) -> int:
        n = 0
        for r in self._results:
            if not r.done:
                break
            n += 1
        return n

    def pop_completed(self) -> bool:
        return bool(self._results.popleft().ok)

    def clear_results(self) -> None:
        self._results.clear()

    def gather(self, dev, page_ids) -> None:
        """Every layer of pages `page_ids` into device staging `dev` (on the current stream)."""
        import tutti_kernels as tk
        tk.gather_pages(dev, self._k_bufs, self._v_bufs, page_ids, self._page_size,
                        self._obj_stride)

    # ------------------------------------------------------------ [offloader]
    def _run(self, job: _Offload) -> None:
        ok = True
        t0 = time.perf_counter()
        writes: deque = deque()  # the chunks' landing futures in flight, oldest first
        ready = None  # the next chunk's gather
        pending = None  # the whole offload's write: one tombstone batch, one header batch
        try:
            for ev in job.events:
                ev.synchronize()
            step = self._out_pages
            starts = list(range(0, len(job.keys), step))
            stage = lambda c0: self._stage.submit(self._gather_chunk, job.keys[c0:c0 + step],
                                                  job.page_ids[c0:c0 + step], job)
            ready = stage(starts[0])  # the first gather and D2H run under the reservations
            pending = self._store.begin_pages(job.keys)
            for i, c0 in enumerate(starts):
                addrs = ready.result()
                # chunk i + 1 is gathered into the slot chunk i + 1 - slots was written from:
                # that write must have ended (at most slots - 1 in flight, this one included)
                while len(writes) >= self._writes_in_flight:
                    writes.popleft().result()
                writes.append(self._writers.submit(self._land_chunk, pending, c0,
                                                   c0 + len(addrs), addrs))
                if i + 1 < len(starts):  # the next chunk's gather and D2H run under the writes
                    ready = stage(starts[i + 1])
            ready = None
            if self._host is not None and job.all_in_dram:
                # every page is off the device and readable from DRAM, held there until its
                # write publishes: SGLang may free the device pages now; the SSD writes go on
                job.finish(True)
            while writes:
                writes.popleft().result()
        except BaseException as e:
            logger.error("tutti linker: offload of %d pages failed: %s", len(job.keys), e)
            ok = False
        finally:
            for w in [*writes, ready]:  # the next job's gathers reuse these slots: wait for all
                if w is not None:
                    w.exception()
            try:  # what landed becomes visible (and what did not is given back), even on failure
                published = self._store.publish_pages([pending])[0] if pending is not None else None
                ok &= published is not None and bool(published.all())
            except BaseException as e:
                logger.error("tutti linker: publishing %d offloaded pages failed: %s",
                             len(job.keys), e)
                ok = False
            for slots in job.dirty:  # durable (or failed): DRAM may let these go now
                self._host.unpin(slots)
            with self._lock:
                self._backlog -= len(job.keys)
            if not job.done:  # else the DRAM tier completed it: its failure is in the counter
                job.finish(ok)
            self._stats.add(offloads=1, offload_pages=len(job.keys) if ok else 0,
                            offload_write_failures=0 if ok else 1,
                            offload_seconds=time.perf_counter() - t0)

    def _gather_chunk(self, keys: list, page_ids, job=None):
        """[stage thread] Gather the pages of `keys` into the next out slot (GPU: kernel + D2H
        copy, waited for), and into DRAM slots where the DRAM tier takes them; returns their host
        addresses [n, objects]. The slot's last write has returned: _run keeps at most slots - 1
        writes in flight and stages one chunk ahead."""
        import tutti_kernels as tk
        n = len(keys)
        m, stride = self._objs_per_page, self._obj_stride
        k = self._out.take()
        host = self._out.host[k][: n * m * stride]
        if self._io is not None:
            with torch.cuda.stream(self._io.stream):
                dev = self._out.device[: n * m * stride]
                self.gather(dev, page_ids)
                host.copy_(dev, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            ev.synchronize()
        else:
            tk.gather_pages_ref(host, self._k_bufs, self._v_bufs, page_ids, self._page_size, stride)
        if self._host is not None and job is not None:
            self._keep(keys, host.view(n, m * stride), job)
        return strided(self._out.bufs[k].address, n * m, stride).reshape(n, m)

    def _keep(self, keys: list, pages: torch.Tensor, job: _Offload) -> None:
        """Copy offloaded pages (staged [n, page bytes], the DRAM tier's slot layout) into DRAM
        slots, on probation: readable from DRAM at once, and held there (pinned) until their
        SSD write has published, so a page is never in neither tier."""
        slots = self._host.reserve(keys, hot=False)
        if not (slots >= 0).all():
            # no slot (DRAM full of pinned pages), or already there but not held by this job (it
            # may be evicted before the write lands): complete after the write, never in between
            job.all_in_dram = False
        idx = np.flatnonzero(slots >= 0)
        if not len(idx):
            return
        ok = False
        try:
            self._host.copy_in(slots[idx], pages, idx)
            ok = True
        finally:
            self._host.publish([keys[i] for i in idx], slots[idx], ok, keep_pinned=True)
            if ok:
                job.dirty.append(slots[idx])
            else:
                job.all_in_dram = False

    def _land_chunk(self, pending, start: int, stop: int, addrs) -> None:
        """[write thread] Payloads of the offload's keys [start, stop) into their reserved slots
        (store.land_pages); the headers of every chunk go out together once all have landed
        (_run). The store's scheduler keeps these writes off directories a load is reading."""
        exact = self._obj_stride == int(self._store.layout.object_nbytes[0])  # 4 KiB multiples
        self._store.land_pages(pending, start, stop, addrs, exact)

    def close(self) -> None:
        """Stop the offload thread (queued jobs finish first) and the staging thread."""
        self.worker.stop()
        self._stage.shutdown(wait=True)
        self._writers.shutdown(wait=True)

