"""TuttiStorage: SGLang's HiCacheStorage (L3 below the host pool) on the tutti object store.

At a glance (SGLang calls; thread in brackets):
    TuttiStorage(storage_config, kwargs)            [scheduler] validates tutti_* settings
    register_mem_pool_host(pool)                    [scheduler] maps + registers the host pool,
                                                    opens the store (index rebuilt from disk),
                                                    warns once when SGLang's settings will cut
                                                    its hits (prefetch.py)
    batch_exists(keys) -> int                       [prefetch] leading run present, memory only
    batch_get_v1(keys, host_indices) -> [bool]      [io-aux] one engine batch, zero copy
    batch_set_v1(keys, host_indices) -> [bool]      [backup] dedupe, then one engine batch per phase
                                                    (backup metrics: the pages written only)
    get/batch_get/set/batch_set/exists              legacy flat-page API (SGLang's generic path)
    clear() / close() / get_stats()                 [scheduler] get_stats also exports the SSD
                                                    wear counters to Prometheus (wearmetrics.py)
With tutti_timeline_file set, each exists/get/set call appends one JSON line (_trace).

Selected unpatched with ``--hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name":"tutti","module_path":
"tutti_hicache.storage","class_name":"TuttiStorage","interface_v1":1,"tutti_dirs":[...]}'``,
or as ``--hicache-storage-backend tutti`` through the plugin or the patch set.
I/O failures never raise into SGLang's threads: they become False (a miss) and a log line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .config import TuttiConfig
from .store.namespace import check_dirs
from .hostmap import HostMap
from . import hashwarm
from .prefetch import published_weights, server_args, warn_cuts
from .identity import identity_for, is_writer
from .statsfile import StatsFile, TimelineFile
from .store import ObjectStore
from .wearmetrics import WearMetrics

logger = logging.getLogger("tutti_hicache.storage")


def _storage_metrics_cls():
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:  # older SGLang
        from sglang.srt.metrics.collector import StorageMetrics  # type: ignore
    return StorageMetrics


def is_storage_writer(sc: HiCacheStorageConfig) -> bool:
    """SGLang's own property where it has one (0.5.23; 0.5.17 predates it), else the same rule."""
    prop = getattr(type(sc), "is_storage_writer", None)
    if prop is not None:
        return bool(sc.is_storage_writer)
    return is_writer("mla" if sc.is_mla_model else "mha", sc.tp_rank)


def identity_of(cfg: TuttiConfig, sc: HiCacheStorageConfig, hm: HostMap) -> dict:
    """The namespace identity of a host pool under SGLang's storage config (a byte pool's KV
    dtype from the server's --kv-cache-dtype: identity.kv_dtype)."""
    found = server_args()
    kv = getattr(found[1], "kv_cache_dtype", None) if found else None
    if str(hm.pool.dtype).endswith("uint8") and not kv:
        raise ValueError("tutti: the host pool holds its KV as bytes (fp8 or fp4) and this "
                         "process has published no server args to say which (--kv-cache-dtype): "
                         "fp8_e4m3 and fp8_e5m2 bytes are other numbers, so no store is attached")
    model, weights = published_weights()
    return identity_for(cfg, hm.pool, hm.geometry, model=model or sc.model_name or "",
                        pp=(sc.pp_rank, sc.pp_size), cp=(sc.attn_cp_rank, sc.attn_cp_size),
                        tp=(sc.tp_rank, sc.tp_size), kv_cache_dtype=kv, weights=weights)


class TuttiStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Any] = None):
        self.storage_config = storage_config
        self.cfg = TuttiConfig.from_sources(storage_config.extra_config or {})
        check_dirs(self.cfg)
        self.store: Optional[ObjectStore] = None
        self.hostmap: Optional[HostMap] = None
        self._metrics_lock = threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}
        self._warned: set[str] = set()  # under _metrics_lock
        self._stats_file = StatsFile(self.cfg.stats_file)
        self._timeline = TimelineFile(self.cfg.timeline_file)  # tutti_timeline_file ("": off)
        self._wear_metrics = WearMetrics()

    # ------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:  # its session's counters end here, the new store's start at 0
            self._export_wear(self.store, force=True)
            old, self.store, self.hostmap = self.store, None, None  # a failed attach below leaves
            old.close()  # no store (misses), not the closed one (its pages counted, none readable)
            self._wear_metrics = WearMetrics(self._wear_metrics.min_interval_s)
        hm = HostMap.from_pool(mem_pool_host)
        ident = identity_of(self.cfg, self.storage_config, hm)
        writer = is_storage_writer(self.storage_config)
        self.store = ObjectStore(self.cfg, hm.geometry, ident, writer=writer)
        self.hostmap = hm
        registered = self.store.register_memory(hm.regions)
        logger.info("tutti: attached %s pool (%s, %d layers, page %d) to %s: %d pages on disk, "
                    "%s engine, %d buffer(s) registered%s", hm.geometry.kind,
                    mem_pool_host.layout, hm.geometry.num_layers, hm.geometry.page_size,
                    list(self.cfg.dirs), len(self.store), self.store.engine.name, registered,
                    "" if writer else ", read-only rank")
        warn_cuts(mem_pool_host)
        hashwarm.start()  # SGLang's page-hash module, built now rather than in the first request
        if not hm.aligned:
            logger.warning("tutti: host pool objects are not 4 KiB-aligned (small KV objects, "
                           "fp8 or tiny pages): using the aligned bounce path (one copy)")

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(getattr(host_pool_name, "value", host_pool_name)) != "kv":
            self._warn_once(f"pool:{host_pool_name}",
                            "tutti: sidecar host pool %r (draft/SWA/Mamba/indexer) is not stored; "
                            "models that need it will see no L3 hits", host_pool_name)

    # ----------------------------------------------------------- queries
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        store = self.store  # once: close() on the scheduler thread may set it to None
        t0 = time.monotonic_ns()
        try:
            n = store.prefix_len(list(keys)) if store is not None else 0
        except Exception:
            logger.exception("tutti: batch_exists failed; reporting a miss")
            n = 0
        self._trace("exists", t0, len(keys), n)
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------ zero-copy I/O
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        return self._io("get", keys, lambda: self.hostmap.page_addresses(host_indices, len(keys)),
                        self.hostmap.aligned if self.hostmap else False)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        return self._io("set", keys, lambda: self.hostmap.page_addresses(host_indices, len(keys)),
                        self.hostmap.aligned if self.hostmap else False)

    def _io(self, op: str, keys, addresses, aligned: bool) -> List[bool]:
        keys = list(keys)
        store = self.store  # once: close() on the scheduler thread may set it to None
        if store is None:
            self._warn_once("noattach", "tutti: storage called before register_mem_pool_host")
            return [False] * len(keys)
        t0 = time.monotonic_ns()
        try:
            addrs = addresses()
            if op == "get":  # SGLang takes the leading run of hits and drops the rest unused:
                lead = store.prefix_len(keys)  # only those are read (and counted)
                ok = np.zeros(len(keys), dtype=bool)
                if lead:
                    ok[:lead] = store.read_pages(keys[:lead], addrs[:lead], aligned)
                moved = leading(ok)
            else:
                ok, moved = _write(store, keys, addrs, aligned)
            done = int(ok.sum())
            self._record(op, moved, (time.monotonic_ns() - t0) / 1e9)
            self._trace(op, t0, len(keys), done)
            self._dump_stats()
            return ok.tolist()
        except Exception:
            logger.exception("tutti: batch %s of %d pages failed; reported as a miss", op, len(keys))
            self._trace(op, t0, len(keys), 0)
            return [False] * len(keys)

    # ----------------------------------------------------- legacy flat API
    def _flat_ok(self, tensors) -> bool:
        nbytes = self.hostmap.geometry.page_nbytes
        return all(t is not None and t.is_contiguous() and t.device.type == "cpu"
                   and t.numel() * t.element_size() == nbytes for t in tensors)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        keys = list(keys)
        try:
            targets = list(target_locations or [])
            if self.hostmap is None or len(targets) != len(keys) or not self._flat_ok(targets):
                self._warn_once("flat-get", "tutti: batch_get with unusable target pages; miss")
                return [None] * len(keys)
            aligned = _aligned_tensors(targets, self.hostmap)
        except Exception:
            logger.exception("tutti: batch_get arguments rejected; reported as a miss")
            return [None] * len(keys)
        self._warn_once("generic", "tutti: SGLang uses the generic (copying) page path; select "
                        "the zero-copy one with \"interface_v1\": 1 (dynamic) or the plugin/patch")
        ok = self._io("get", keys, lambda: self.hostmap.flat_addresses(targets), aligned)
        return [t if good else None for t, good in zip(targets, ok)]

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keys = list(keys)
        try:
            values = [v.contiguous() if v is not None else None for v in (values or [])]
            if self.hostmap is None or len(values) != len(keys) or not self._flat_ok(values):
                self._warn_once("flat-set", "tutti: batch_set with unusable pages; not stored")
                return False
            aligned = _aligned_tensors(values, self.hostmap)
        except Exception:
            logger.exception("tutti: batch_set arguments rejected; not stored")
            return False
        ok = self._io("set", keys, lambda: self.hostmap.flat_addresses(values), aligned)
        return all(ok)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------- maintenance
    def clear(self) -> None:
        """Drop every page of this rank's identity: index and on-disk headers (tombstoned)."""
        if self.store is not None:
            try:
                n = self.store.clear()
                logger.info("tutti: cleared %d pages", n)
            except Exception:
                logger.exception("tutti: clear failed")

    def close(self) -> None:
        if self.store is not None:
            self._stats_file.close(self.store.stats)  # no file: nothing gathered
            store, self.store = self.store, None
            try:
                store.close()
            except Exception:
                logger.exception("tutti: close failed")

    def _dump_stats(self) -> None:
        """tutti_stats_file: counters as JSON, at most once a second (never raises)."""
        store = self.store  # once: close() on the scheduler thread may set it to None
        if store is not None:  # gathered as the file is written, so only where there is one
            self._stats_file.dump(store.stats)

    def get_stats(self):
        with self._metrics_lock:
            m = _storage_metrics_cls()()
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        store = self.store  # once: close() on the scheduler thread may set it to None
        if store is not None:
            self._export_wear(store)
        return m

    def _export_wear(self, store: ObjectStore, force: bool = False) -> None:
        """The store's wear counters into SGLang's Prometheus metrics (never raises)."""
        try:
            self._wear_metrics.update(store.wear(), force=force)
        except Exception:
            self._warn_once("wear-metrics", "tutti: exporting the wear counters failed",
                            exc_info=True)

    def tutti_stats(self) -> dict:
        """Richer counters: bytes, hits, misses, checksum failures, evictions, engine calls."""
        return self.store.stats() if self.store is not None else {}

    def _record(self, op: str, pages: int, seconds: float) -> None:
        """SGLang's prefetch/backup metrics: the pages a call read or wrote (a backup's pages the
        store already held are not written: not counted) and their bytes over its time."""
        if not pages:
            return
        gbps = pages * self.hostmap.geometry.page_nbytes / max(seconds, 1e-9) / 1e9
        prefix = "prefetch" if op == "get" else "backup"
        with self._metrics_lock:
            self._metrics[f"{prefix}_pgs"].append(pages)
            self._metrics[f"{prefix}_bandwidth"].append(gbps)
            for v in self._metrics.values():
                del v[:-4096]  # bounded when nobody polls (metrics disabled)

    def _trace(self, op: str, t0_ns: int, keys: int, found: int) -> None:
        """tutti_timeline_file: one line per call SGLang made (exists, get, set): its
        CLOCK_MONOTONIC entry and return, the keys asked and the leading hits (exists) or pages
        done, and SGLang's thread, to see where a host-tier restore's time goes."""
        if self._timeline.path:
            self._timeline.write({"host_op": op, "t0_ns": t0_ns, "t1_ns": time.monotonic_ns(),
                                  "keys": keys, "found": found,
                                  "thread": threading.current_thread().name})

    def _warn_once(self, tag: str, msg: str, *args, exc_info: bool = False) -> None:
        with self._metrics_lock:
            first = tag not in self._warned
            self._warned.add(tag)
        if first:
            logger.warning(msg, *args, exc_info=exc_info)


def leading(flags: np.ndarray) -> int:
    """The length of the leading run of True (what SGLang takes of a get's answer)."""
    return int(np.argmin(flags)) if not flags.all() else len(flags)


def _write(store: ObjectStore, keys: list, addrs, aligned: bool):
    """store.write_pages in its steps, to tell the pages it wrote from those it already held
    (deduplicated: True, not written). Returns (ok per key, pages written)."""
    pending = store.begin_pages(keys)
    if pending is None:  # a read-only rank stores nothing
        return np.zeros(len(keys), dtype=bool), 0
    try:
        store.land_pages(pending, 0, len(keys), addrs, aligned)
    finally:  # what landed is published, the rest of the reservations given back
        ok = store.publish_pages([pending])[0]
    return ok, int(ok[pending.todo].sum())


def _aligned_tensors(tensors, hm: HostMap) -> bool:
    offs = hm.flat_object_offsets()
    base = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    return bool(hm.aligned and (base % 4096 == 0).all() and (offs % 4096 == 0).all())
