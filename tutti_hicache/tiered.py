"""TieredStorage: tutti's local SSD tier first, SGLang's MooncakeStore as the shared cluster tier.

At a glance (SGLang calls; thread in brackets), beyond TuttiStorage (storage.py):
    register_mem_pool_host(pool)              [scheduler] opens tutti, then starts the cluster
                                              tier in the background (cluster.py)
    batch_exists(keys) -> int                 [prefetch] local flags first, Mooncake only for
                                              the pages not local: prefix length of the union
    batch_get_v1(keys, host_indices)          [io-aux] local pages by O_DIRECT, the others (and
                                              local read failures) by Mooncake batch_get_into into
                                              the registered host pool; remote hits copied out
                                              and promoted into tutti on a thread of their own
                                              (promote.py; tutti_cluster_promote, _promote_mb)
    batch_set_v1(keys, host_indices)          [backup] tutti first, then published to Mooncake
                                              in this node's own segment (tutti_cluster_publish)

Selected with ``--hicache-storage-backend tutti-mooncake`` through the plugin, or unpatched with
``--hicache-storage-backend dynamic`` and ``{"backend_name":"tutti-mooncake","module_path":
"tutti_hicache.tiered","class_name":"TieredStorage","interface_v1":1,...}``. The same extra config
carries the tutti_* settings and SGLang's Mooncake keys (master_server_address, protocol, ...);
docs/cluster.md lists them.

Keys: Mooncake object keys are SGLang's (model prefix, TP/PP suffixes) behind a tag made of the
tutti namespace fingerprint (model, weights revision, dtype, geometry, rank coordinates) and the
host pool layout, since Mooncake objects are raw host-layout bytes: only identical layouts match.

Failures: the cluster tier never raises into SGLang's threads. An outage, a hung master or a
failed transfer from a peer node closes its gate (one warning; the call that meets it waits about
tutti_cluster_timeout_s, twice for a get), the backend serves the local tier alone, and the gate
reopens when Mooncake answers again. A remote page counts only when every one of its objects arrived (SGLang's
own rule). ``clear()`` drops the local pages and this node's published objects, not other nodes'
(MooncakeStore.clear() would wipe every node's). The legacy flat-page API (batch_get/batch_set,
SGLang's generic path) is TuttiStorage's: local only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from typing import List, Optional

import numpy as np
import torch

from .cluster import ClusterTier, mooncake_missing
from .promote import Promoter
from .storage import TuttiStorage, leading

logger = logging.getLogger("tutti_hicache.tiered")

TAG_FORMAT = 1  # bump when the tag's inputs change


def cluster_tag(fingerprint: bytes, layout: str) -> str:
    """What the Mooncake keys of one identity start with (16 hex digits)."""
    text = f"{TAG_FORMAT}:{fingerprint.hex()}:{layout}"
    return "tutti" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _pages_of(host_indices: torch.Tensor, pages: np.ndarray, page_size: int) -> torch.Tensor:
    """The host slots of the selected pages (vectorized)."""
    sel = torch.from_numpy(pages.astype(np.int64))
    return host_indices.reshape(-1, page_size)[sel].reshape(-1)


class TieredStorage(TuttiStorage):
    def __init__(self, storage_config, kwargs=None):
        super().__init__(storage_config, kwargs)
        self.cluster: Optional[ClusterTier] = None
        self._ccounts = {"remote_hits": 0, "remote_misses": 0, "promoted": 0, "published": 0,
                         "promote_failed": 0, "promote_inline": 0}
        self._promoter: Optional[Promoter] = None

    # ------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host) -> None:
        if self._promoter is not None:  # its queued writes go to the store they were read for
            self._promoter.close()
            self._promoter = None
        super().register_mem_pool_host(mem_pool_host)
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.cfg.cluster_promote and self.cfg.cluster_promote_mb and self.store is not None \
                and self.store.writer and self.hostmap is not None:
            self._promoter = Promoter(self.store, self.cfg.cluster_promote_mb << 20,
                                      self.hostmap.object_nbytes, threads=self.cfg.threads,
                                      on_done=lambda ok, bad: self._count(promoted=ok,
                                                                          promote_failed=bad))
        missing = mooncake_missing()
        if missing is not None:
            self._warn_once("nomooncake", "tutti: the Mooncake client does not import (%s); "
                            "tutti-mooncake serves the local SSD tier only", missing)
            return
        tag = cluster_tag(self.store.fingerprint, str(mem_pool_host.layout))
        self.cluster = ClusterTier(self.storage_config, mem_pool_host, tag,
                                   self.cfg.cluster_retry_s, self.cfg.cluster_timeout_s)

    # ----------------------------------------------------------- queries
    @contextlib.contextmanager
    def _remote(self):
        """(the cluster tier, its client for this call or None): close() leaves the client open
        until the calls in it have returned."""
        cluster = self.cluster  # once: close() may set it to None
        if cluster is None:
            yield None, None
            return
        with cluster.call() as mc:
            yield cluster, mc

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        keys = list(keys)
        t0 = time.monotonic_ns()
        n = self._exists(keys)
        self._trace("exists", t0, len(keys), n)
        return n

    def _exists(self, keys: list) -> int:
        store = self.store
        if store is None:
            return 0
        try:
            local = store.present(keys)
        except Exception:
            logger.exception("tutti: batch_exists failed; reporting a miss")
            return 0
        rest = np.flatnonzero(~local)
        if not len(rest):
            return len(keys)
        with self._remote() as (cluster, mc):
            if mc is None:
                return int(rest[0])
            try:
                found = mc.batch_exists([keys[i] for i in rest])
            except Exception as exc:
                cluster.failed(exc)
                return int(rest[0])
        return int(rest[found]) if found < len(rest) else len(keys)

    # ------------------------------------------------------ zero-copy I/O
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        """The local tier's pages and, for the others, the cluster's; SGLang takes the answer up to
        its first False and drops the rest, so only pages before the first one found nowhere are
        read from the SSD, counted and promoted (the remote get is one call for all the others:
        it runs first, its pages past that point are reported False; local pages whose read
        failed are asked of the cluster in a second call)."""
        keys = list(keys)
        t0 = time.monotonic_ns()
        ok = self._get(keys, host_indices)
        self._trace("get", t0, len(keys), int(ok.sum()))
        return ok.tolist()

    def _get(self, keys: list, host_indices: torch.Tensor) -> np.ndarray:
        store, hm = self.store, self.hostmap
        ok = np.zeros(len(keys), dtype=bool)
        if store is None or hm is None:
            self._warn_once("noattach", "tutti: storage called before register_mem_pool_host")
            return ok
        try:
            addrs = hm.page_addresses(host_indices, len(keys))
            local = store.present(keys)
        except Exception:
            logger.exception("tutti: batch get of %d pages failed; reported as a miss", len(keys))
            return ok
        remote, fetched = self._remote_get(keys, host_indices, ~local, hm.page_size)
        cut = leading(local | remote)
        try:
            t0 = time.perf_counter()
            mine = np.flatnonzero(local[:cut])
            if len(mine):
                ok[mine] = store.read_pages([keys[i] for i in mine], addrs[mine], hm.aligned)
            seconds = time.perf_counter() - t0
        except Exception:
            logger.exception("tutti: batch get of %d pages failed; reported as a miss", len(keys))
            return np.zeros(len(keys), dtype=bool)
        read = mine[ok[mine]]  # the pages read from the local tier
        failed = mine[~ok[mine]]
        if len(failed):  # a local read that failed (damage, an I/O error): the cluster's copy
            want = np.zeros(len(keys), dtype=bool)
            want[failed] = True
            again, more = self._remote_get(keys, host_indices, want, hm.page_size)
            remote |= again
            if more is not None:
                fetched = more if fetched is None else \
                    (np.concatenate([fetched[0], more[0]]), fetched[1] + more[1])
        ok[:cut] |= remote[:cut]
        cut = leading(ok)
        ok[cut:] = False
        self._record("get", int((read < cut).sum()), seconds)  # what SGLang keeps of them
        if fetched is not None:
            self._remote_done(keys, addrs, fetched, remote, cut)
        if self.cfg.cluster_publish == "hit":
            hits = read[read < cut]
            if len(hits):
                self._publish(keys, host_indices, hits)
        self._dump_stats()
        return ok

    def _remote_get(self, keys, host_indices, wanted: np.ndarray, page: int):
        """The `wanted` pages from Mooncake: (per key whether it arrived, (the keys asked,
        seconds) or None when nothing was asked)."""
        remote = np.zeros(len(keys), dtype=bool)
        rest = np.flatnonzero(wanted)
        if not len(rest):
            return remote, None
        with self._remote() as (cluster, mc):
            if mc is None:
                return remote, None
            try:
                t0 = time.perf_counter()
                got = np.array(mc.batch_get_v1([keys[i] for i in rest],
                                               _pages_of(host_indices, rest, page)), dtype=bool)
            except Exception as exc:
                cluster.failed(exc)
                return remote, None
        remote[rest] = got
        return remote, (rest, time.perf_counter() - t0)

    def _remote_done(self, keys, addrs, fetched, remote: np.ndarray, cut: int) -> None:
        """Count the remote get's pages SGLang takes (before cut), and promote those."""
        rest, seconds = fetched
        used = rest[(rest < cut) & remote[rest]]
        self._record("get", len(used), seconds)
        self._count(remote_hits=len(used), remote_misses=int((~remote[rest]).sum()))
        if len(used) and self.cfg.cluster_promote and self.store is not None and self.store.writer:
            self._promote([keys[i] for i in used], addrs[used])

    def _promote(self, keys: list, addrs: np.ndarray) -> None:
        """Remote hits into the local SSD tier: copied out of the host pool and written on the
        promotion thread (promote.py), or here when tutti_cluster_promote_mb is 0."""
        try:
            if self._promoter is not None:
                queued = self._promoter.submit(keys, addrs)
                if queued.all():
                    return
                self._count(promote_inline=int((~queued).sum()))  # the ring is full
                keys, addrs = [k for k, q in zip(keys, queued) if not q], addrs[~queued]
            stored = self.store.write_pages(keys, addrs, self.hostmap.aligned)
            self._count(promoted=int(stored.sum()), promote_failed=int((~stored).sum()))
        except Exception:
            logger.exception("tutti: promoting %d remote pages failed", len(keys))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        keys = list(keys)
        ok = np.array(super().batch_set_v1(keys, host_indices, extra_info), dtype=bool)
        if self.cfg.cluster_publish == "all" and self.store is not None and self.store.writer:
            try:
                self.hostmap.page_addresses(host_indices, len(keys))  # the same validation
            except Exception:
                return ok.tolist()
            ok |= self._publish(keys, host_indices, np.arange(len(keys)))
        return ok.tolist()

    def _publish(self, keys, host_indices, pages: np.ndarray) -> np.ndarray:
        """Put the selected pages into this node's Mooncake segment; per key whether it is there."""
        out = np.zeros(len(keys), dtype=bool)
        with self._remote() as (cluster, mc):
            if mc is None:
                return out
            try:
                put = np.array(mc.batch_set_v1([keys[i] for i in pages],
                                               _pages_of(host_indices, pages, self.hostmap.page_size)),
                               dtype=bool)
            except Exception as exc:
                cluster.failed(exc)
                return out
        out[pages] = put
        self._count(published=int(put.sum()))
        return out

    def _count(self, **counts: int) -> None:
        with self._metrics_lock:  # io-aux and backup threads both count
            for name, n in counts.items():
                self._ccounts[name] += n

    # ------------------------------------------------------- maintenance
    def clear(self) -> None:
        """This node's pages: the local ones, and the Mooncake objects it published (removed by
        the cluster thread, now or once the master answers; this node reads none of them
        meanwhile, so none is promoted back). Promotions queued before it land first, so none
        reappears after the clear. Other nodes' objects stay: MooncakeStore.clear() would remove
        every node's."""
        cluster = self.cluster
        if cluster is not None:
            cluster.retire_published()
        self.drain_promotions()
        super().clear()

    def drain_promotions(self) -> None:
        """Wait until every queued promotion is written (tests, benchmarks, shutdown)."""
        if self._promoter is not None:
            self._promoter.drain()

    def close(self) -> None:
        promoter, self._promoter = self._promoter, None
        if promoter is not None:
            promoter.close()  # the queued promotions are written first
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()
        super().close()

    def tutti_stats(self) -> dict:
        """TuttiStorage's counters plus the cluster tier's (hits, promotions, outages, state)."""
        out = dict(super().tutti_stats())
        with self._metrics_lock:
            out.update(self._ccounts)
        cluster = self.cluster
        out.update(cluster.stats() if cluster is not None else {"cluster_state": "off"})
        return out


__all__ = ["TieredStorage", "cluster_tag"]
