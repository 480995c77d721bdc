"""The load pipeline of the layer-wise path: queued pages -> the device pool, layer by layer.

At a glance ([scheduler] = SGLang's scheduler thread; [loader] = this module's thread):
    loader = Loader(store, counter, stage, stage_pages, k_bufs, v_bufs, page_size, io, cfg,
                    windows, stats, observer, host=None, copy_recent=True)
    loader.load(rid, keys, device_indices) -> bool     [scheduler] pin and queue; no I/O (its
                                                       DRAM pages are hits once it starts)
    loader.cancel(rid) -> bool, loader.cancel_all()    [scheduler] unpin queued pages
    loader.start(input_tokens) -> index                [scheduler] hand every queued page over:
        [loader] one store read stream over every (layer, staging chunk) of the batch, each
        chunk into the next pinned ring slot, `read_ahead` chunks at the devices at once (the
        next layer's requests wait there behind this one's), per-layer checksums verified
        as pages land, one H2D copy and one scatter kernel on the I/O stream, one CUDA event
        -> counter.complete(index, layer); any failure -> counter.fail(index) (never a hang);
        with the DRAM tier: each layer's DRAM pages by one scatter_rows launch, and the SSD pages
        the tier wants copied up from the ring slots as they land ([tutti-copyup] thread);
        a page the batch or the one before already brings into the pool is copied, not read
    loader.finished(index, ok)                         [scheduler] the batch's pages, once
                                                       landed: the next batch's copy sources
    loader.read_ahead, loader.windows_opened, loader.read_Bps, loader.worker (drain, stop, thread)
The observer (observe.py) hears when the loader took a batch, when its read stream was open and
when every chunk's reads were final; the counter tells it of each layer handed over.

The stream holds the batch's directories for reads (the scheduler's lease) from its first read
to its last layer, except for write windows (windows.py: learned online from the forward, or a
slack table) lent to writes while the reads run two layers ahead of the forward.
A page is read from the SSD, or copied from the DRAM tier, once per batch: two requests of one
batch that restore the same page (concurrent requests on one document) take it once, and the
later ones' slots get a device-to-device copy of it on the I/O stream once it landed. A page
that the previous batch restored is copied from the slot it went to, when no other forward ran in
between (counter.launches; copy_recent, which the linker turns off where a forward can bypass
set_consumer: speculative decoding's verify, pipeline stages, HiSparse, embedding forwards,
split prefills). SGLang keeps a restored request's slots private until its forward ends and
only then inserts them into its tree, so a request that arrives during that forward matches
nothing on the device and would read the whole document from the SSD again. Those copies are
enqueued at start() on the scheduler's current stream, which SGLang orders after the last
forward's reads and before the next forward and every later write: until then nothing but the
batch that restored them wrote those slots (its forward writes its new tokens elsewhere), so
they still hold the page even if their request has since released them.
Thread-safety: _queued, _started and _recent belong to the scheduler thread; the staging ring to
the loader thread; the load queue is a Queue.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..config import TuttiConfig
from ..layout import runs
from .counter import LayerCounter
from .hosttier import HostTier
from .observe import Observer
from .staging import Staging
from .stats import LinkerStats
from .worker import Worker

logger = logging.getLogger("tutti_hicache.linker")


class LoadFailed(RuntimeError):
    pass


class _Job:
    """One started batch: its SSD pages (pinned entries, their pool page ids) and its DRAM pages
    (pinned slots, their pool page ids)."""

    def __init__(self, entries, page_ids, slots, ssd_keys, input_tokens):
        self.entries, self.page_ids, self.ssd_keys = entries, page_ids, ssd_keys
        self.dup_pages = None  # (source pages, destination pages): pages read once for two requests
        self.copied = 0  # pages copied in the pool instead of read
        self.host_slots = np.zeros(0, dtype=np.int64)
        self.host_page_ids = None
        self.host_keys: list = []
        self.host_slots_dev = None
        self.input_tokens = input_tokens
        self.index = -1
        self.ready = None


class _Taken(NamedTuple):
    """How one batch takes a list of pages (loader._dedup): which positions it reads (`read`, a
    mask), the copies once the layer landed and those from the last batch's slots ((source pool
    pages, destination pool pages) or None), and the pool page ids of the positions read."""
    read: np.ndarray
    dup_pages: Optional[tuple]
    own_pages: Optional[tuple]
    read_ids: torch.Tensor


class _CopyUp:
    """One load's copy-up into the DRAM tier: a reserved slot per SSD entry (-1: none) and the
    host copies in flight, one per staging chunk."""

    def __init__(self, slots: np.ndarray):
        self.slots = slots
        self.pending: list = []


class Loader:
    def __init__(self, store, counter: LayerCounter, stage: Staging, stage_pages: int,
                 k_bufs: list, v_bufs, page_size: int, io, cfg: TuttiConfig, windows,
                 stats: LinkerStats, observer: Observer, host: Optional[HostTier] = None,
                 copy_recent: bool = True, ranks: int = 1):
        self._store, self._counter, self._stage = store, counter, stage
        self._host = host  # the DRAM tier (hosttier.py), or None
        self.stage_pages = stage_pages  # pages of one layer per ring slot
        self._k_bufs, self._v_bufs, self._page_size = k_bufs, v_bufs, page_size
        self._k_objs = 1 if v_bufs is None else 2
        self._num_layers = len(k_bufs)
        self._obj_stride = store.layer_object_stride()
        self._io = io  # green.IOStream on a CUDA device; None on CPU (plain copies)
        self._cuda = io is not None
        self._windows = windows
        self._rates: deque = deque(maxlen=16)  # bytes/s of recent loads
        self._stats = stats
        self._page_nbytes = self._num_layers * self._k_objs * self._obj_stride  # staged, per page
        self.read_ahead = max(1, min(cfg.read_ahead, cfg.stage_depth - 1))
        self.windows_opened = 0
        self._observer = observer
        self._queued: dict[str, tuple] = {}
        self._lost: set = set()  # queued requests whose pages left the store before load()
        self._ranks = ranks  # the ranks whose loads SGLang keeps in step (its TP cache group)
        # the pages of each started batch (keys, pool page ids), until finished() and then, for
        # the next batch only, of the last one that landed: (key -> position, page ids, launches)
        self._started: dict[int, tuple] = {}
        self._recent: Optional[tuple] = None
        self._copy_recent = copy_recent  # False: only one batch's own duplicates are copied
        self._can_copy = all(t.is_contiguous() for t in (k_bufs + list(v_bufs or [])))
        self._copier: Optional[ThreadPoolExecutor] = None  # copy-ups into the DRAM tier
        self.worker = Worker("tutti-load", self._run)  # drain(): every started load finished

    # ------------------------------------------------------------ [scheduler]
    def load(self, rid: str, keys: list, device_indices) -> bool:
        keys = list(keys)
        if not keys or device_indices is None or len(device_indices) != len(keys) * self._page_size:
            return False
        if rid in self._queued:
            raise ValueError(f"tutti linker: request {rid} is already queued")
        # each page from where it is fastest: DRAM where resident, else the SSD
        # DRAM pages pinned (never evicted until the load ran or was cancelled), but a hit only
        # once the batch starts (start()): a cancelled or refused load neither counts nor promotes
        slots = (self._host.pin(keys) if self._host is not None
                 else np.full(len(keys), -1, np.int64))
        ssd_keys = [k for k, s in zip(keys, slots.tolist()) if s < 0]
        entries = self._store.pin(ssd_keys) if ssd_keys else []
        if any(e is None for e in entries):
            # evicted since lookup() (this rank's offloads, its DRAM tier, another writer). Alone,
            # False: SGLang recomputes. With other ranks, which agreed on the hit and must all
            # take one branch (False here alone would part their batches): queued, and the
            # batch fails in start(), which finish() reports on every rank (SGLang aborts it)
            self._unpin(entries, slots)
            if self._ranks == 1:
                return False
            logger.warning("tutti linker: %d of the %d pages of request %s left the store after "
                           "its lookup; its batch's load fails", sum(e is None for e in entries),
                           len(keys), rid)
            self._lost.add(rid)
            entries, slots, ssd_keys = [], np.zeros(0, np.int64), []
        self._queued[rid] = (entries, slots, device_indices, ssd_keys, keys)
        return True

    def from_dram(self, rid: str) -> bool:
        """Whether the queued load of `rid` takes every page from the DRAM tier."""
        item = self._queued.get(rid)
        return item is not None and bool(len(item[1])) and bool((item[1] >= 0).all())

    def cancel(self, rid: str) -> bool:
        item = self._queued.pop(rid, None)
        self._lost.discard(rid)
        if item is None:
            return False
        self._unpin(item[0], item[1])
        return True

    def _unpin(self, entries: list, slots) -> None:
        """Give back a queued load's pins: its store entries and its DRAM slots."""
        self._store.unpin(entries)
        if self._host is not None:
            self._host.unpin(slots)

    def cancel_all(self) -> None:
        for rid in list(self._queued):
            self.cancel(rid)
        self._started.clear()
        self._recent = None

    def finished(self, index: int, ok: bool) -> None:
        """Batch `index` ended (finish()); if every layer landed and its forward was the last one
        begun, its pages are the next batch's copy sources."""
        done = self._started.pop(index, None)
        for i in [i for i in self._started if i < index]:  # never finished: not sources either
            del self._started[i]
        self._recent = None
        if ok and done is not None and self._counter.consumer_index == index:
            keys, page_ids = done
            self._recent = (dict(zip(keys, range(len(keys)))), page_ids, self._counter.launches)

    def start(self, input_tokens: int = 0) -> int:
        """Start every queued load; input_tokens (new tokens of the batch, 0 = unknown) picks the
        slack-table row for write windows (unknown: the smallest, most conservative one)."""
        if not self._queued:
            return -1
        items = list(self._queued.values())
        lost = [rid for rid in self._queued if rid in self._lost]
        self._queued.clear()
        self._lost.clear()
        if lost:  # the whole batch fails: SGLang gets False from finish() on every rank
            for es, sl, *_ in items:
                self._unpin(es, sl)
            index = self._counter.update_producer()
            self._counter.describe(index, input_tokens, sum(len(ks) for *_, ks in items) * self._page_size)
            self._counter.fail(index, LoadFailed(f"pages of {', '.join(lost)} left the store after lookup"))
            self._stats.add(load_failures=1)
            self._recent = None
            return index
        recent, self._recent = self._recent, None
        if recent is not None and recent[2] != self._counter.launches:
            recent = None  # a forward ran since: those slots may hold other bytes now
        try:
            job, page_ids = self._job(items, input_tokens)
        except BaseException:  # the batch's pins go with it (an exception SGLang gets anyway)
            for es, sl, *_ in items:
                self._unpin(es, sl)
            raise
        if len(job.host_slots):  # the batch runs: its DRAM pages are touched (2Q: protected)
            self._host.hit(job.host_slots, count=False)  # before the copies' plan unpins some
        if self._can_copy and (job.entries or len(job.host_slots)):
            try:
                self._plan_copies(job, recent)
            except Exception:  # e.g. no device memory for a copy: never into SGLang's scheduler
                logger.warning("tutti linker: copying pages in the pool failed; reading them "
                               "from the store instead", exc_info=True)
        if len(job.host_slots):  # hits: the pages read from DRAM, not those copied in the pool
            self._host.served(len(job.host_slots))
        index = job.index = self._counter.update_producer()
        if self._copy_recent:  # its pages: the next batch's copy sources once it landed
            self._started[index] = ([k for *_, ks in items for k in ks], page_ids)
        self._counter.describe(index, input_tokens, len(page_ids) * self._page_size)
        if self._cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        self.worker.put(job)
        return index

    def _job(self, items: list, input_tokens: int) -> tuple:
        """(the load of a batch's queued requests, their page ids in the pool): the job's page
        ids split by where each page comes from (the SSD, DRAM)."""
        entries = [e for es, *_ in items for e in es]
        ps = self._page_size
        pids = [di[::ps] // ps for _, _, di, _, _ in items]
        slots = np.concatenate([sl for _, sl, _, _, _ in items])
        page_ids = torch.cat(pids)
        job = _Job(entries, page_ids, slots, [k for *_, ks, _ in items for k in ks], input_tokens)
        if (slots >= 0).any():  # some pages come from DRAM: split the batch's page ids
            dev = page_ids.device
            job.page_ids = page_ids[self._index(np.flatnonzero(slots < 0), dev)]
            job.host_page_ids = page_ids[self._index(np.flatnonzero(slots >= 0), dev)]
            job.host_slots = slots[slots >= 0]
            job.host_keys = [k for *_, sl, _, _, ks in items
                             for k, s in zip(ks, sl.tolist()) if s >= 0]
        return job, page_ids

    def _plan_copies(self, job, recent: Optional[tuple]) -> None:
        """Of the batch's SSD pages and, apart, of its DRAM pages, take each key once: a page the
        last batch brought into the pool (`recent`) is copied from its slot now, on the current
        stream; a key a request earlier in this batch takes too is copied from that request's
        slot once the layer landed (job.dup_pages); the rest is read. Pages not taken are
        unpinned."""
        device = job.page_ids.device
        ssd = self._dedup(job.ssd_keys, job.page_ids, recent, device) if job.entries else None
        host = None
        if len(job.host_slots):
            host = self._dedup(job.host_keys, job.host_page_ids, recent, device)
        if ssd is None and host is None:
            return
        dups = [p.dup_pages for p in (ssd, host) if p is not None and p.dup_pages is not None]
        dup_pages = tuple(torch.cat([d[i] for d in dups]) for i in (0, 1)) if dups else None
        # the last device work (a failure until here changes no job): one copy of the SSD and
        # the DRAM pages together, every source read before any destination is written, since a
        # slot the SSD pages' copy writes may be a slot the DRAM pages' copy reads
        owns = [p.own_pages for p in (ssd, host) if p is not None and p.own_pages is not None]
        if owns:
            self._copy_own(*(torch.cat([o[i] for o in owns]) for i in (0, 1)))
        job.dup_pages = dup_pages
        if ssd is not None:
            self._store.unpin([e for e, r in zip(job.entries, ssd.read) if not r])
            job.copied += int((~ssd.read).sum())
            job.page_ids = ssd.read_ids
            job.entries = [e for e, r in zip(job.entries, ssd.read) if r]
            job.ssd_keys = [k for k, r in zip(job.ssd_keys, ssd.read) if r]
        if host is not None:
            self._host.unpin(job.host_slots[~host.read])
            job.copied += int((~host.read).sum())
            job.host_page_ids = host.read_ids
            job.host_slots = job.host_slots[host.read]
            job.host_keys = [k for k, r in zip(job.host_keys, host.read) if r]

    def _dedup(self, keys: list, page_ids, recent: Optional[tuple], device) -> Optional[_Taken]:
        """How the batch takes pages `keys`, going to pool pages `page_ids`: each key once, the
        rest copied (_Taken); None when every page is read."""
        n = len(keys)
        first_of = dict(zip(reversed(keys), range(n - 1, -1, -1)))  # each key's first position
        first = np.fromiter((first_of[k] for k in keys), dtype=np.int64, count=n)
        src = np.full(n, -1, dtype=np.int64)
        if recent is not None:
            where = recent[0]
            src = np.fromiter((where.get(k, -1) for k in keys), dtype=np.int64, count=n)
        own = src >= 0
        dup = ~own & (first != np.arange(n))
        if not own.any() and not dup.any():
            return None
        dup_pages = own_pages = None
        if dup.any():
            at = np.flatnonzero(dup)
            dup_pages = (page_ids[self._index(first[at], device)], page_ids[self._index(at, device)])
        if own.any():
            at = np.flatnonzero(own)
            own_pages = (recent[1][self._index(src[at], device)], page_ids[self._index(at, device)])
        read = ~own & ~dup
        return _Taken(read, dup_pages, own_pages, page_ids[self._index(np.flatnonzero(read), device)])

    @staticmethod
    def _index(positions: np.ndarray, device):
        """Positions chosen on the CPU as an index tensor on `device`; on a GPU through pinned
        memory without a wait: a pageable copy would synchronize the scheduler's stream, which
        waits for the running forward (start() must not)."""
        t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
        if device.type != "cuda":
            return t
        return t.pin_memory().to(device, non_blocking=True)

    def _copy_own(self, src, dst) -> None:
        """Pool pages `src` (the last batch's slots) onto pages `dst` in every layer, on the current
        stream, every source read before any destination is written (copy_pages_ref): a slot SGLang
        released and handed out again in this pass can be both."""
        import tutti_kernels as tk
        for layer in range(self._num_layers):
            tk.copy_pages_ref(*self._bufs(layer), src, dst, self._page_size)

    def _copy_dups(self, job, layer: int) -> None:
        """Layer `layer` landed: the pages two requests of the batch share, into the later
        requests' slots (on the I/O stream; sources and destinations are this batch's own slots,
        disjoint, so on a GPU one pass copies them: copy_pages)."""
        if job.dup_pages is None:
            return
        src, dst = job.dup_pages
        if self._cuda and layer == 0:  # made on the scheduler's stream, read on this one
            src.record_stream(self._io.stream)
            dst.record_stream(self._io.stream)
        import tutti_kernels as tk
        with torch.cuda.stream(self._io.stream) if self._cuda else contextlib.nullcontext():
            (tk.copy_pages if self._cuda else tk.copy_pages_ref)(*self._bufs(layer), src, dst, self._page_size)

    # --------------------------------------------------------------- [loader]
    def _run(self, job) -> None:
        entries, index = job.entries, job.index
        n = len(entries) + len(job.host_slots)
        t0 = time.perf_counter()
        try:
            self._load(job)
            seconds = time.perf_counter() - t0  # the first read to the last layer handed over
            if entries and not len(job.host_slots):  # the medium's rate, for write windows
                self._rates.append(len(entries) * self._page_nbytes / max(seconds, 1e-9))
            self._stats.first_load(seconds)
            # after _load, job.entries / job.host_slots are the pages read (the rest copied)
            self._stats.add(loads=1, load_pages=n, load_bytes=n * self._page_nbytes,
                            load_seconds=seconds, load_host_pages=len(job.host_slots),
                            load_ssd_pages=len(job.entries), load_copied_pages=job.copied)
        except BaseException as e:  # the forward must never hang; finish() reports it
            logger.error("tutti linker: load of %d pages failed: %s", n, e)
            self._quiesce("tutti linker: waiting for a failed load's kernels failed")
            self._counter.fail(index, e)
            self._stats.add(load_failures=1)
        finally:
            self._store.unpin(entries)
            if self._host is not None and len(job.host_slots):
                self._unpin_host(job.host_slots)

    def _quiesce(self, what: str, *args) -> bool:
        """Wait until the kernels queued on the I/O stream have run (on a GPU; at once on the
        CPU). False, with `what` logged, when the device failed.
        A failed load waits so before finish() can return: finish() waits only for the layers
        that completed, and once it returns False SGLang frees the load's pool pages, so a
        scatter still pending would write this load's bytes into pages another request was given
        (and read staging slots the next load refills)."""
        if self._cuda:
            try:
                self._io.stream.synchronize()
            except BaseException:
                logger.exception(what, *args)
                return False
        return True

    def _unpin_host(self, slots) -> None:
        """Give a load's DRAM slots back once the kernels that read them have run: on a GPU they
        were only queued on the I/O stream, and a slot given back before then may be refilled
        with another page that the pending kernel would scatter into this load's pool pages. A
        failed device keeps them pinned rather than risk their bytes."""
        if self._quiesce("tutti linker: waiting for the DRAM copies failed; %d DRAM slots stay "
                         "pinned", len(slots)):
            self._host.unpin(slots)

    # ------------------------------------------------------------ [loader] the DRAM tier
    def _reserve_promotions(self, job) -> Optional[_CopyUp]:
        """DRAM slots for the pages this load reads from the SSD that the tier wants (read
        before), one per entry (-1: not copied up), or None: the load copies each such page's
        layers from the staging ring into its slot as they land (_promote_chunk), so a promotion
        costs a host copy and never a second read of the SSD."""
        if self._host is None or not job.ssd_keys:
            return None
        want = np.flatnonzero(self._host.wants(job.ssd_keys))
        if not len(want):
            return None
        out = np.full(len(job.ssd_keys), -1, dtype=np.int64)
        out[want] = self._host.reserve([job.ssd_keys[i] for i in want], hot=True)
        return _CopyUp(out) if (out >= 0).any() else None

    def _promote_chunk(self, up: _CopyUp, k: int, layer: int, rows: slice) -> None:
        """Ring slot k holds layer `layer` of the entries `rows` (verified): the promoted ones'
        bytes go into their DRAM slots on the copy-up thread (one C++ batch, the GIL released),
        while this thread goes on with the reads; the ring slot is read into again only after."""
        slots = up.slots[rows]
        idx = np.flatnonzero(slots >= 0)
        if len(idx):
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="tutti-copyup")
            f = self._copier.submit(self._host.copy_layer_in, slots[idx], layer,
                                    self._stage.host[k].data_ptr(), idx)
            up.pending.append(f)
            self._stage.hold(k, f)

    def _publish_promotions(self, job, up: Optional[_CopyUp], ok: bool) -> None:
        """Once its copies ended: every layer landed and copied (ok), the promoted pages are
        readable; else their slots go back (never while a copy still writes into them)."""
        if up is None:
            return
        futures.wait(up.pending)
        bad = [f.exception() for f in up.pending if f.exception() is not None]
        if bad and ok:
            logger.warning("tutti linker: copying pages up into DRAM failed (%s); they stay on "
                           "the SSD", bad[0])
        ok = ok and not bad
        idx = np.flatnonzero(up.slots >= 0)
        self._host.publish([job.ssd_keys[i] for i in idx], up.slots[idx], ok)
        if ok:
            self._host.promoted(len(idx))

    def close(self) -> None:
        """After the worker stopped: end the copy-up thread."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def _copy_host(self, job, layer: int) -> None:
        """Layer `layer` of the batch's DRAM pages into the device pool. On a GPU one kernel reads
        each page's objects straight from its slot of the pinned tier over the bus (mapped into
        the device's address space) and writes them into the pool: no staging, no host copy.
        Where the tier is not device-addressable: per staging slot's worth of pages, a host
        gather, a plain copy and the scatter."""
        slots = job.host_slots
        if not len(slots):
            return
        import tutti_kernels as tk
        rows = self._host.device_rows(layer) if self._cuda else self._host.rows(layer)
        if rows is not None:
            with torch.cuda.stream(self._io.stream) if self._cuda else contextlib.nullcontext():
                if job.host_slots_dev is None:  # once per batch, ordered before its copies
                    job.host_slots_dev = torch.from_numpy(slots).to(self._k_bufs[0].device)
                fn = tk.scatter_rows if self._cuda else tk.scatter_rows_ref
                fn(rows, job.host_slots_dev, self._host.page_nbytes, *self._bufs(layer),
                   job.host_page_ids, self._page_size, self._obj_stride)
            return
        step, per_layer = self.stage_pages, self._k_objs * self._obj_stride
        with torch.cuda.stream(self._io.stream):
            for c0 in range(0, len(slots), step):
                m = min(step, len(slots) - c0)
                dev = self._stage.device[: m * per_layer]
                dev.view(m, per_layer).copy_(
                    self._host.layer(layer).index_select(0, torch.from_numpy(slots[c0:c0 + m])))
                self._scatter(dev, layer, job.host_page_ids[c0:c0 + m])

    # ------------------------------------------------------------ [loader] one load
    def _load(self, job) -> None:
        """Every (layer, staging chunk) of the batch is one store stream, `read_ahead` chunks at
        the devices at once (chunk i + read_ahead - 1 is admitted, into its free ring slot,
        before chunk i is waited for), so the next layer's requests wait there behind this
        layer's and the queue never drains between layers; each chunk lands, is verified,
        copied and scattered in layer order; while the reads run two layers ahead of the
        forward, a write window may follow a layer."""
        index, entries, ready = job.index, job.entries, job.ready
        self._observer.load_begun(index, len(job.host_slots), job.copied)
        self._windows.learn()  # the forwards that ran since the last load
        if ready is not None:
            self._io.stream.wait_event(ready)
        if not entries:  # every page in DRAM: no read stream
            self._observer.stream_opened(index)
            for layer in range(self._num_layers):
                self._copy_host(job, layer)
                self._copy_dups(job, layer)
                if layer + 1 == self._num_layers:
                    self._observer.reads_final(index, 0, [], [])
                self._counter.complete(index, layer, self._mark())
            return
        promote = self._reserve_promotions(job)
        try:
            self._read_layers(job, promote)
        except BaseException:
            self._publish_promotions(job, promote, False)
            raise
        self._publish_promotions(job, promote, True)

    def _read_layers(self, job, promote: Optional[_CopyUp]) -> None:
        index, entries, input_tokens, page_ids = job.index, job.entries, job.input_tokens, job.page_ids
        plan = self._store.plan_pages(entries)
        n, step = len(entries), self.stage_pages
        chunks = [(layer, slice(c0, min(n, c0 + step))) for layer in range(self._num_layers)
                  for c0 in range(0, n, step)]
        slots = [(self._stage.next + i) % len(self._stage.bufs) for i in range(len(chunks))]
        # the stream holds the batch's directories for reads until it is closed (and then
        # nothing lands in the staging slots any more)
        with self._store.stream_layers(plan, chunks, self._destinations(chunks, slots)) as stream:
            self._observer.stream_opened(index)  # pages planned, directories held
            for i, (layer, rows) in enumerate(chunks):
                self._admit(stream, slots, min(len(chunks), i + self.read_ahead))
                ok, whole = stream.wait_whole(i)
                if not whole:
                    raise LoadFailed(f"layer {layer}: {int((~ok).sum())} of {len(ok)} pages "
                                     "unreadable or corrupt")
                self._copy_chunk(slots[i], layer, len(ok), page_ids[rows])
                if rows.stop == n:  # the layer's last chunk: hand the layer over
                    self._copy_host(job, layer)
                    self._copy_dups(job, layer)
                    if layer + 1 == self._num_layers:  # before finish() can return
                        self._observer.reads_final(index, n, [c[0] for c in chunks], stream.done_ns())
                    self._counter.complete(index, layer, self._mark())
                    self._lend_window(stream, layer, input_tokens, n * self._page_size)
                if promote is not None:
                    self._promote_chunk(promote, slots[i], layer, rows)

    def _admit(self, stream, slots: list, upto: int) -> None:
        """Admit chunks [0, upto) to the stream, each once its ring slot's last copy is done."""
        n = stream.admitted
        if n >= upto:
            return
        for k in slots[n:upto]:
            if self._stage.take() != k:  # waits for the slot's last copy
                raise RuntimeError("tutti linker: staging ring out of order")
        stream.allow(upto)

    def _lend_window(self, stream, layer: int, input_tokens: int, prefix: int) -> None:
        """After `layer` was handed over, while the reads run two layers ahead of the forward:
        a write window (windows.py), if the model predicts room for one."""
        if layer + 1 < self._num_layers and layer - self._counter.waited >= 2:
            window = self._windows.window(input_tokens, prefix, self.read_Bps)
            if window > 0:
                self.windows_opened += 1
                stream.lend(window)  # settles what was admitted, then a write window

    def _destinations(self, chunks: list, slots: list) -> list:
        """Each chunk's page addresses in its ring slot, as views of one array built in a few
        numpy operations (the loader's setup runs while SGLang's scheduler thread launches the
        forward; every numpy operation over more than a few hundred elements lets the GIL go,
        and getting it back costs up to a switch interval)."""
        sizes = np.array([rows.stop - rows.start for _, rows in chunks], dtype=np.int64)
        starts, within = runs(sizes)
        bases = np.array([self._stage.bufs[k].address for k in slots], dtype=np.uint64)
        per_page = np.uint64(self._k_objs * self._obj_stride)
        addrs = np.repeat(bases, sizes) + within.astype(np.uint64) * per_page
        bounds = starts.tolist()
        return [addrs[bounds[i]:bounds[i + 1]] for i in range(len(chunks))]

    @property
    def read_Bps(self) -> float:
        """The best of the recent loads' rates (a load held back by the forward reads slower than
        the medium); before any load, the slack table's read rate, else 0 (no windows)."""
        if self._rates:
            return max(self._rates)
        return self._windows.seed_read_Bps

    def _copy_chunk(self, k: int, layer: int, n: int, page_ids) -> None:
        """Ring slot k holds layer `layer` of n pages: to the device pool (H2D + scatter)."""
        host = self._stage.host[k][: n * self._k_objs * self._obj_stride]
        if not self._cuda:
            self._scatter(host, layer, page_ids)
            return
        with torch.cuda.stream(self._io.stream):
            dev = self._stage.device[: host.numel()]
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._stage.events[k] = ev  # the ring slot is free once this copy is done
            self._scatter(dev, layer, page_ids)

    def warm(self, dev) -> None:
        """Load the scatter kernel at attach: every layer of pool page 0, staged in device
        memory `dev` (gathered from page 0 just before), scattered back onto itself; and the
        in-pool copy's (copy_pages) with page id -1 only, which its mask skips."""
        import tutti_kernels as tk
        ids = torch.zeros(1, dtype=torch.int64, device=dev.device)
        none = torch.full((1,), -1, dtype=torch.int64, device=dev.device)
        per_layer = self._k_objs * self._obj_stride
        for layer in range(self._num_layers):
            self._scatter(dev[layer * per_layer:(layer + 1) * per_layer], layer, ids)
            if self._can_copy:
                tk.copy_pages(*self._bufs(layer), none, none, self._page_size)

    def warm_host(self) -> None:
        """Load the DRAM tier's kernel (scatter_rows) as the tier comes online, so the first
        load from DRAM compiles nothing: one launch per layer whose only page id is -1 (the
        kernel's mask skips it: no byte of the pool changes), on the I/O stream."""
        import tutti_kernels as tk
        if not self._cuda or self._host.device_rows(0) is None:
            return
        device = self._k_bufs[0].device
        rows = torch.zeros(1, dtype=torch.int64, device=device)
        none = torch.full((1,), -1, dtype=torch.int64, device=device)
        with torch.cuda.device(device), torch.cuda.stream(self._io.stream):  # a thread of its own
            for layer in range(self._num_layers):
                tk.scatter_rows(self._host.device_rows(layer), rows, self._host.page_nbytes,
                                *self._bufs(layer), none, self._page_size, self._obj_stride)
        self._io.stream.synchronize()

    def _bufs(self, layer: int) -> tuple:
        """(K buffer, V buffer) of a layer of the pool; MLA: (its one buffer, None)."""
        return self._k_bufs[layer], None if self._v_bufs is None else self._v_bufs[layer]

    def _scatter(self, staging, layer: int, page_ids) -> None:
        import tutti_kernels as tk
        args = (staging, *self._bufs(layer), page_ids, self._page_size, self._obj_stride)
        if not self._cuda:
            tk.scatter_layer_ref(*args)
        else:
            tk.scatter_layer(*args)

    def _mark(self):
        if not self._cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self._io.stream)
        return ev

