"""The linker's DRAM tier: pinned host memory in front of the SSD store, one slot per page.

At a glance (threads: [scheduler] SGLang's, [loader], [offloader]; every method takes the lock):
    host = HostTier(nbytes, num_layers, k_objs, obj_stride, device, cuda)
    host.online                             set once the memory is pinned (a thread at attach:
                                            GBs take seconds); until then it takes nothing
    host.present(keys) -> bool array        resident and readable (no side effect)
    host.pin(keys) -> slots (-1: not here)  [scheduler] pages held until unpin (never evicted)
    host.hit(slots, count=True)             [scheduler] pinned pages a load takes: each moves
                                            from probation to protected and counts
                                            (host_hit_pages); a load pins at load(), hits at
                                            start(), so a cancelled or refused load is none
    host.served(n)                          [scheduler] n hits counted apart (a load that copies
                                            some of its DRAM pages in the device pool: hit(slots,
                                            count=False), then served(pages it reads from DRAM))
    host.unpin(slots)                       [loader] the load's last layer was handed over
    host.reserve(keys, hot) -> slots        room for pages about to be written in (-1: no room
                                            or already here); evicts clean, unpinned pages
    host.publish(keys, slots, ok, keep_pinned=False)   the bytes landed (ok) or not: readable
                                            (an offload's pages stay pinned until written), or
                                            given back
    host.wants(keys) -> bool array          [loader] pages a load reads from the SSD and worth
                                            copying up (seen before: the ghost list); the load
                                            reserves their slots and copies each layer in from
                                            its staging ring as it lands (copy_layer_in)
    host.forget(keys), host.clear()
    host.layer(layer) -> [slots, per_layer] uint8 view (torch, CPU)   the layer's objects of
                                            every slot
    host.rows(layer), host.device_rows(layer)   the arena from the layer's first object on, on
                                            the CPU and in device address space (a mapped view
                                            of the pinned memory, or None where there is none):
                                            tutti_kernels.scatter_rows' source, rows page_nbytes
                                            apart
    host.copy_in(slots, pages, rows), host.copy_layer_in(slots, layer, src, rows)   bytes into
                                            reserved slots: an offload's whole pages, a load's
                                            layer of its promoted pages (C++ memcpy)
    host.stats() -> dict

Layout: slot s holds a page as the layer-wise path stages it, layer by layer, each of a layer's
k_objs objects (K, V; MLA one) at obj_stride bytes: the bytes a load scatters for layer l are
one [k_objs * obj_stride] run per slot, the same run an offload gathers (canonical object order).

Policy (2Q; scan-resistant): a page enters on probation (a FIFO) when it is offloaded; a DRAM
hit moves it to protected (an LRU). A page read from the SSD whose key is on the ghost list
(evicted from probation, or read from the SSD once before) is copied up into protected by the
load that reads it, from the bytes it read (never a second SSD read); a page read once is only
remembered there. Free slots are taken first (a working set that fits stays
whole); then eviction takes probation's oldest unpinned page, and protected's least recently
used only when probation has none. An offload (a page on probation) takes a protected page only
while probation holds under a quarter of the slots: an offload pins its pages until its SSD
write publishes, so a long one finds probation all pinned, and without that bound one long
prompt's offload emptied protected. A scan of new pages cycles through probation and costs the
hot pages at most a quarter of the tier. Nothing here is
durable: every page also lives (or is being written) on the SSD, eviction frees DRAM only, and
the tier starts empty after a restart.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from ..engine import extension

logger = logging.getLogger("tutti_hicache.linker")


def machine_bytes() -> int:
    """Physical memory of this machine (bytes), 0 where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_bytes(cuda: bool) -> int:
    """tutti_host_gb -1: an eighth of the machine's memory where there is a GPU, shared by the
    GPUs' server processes (one per GPU: each takes its share), else none."""
    if not cuda:
        return 0
    return machine_bytes() // (8 * max(1, torch.cuda.device_count()))


class _Mapped:
    """A device-addressable view of pinned host memory for torch (__cuda_array_interface__):
    kernels read and write the host bytes over the bus, no copy in between."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


class HostTier:
    def __init__(self, nbytes: int, num_layers: int, k_objs: int, obj_stride: int,
                 device: torch.device, cuda: bool):
        self.num_layers, self.k_objs, self.obj_stride = num_layers, k_objs, obj_stride
        self.per_layer = k_objs * obj_stride
        self.page_nbytes = num_layers * self.per_layer
        self.slots = int(nbytes // self.page_nbytes)
        if self.slots < 1:
            raise ValueError(f"tutti_host_gb: {nbytes / 2**30:g} GiB holds no page of "
                             f"{self.page_nbytes} bytes")
        self.nbytes = self.slots * self.page_nbytes
        self.cuda = cuda
        self.copy_threads = max(1, min(4, (os.cpu_count() or 1) // 4))  # copy_in's memcpy threads
        self._buf = extension().AlignedBuffer(self.nbytes)  # mapped lazily: no memory used yet
        self.arena = torch.frombuffer(self._buf, dtype=torch.uint8).view(self.slots, self.page_nbytes)
        self._device_arena = None
        self._registered = False
        self.online = threading.Event()
        self._lock = threading.Lock()
        self._on_online: list = []  # when_online's callables, run as the tier comes online
        self._slot_of: dict[str, int] = {}
        self._key_of: list[Optional[str]] = [None] * self.slots
        self._ready = np.zeros(self.slots, dtype=bool)  # bytes landed: readable
        self._pins = np.zeros(self.slots, dtype=np.int32)
        self._free = list(range(self.slots - 1, -1, -1))
        self._probation: OrderedDict = OrderedDict()  # key -> None, oldest first
        self._protected: OrderedDict = OrderedDict()  # key -> None, least recently used first
        self._ghost: OrderedDict = OrderedDict()      # keys seen once, oldest first
        self._counts = {"host_hit_pages": 0, "host_inserted_pages": 0, "host_promoted_pages": 0,
                        "host_evicted_pages": 0, "host_full_pages": 0}
        # pinning GBs takes seconds: on a thread, while the server starts; until it ends, the
        # tier takes and serves nothing (online)
        if cuda:
            self._pinning = threading.Thread(target=self._pin_memory, args=(device,), daemon=True,
                                             name="tutti-host-pin")
            self._pinning.start()
        else:
            self.online.set()

    def _pin_memory(self, device) -> None:
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self._buf.address, self.nbytes, 2)  # mapped
            try:
                code = int(rc)
            except (TypeError, ValueError):
                code = int(getattr(rc, "value", 0))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister returned {rc}")
            self._registered = True
        except Exception as e:  # noqa: BLE001 - a tier that cannot pin stays off
            logger.warning("tutti: the DRAM tier could not pin %.1f GiB (%s); it stays off",
                           self.nbytes / 2**30, e)
            return
        try:
            view = torch.as_tensor(_Mapped(self._buf.address, self.nbytes),
                                   device=device).view(self.slots, self.page_nbytes)
            # the loads' own gather must read what the CPU wrote: checked once, on the last slot
            self.arena[-1] = torch.arange(self.page_nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
            words = view.view(torch.int64).view(self.slots, self.page_nbytes // 8)
            row = torch.index_select(words, 0, torch.tensor([self.slots - 1], device=view.device))
            if not torch.equal(row.cpu().view(torch.uint8).view(-1), self.arena[-1]):
                raise RuntimeError("a kernel read other bytes than the CPU wrote")
            self._device_arena = view
            self._measure(words)
        except Exception as e:  # noqa: BLE001 - loads then copy through host staging
            logger.warning("tutti: the DRAM tier is not device-addressable here (%s); its pages "
                           "reach the GPU through a host copy", e)
        self._go_online()

    def _go_online(self) -> None:
        """Run when_online's callables, then take pages: until online nothing is reserved, so
        no load reads the tier while they run (the loader compiles its kernel in one)."""
        while True:
            with self._lock:
                hooks, self._on_online = self._on_online, []
                if not hooks:
                    self.online.set()
                    return
            for fn in hooks:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a warm-up only
                    logger.warning("tutti: the DRAM tier's warm-up failed (%s); the first load "
                                   "from DRAM pays it", e)

    def when_online(self, fn) -> None:
        """Call fn() once the tier is online: now if it is, else on the pinning thread (the
        loader loads the tier's kernel there, so the first DRAM load compiles nothing)."""
        with self._lock:
            if not self.online.is_set():
                self._on_online.append(fn)
                return
        fn()

    def _measure(self, words) -> None:
        """The gather's rate over the bus beside a plain H2D copy of the same bytes (~64 MiB,
        once at attach): in the log and the stats (host_gather_GBps, host_copy_GBps)."""
        try:
            n = max(1, min(self.slots, (64 << 20) // self.page_nbytes))
            idx = torch.arange(n, device=words.device)
            out = torch.empty((n, words.shape[1]), dtype=torch.int64, device=words.device)
            rates = []
            for op in (lambda: torch.index_select(words, 0, idx, out=out),
                       lambda: out.view(torch.uint8).view(-1).copy_(self.arena[:n].view(-1), non_blocking=True)):
                op()  # warm
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                op()
                b.record()
                b.synchronize()
                rates.append(n * self.page_nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
            del out
            self._counts["host_gather_GBps"], self._counts["host_copy_GBps"] = rates
            logger.info("tutti: DRAM tier online: %.1f GiB pinned; its gather reads %.1f GB/s over "
                        "the bus (a plain H2D copy: %.1f GB/s)", self.nbytes / 2**30, *rates)
        except Exception as e:  # noqa: BLE001 - a measurement only
            logger.debug("tutti: measuring the DRAM tier's gather failed: %s", e)

    # ------------------------------------------------------------------ lookups
    def present(self, keys: list) -> np.ndarray:
        if not self.online.is_set():
            return np.zeros(len(keys), dtype=bool)
        with self._lock:
            return np.array([(s := self._slot_of.get(k)) is not None and bool(self._ready[s])
                             for k in keys], dtype=bool)

    def pin(self, keys: list) -> np.ndarray:
        """Slots of the resident keys, pinned (-1 where not here); not yet hits (hit())."""
        out = np.full(len(keys), -1, dtype=np.int64)
        if not self.online.is_set():
            return out
        with self._lock:
            for i, k in enumerate(keys):
                s = self._slot_of.get(k)
                if s is None or not self._ready[s]:
                    continue
                out[i] = s
                self._pins[s] += 1
        return out

    def hit(self, slots, count: bool = True) -> None:
        """Pinned pages (slots of pin(), -1 skipped) a load takes: touched (2Q), and counted as
        hits unless count is False (served() counts them then)."""
        slots = np.asarray(slots, dtype=np.int64)
        slots = slots[slots >= 0]
        with self._lock:
            for s in slots.tolist():
                k = self._key_of[s]
                if k is not None:  # pinned: still this key's
                    self._touch(k)
            if count:
                self._counts["host_hit_pages"] += len(slots)

    def served(self, n: int) -> None:
        """n pages a load reads from DRAM: hits (the pages it copies in the device pool from a
        page another request brought are not)."""
        with self._lock:
            self._counts["host_hit_pages"] += int(n)

    def unpin(self, slots) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        slots = slots[slots >= 0]
        with self._lock:
            np.subtract.at(self._pins, slots, 1)

    def _touch(self, key: str) -> None:
        if key in self._probation:
            del self._probation[key]
            self._protected[key] = None
        elif key in self._protected:
            self._protected.move_to_end(key)

    # ------------------------------------------------------------------ inserts
    def wants(self, keys: list) -> np.ndarray:
        """Of pages just read from the SSD: those to copy up (their key on the ghost list); the
        others are put there, so a second read copies them up."""
        out = np.zeros(len(keys), dtype=bool)
        with self._lock:
            for i, k in enumerate(keys):
                if k in self._slot_of:
                    continue
                if k in self._ghost:
                    del self._ghost[k]
                    out[i] = True
                else:
                    self._remember(k)
        return out

    def _remember(self, key: str) -> None:
        self._ghost[key] = None
        self._ghost.move_to_end(key)
        while len(self._ghost) > self.slots:
            self._ghost.popitem(last=False)

    def reserve(self, keys: list, hot: bool) -> np.ndarray:
        """A slot per key to write its page into (pinned until publish), -1 where the key is
        already here or no slot can be freed; hot: into protected (a promotion), else probation
        (an offload)."""
        out = np.full(len(keys), -1, dtype=np.int64)
        if not self.online.is_set():
            return out
        cursors: dict = {}
        with self._lock:
            for i, k in enumerate(keys):
                if k in self._slot_of:
                    continue
                s = self._take_slot(hot, cursors)
                if s is None:  # the pages left without a slot (not those already here)
                    self._counts["host_full_pages"] += sum(k2 not in self._slot_of for k2 in keys[i:])
                    break
                out[i] = s
                self._slot_of[k], self._key_of[s] = s, k
                self._ready[s] = False
                self._pins[s] += 1
                (self._protected if hot else self._probation)[k] = None
        return out

    def publish(self, keys: list, slots, ok, keep_pinned: bool = False) -> None:
        """The pages of reserve() landed (ok) or not; the slots are unpinned, or with
        keep_pinned (an offload's pages, until their SSD write publishes) stay pinned when ok:
        the caller unpins them."""
        slots = np.asarray(slots, dtype=np.int64)
        ok = np.broadcast_to(np.asarray(ok, dtype=bool), slots.shape)
        with self._lock:
            for k, s, good in zip(keys, slots.tolist(), ok.tolist()):
                if s < 0 or self._key_of[s] != k:
                    continue
                if good:
                    self._ready[s] = True
                    if not keep_pinned:
                        self._pins[s] -= 1
                else:
                    self._pins[s] -= 1
                    self._drop(k, s)
            n = int(((slots >= 0) & ok).sum())
            self._counts["host_inserted_pages"] += n

    def promoted(self, n: int) -> None:
        with self._lock:
            self._counts["host_promoted_pages"] += n

    def _take_slot(self, hot: bool, cursors: dict) -> Optional[int]:
        """A free slot, else the slot of the oldest unpinned page of probation (then protected).
        cursors: where this reserve() call's walk of each queue stopped. An unpinned oldest page
        needs no walk; past a pinned one the queue is walked once per call, not once per key
        (the pages passed stay pinned while the lock is held): an offload pins its probation
        pages until its SSD write publishes, and a copy-up of 2048 pages past 4096 pinned ones
        held the lock SGLang's scheduler takes for every lookup for 0.8 s."""
        if self._free:
            return self._free.pop()
        queues = [(self._probation, True)]
        if hot or len(self._probation) < self.slots // 4:
            queues.append((self._protected, False))
        for queue, ghost in queues:
            walk = cursors.get(id(queue))
            if walk is None:
                head = next(iter(queue), None)
                if head is not None and self._pins[self._slot_of[head]] == 0:
                    return self._evict(head, ghost)
                walk = cursors[id(queue)] = iter(list(queue))
            for k in walk:
                s = self._slot_of.get(k)
                if s is None or k not in queue:  # dropped or moved since the walk began
                    continue
                if self._pins[s] == 0:
                    return self._evict(k, ghost)
        return None

    def _evict(self, key: str, ghost: bool) -> int:
        """Drop an unpinned page (remembered on the ghost list when it leaves probation) and
        take its slot."""
        self._drop(key, self._slot_of[key])
        self._counts["host_evicted_pages"] += 1
        if ghost:
            self._remember(key)
        return self._free.pop()

    def _drop(self, key: str, slot: int) -> None:
        del self._slot_of[key]
        self._key_of[slot] = None
        self._ready[slot] = False
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self._free.append(slot)

    def forget(self, keys: list) -> int:
        """Drop these keys' pages (unpinned ones); returns how many went."""
        n = 0
        with self._lock:
            for k in keys:
                s = self._slot_of.get(k)
                if s is not None and self._pins[s] == 0:
                    self._drop(k, s)
                    n += 1
        return n

    def clear(self) -> int:
        with self._lock:
            keys = [k for k in self._slot_of if self._pins[self._slot_of[k]] == 0]
        return self.forget(keys)

    # ------------------------------------------------------------------ bytes
    def layer(self, layer: int) -> torch.Tensor:
        """[slots, k_objs * obj_stride]: layer `layer` of every slot (a strided CPU view)."""
        return self.arena.view(self.slots, self.num_layers, self.per_layer)[:, layer]

    def copy_in(self, slots, pages: torch.Tensor, rows) -> None:
        """Row rows[i] of `pages` (contiguous CPU [n, page_nbytes]) into slot slots[i]: C++
        memcpy on `copy_threads` threads, the GIL released (a torch index assignment copies
        uint8 rows at ~1 GB/s, which held each offload's completion for seconds)."""
        if pages.device.type != "cpu" or not pages.is_contiguous() or pages.dim() != 2 \
                or pages.shape[1] != self.page_nbytes or pages.dtype != torch.uint8:
            raise ValueError(f"copy_in takes contiguous CPU uint8 [n, {self.page_nbytes}] pages, "
                             f"got {pages.dtype} {tuple(pages.shape)} on {pages.device}")
        rows = np.asarray(rows, dtype=np.uint64)
        if len(rows) and int(rows.max()) >= pages.shape[0]:
            raise ValueError("copy_in: a row out of range")
        self._copy_rows("copy_in", slots, 0, pages.data_ptr(), rows, self.page_nbytes)

    def copy_layer_in(self, slots, layer: int, src: int, rows) -> None:
        """Layer `layer` of slots[i] from the [*, per_layer] rows at address `src` (row rows[i]):
        a load's staging ring slot as its pages land (a promotion: no second read of the SSD).
        C++ memcpy on `copy_threads` threads, the GIL released."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"copy_layer_in: layer {layer} of {self.num_layers}")
        self._copy_rows("copy_layer_in", slots, layer * self.per_layer, src, rows, self.per_layer)

    def _copy_rows(self, where: str, slots, offset: int, src: int, rows, nbytes: int) -> None:
        """nbytes from src + rows[i] * nbytes to `offset` bytes into slot slots[i], for each i."""
        slots = np.asarray(slots, dtype=np.uint64)
        rows = np.asarray(rows, dtype=np.uint64)
        if len(slots) != len(rows):
            raise ValueError(f"{where}: {len(slots)} slots for {len(rows)} rows")
        if not len(slots):
            return
        if int(slots.max()) >= self.slots:
            raise ValueError(f"{where}: a slot out of range")
        extension().memcpy_batch(self._slot_base(slots) + np.uint64(offset),
                                 np.uint64(src) + rows * np.uint64(nbytes),
                                 np.full(len(slots), nbytes, dtype=np.int64), self.copy_threads)

    def rows(self, layer: int) -> torch.Tensor:
        """The arena's bytes from layer `layer` of slot 0 on: slot s's objects of that layer
        start `s * page_nbytes` bytes in (tutti_kernels.scatter_rows' source)."""
        return self.arena.view(-1)[layer * self.per_layer:]

    def device_rows(self, layer: int) -> Optional[torch.Tensor]:
        """rows(layer) in the device's address space (pinned, mapped): a kernel reads it over
        the bus. None where the tier is not device-addressable."""
        if self._device_arena is None:
            return None
        return self._device_arena.view(-1)[layer * self.per_layer:]

    def _slot_base(self, slots) -> np.ndarray:
        """uint64 address of each slot's first byte."""
        return np.uint64(self._buf.address) + np.asarray(slots, dtype=np.uint64) * np.uint64(self.page_nbytes)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out.update(host_slots=self.slots, host_resident_pages=int(self._ready.sum()),
                       host_bytes=self.nbytes, host_probation_pages=len(self._probation),
                       host_protected_pages=len(self._protected))
        return out

    def close(self) -> None:
        if self.cuda:
            self._pinning.join()
        self.online.clear()
        self._device_arena = None
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._buf.address)
            self._registered = False
