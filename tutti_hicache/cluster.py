"""The cluster tier of the tiered backend: SGLang's own MooncakeStore, pinned to this node, behind
a health gate that turns an unreachable or dead Mooncake into "local only" instead of errors.

At a glance:
    mooncake_missing() -> str | None         why the Mooncake client cannot be used here (None: it can)
    ClusterTier(storage_config, host_pool, retry_s)
        .store() -> MooncakeStore | None     the store while the tier is up, else None
        .failed(exc)                         an operation saw an outage: local only, one warning
        .wait_up(timeout) -> bool            for tests and tools
        .state, .stats(), .close()

Why SGLang's MooncakeStore and not our own client code: its key naming (model prefix, ``_k``/``_v``
objects, TP and PP suffixes, MLA's rank-replicated keys), its buffer registration of the host pool
and its batch zero-copy calls are what SGLang's own ``mooncake`` backend writes, so the layouts it
supports and refuses are SGLang's. Two things change (PinnedMooncakeStore):
  * every put carries ``preferred_segment`` = this client's own segment. Without it Mooncake places
    objects on any mounted segment, often the reader's, and a page then dies with whichever
    process happened to hold it; pinned, a page lives exactly as long as its writer (a client's
    objects vanish when it exits, which is why the tiered backend promotes what it reads);
  * an outage code (RPC_FAIL, RPC_TIMEOUT) raises ClusterDown instead of reading as a miss, so the
    gate can stop calling a dead master: each call then costs up to seconds (a put waited 4.3 s);
  * a get that delivers fewer bytes than the page's object is a miss (SGLang accepts any count > 0).

Failure handling: the Mooncake client is made by a background thread, never on SGLang's threads,
and only after a TCP connect to the master succeeds (``setup`` against an absent master blocks
~90 s). After an outage the same client is kept: it re-mounts its segment by itself once a master
answers again; the thread probes it (a small put, exists, remove in its own segment) every
``retry_s`` and reopens the gate when the probe passes. One warning per outage, an info line at
recovery.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional

import torch

logger = logging.getLogger("tutti_hicache.cluster")

# Mooncake ErrorCode values that mean "the master cannot be reached", not "this page is missing".
OUTAGE_CODES = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT
_PROBE_BYTES = 4096


class ClusterDown(RuntimeError):
    """A Mooncake call reported an outage code."""


def mooncake_missing() -> Optional[str]:
    """None when the Mooncake client and SGLang's MooncakeStore import, else the reason."""
    try:
        import mooncake.store  # noqa: F401
        from sglang.srt.mem_cache.storage.mooncake_store import mooncake_store  # noqa: F401
    except Exception as exc:  # ImportError, or a missing shared library (OSError)
        return f"{type(exc).__name__}: {exc}"
    return None


def _checked(results: Sequence[int], what: str) -> Sequence[int]:
    bad = [r for r in results if r in OUTAGE_CODES]
    if bad:
        raise ClusterDown(f"Mooncake {what}: error {bad[0]} on {len(bad)} of {len(results)} keys")
    return results


def pinned_store_class():
    """SGLang's MooncakeStore, with puts pinned to this client's segment and outages raised."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    class PinnedMooncakeStore(MooncakeStore):
        def _put_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes, group_ids=None,
                                      session_ids=None):
            config = self._replicate_config_cls()
            config.preferred_segment = self.store.get_hostname()
            if group_ids is not None and self._can_use_group_semantics():
                config.group_ids = group_ids
            if session_ids is not None and self._supports_session_ids:
                config.session_ids = session_ids
            if self._uses_multi_buffer(buffer_ptrs):
                out = self.store.batch_put_from_multi_buffers(key_strs, buffer_ptrs, buffer_sizes,
                                                              config)
            else:
                out = self.store.batch_put_from(key_strs, buffer_ptrs, buffer_sizes, config)
            return _checked(out, "put")

        def _get_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes):
            got = _checked(super()._get_batch_zero_copy_impl(key_strs, buffer_ptrs,
                                                             buffer_sizes), "get")
            # SGLang counts any positive byte count as a hit; a short object is a miss here
            want = [sum(s) if isinstance(s, Sequence) else s for s in buffer_sizes]
            return [r if r <= 0 or r == w else -1 for r, w in zip(got, want)]

        def _batch_exist(self, key_strs):
            return _checked(super()._batch_exist(key_strs), "exists")

    return PinnedMooncakeStore


def _master_address(storage_config) -> tuple[str, int] | None:
    """(host, port) of the master from SGLang's own config resolution (extra config, file, env)."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeBaseStore

    cfg = MooncakeBaseStore()._load_config(storage_config)
    addr = (cfg.master_server_address or "").strip()
    if not addr or ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _reachable(addr: tuple[str, int] | None, timeout: float = 1.0) -> bool:
    if addr is None:  # no master address (a standalone client): let setup decide
        return True
    try:
        with socket.create_connection(addr, timeout=timeout):
            return True
    except OSError:
        return False


class ClusterTier:
    """The Mooncake side of one tiered backend (module docstring). `tag` isolates identities: it
    joins SGLang's key prefix (``extra_backend_tag``), so only identical layouts share keys."""

    def __init__(self, storage_config, host_pool, tag: str, retry_s: float):
        extra = dict(storage_config.extra_config or {})
        user_tag = extra.get("extra_backend_tag")
        extra["extra_backend_tag"] = f"{user_tag}_{tag}" if user_tag is not None else tag
        self._sc = dataclasses.replace(storage_config, extra_config=extra)
        self._pool = host_pool
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._store: Any = None
        self._up = False
        self._closed = False
        self._off = False  # the pool cannot be served: no retry
        self._warned_outage = False  # under _lock: one warning per outage
        self._warned_connect = False
        self._wake = threading.Event()
        self._counts = {"outages": 0, "recoveries": 0, "connect_attempts": 0}
        self._address = None
        self._thread = threading.Thread(target=self._run, name="tutti-cluster", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ gate
    @property
    def state(self) -> str:
        if self._off:
            return "off"
        if self._closed:
            return "closed"
        if self._up:
            return "up"
        return "connecting" if self._store is None else "down"

    def store(self):
        """The MooncakeStore while the tier is up; None: serve locally."""
        return self._store if self._up else None

    def failed(self, exc: BaseException) -> None:
        """An operation failed with an outage (or raised): close the gate until a probe passes."""
        with self._lock:
            was_up, self._up = self._up, False
            first = was_up and not self._warned_outage
            if was_up:
                self._counts["outages"] += 1
                self._warned_outage = True
        if first:
            logger.warning("tutti: cluster tier (Mooncake) failed (%s); serving the local SSD "
                           "tier only, retrying every %.1f s", exc, self._retry_s)
        else:
            logger.debug("tutti: cluster tier call failed while down: %s", exc)
        self._wake.set()

    def wait_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._up and time.monotonic() < deadline and not self._closed:
            time.sleep(0.05)
        return self._up

    def stats(self) -> dict:
        with self._lock:
            return {**self._counts, "cluster_state": self.state}

    def close(self) -> None:
        self._closed = True
        self._up = False
        self._wake.set()
        self._thread.join(timeout=5)
        store, self._store = self._store, None
        if store is not None:
            try:
                store.store.close()  # MooncakeStore.close() leaves it to the destructor
            except Exception:
                logger.exception("tutti: closing the Mooncake client failed")

    # ------------------------------------------------------- background thread
    def _run(self) -> None:
        try:
            self._address = _master_address(self._sc)
        except Exception as exc:
            self._off = True
            logger.warning("tutti: cluster tier off: no usable Mooncake config (%s)", exc)
            return
        while not self._closed:
            if not self._up:
                try:
                    self._connect() if self._store is None else self._probe()
                except Exception as exc:
                    self._not_yet(exc)
            self._wake.wait(self._retry_s)
            self._wake.clear()

    def _not_yet(self, exc: BaseException) -> None:
        if self._store is None and not self._warned_connect:
            self._warned_connect = True
            logger.warning("tutti: cluster tier (Mooncake master %s) not reachable (%s); serving "
                           "the local SSD tier only, retrying every %.1f s",
                           self._address, exc, self._retry_s)
        else:
            logger.debug("tutti: cluster tier still unavailable: %s", exc)

    def _connect(self) -> None:
        self._counts["connect_attempts"] += 1
        if not _reachable(self._address):
            raise ConnectionError(f"no listener at {self._address}")
        store = pinned_store_class()(self._sc, self._pool)
        try:
            store.register_mem_pool_host(self._pool)
        except Exception:
            store.store.close()  # no half-attached client left behind; the next try makes one
            raise
        try:  # what MooncakeStore refuses (e.g. MHA layer_first) is a setting, not an outage
            store._batch_preprocess([""], torch.arange(self._pool.page_size, dtype=torch.int64))
        except Exception as exc:
            self._off = self._closed = True
            logger.warning("tutti: cluster tier off: SGLang's MooncakeStore does not serve this "
                           "host pool (layout %s: %s); use page_first or page_first_direct",
                           self._pool.layout, exc)
            store.store.close()
            return
        self._store = store
        with self._lock:
            self._up = True
        logger.info("tutti: cluster tier up: Mooncake segment %s, key prefix %s",
                    store.store.get_hostname(), store.config_prefix)

    def _probe(self) -> None:
        """A put, exists and remove of one small object in this client's own segment."""
        if not _reachable(self._address):
            raise ConnectionError(f"no listener at {self._address}")
        client = self._store.store
        key = f"tutti-probe-{uuid.uuid4().hex}"
        config = self._store._replicate_config_cls()
        config.preferred_segment = client.get_hostname()
        rc = client.put(key, bytes(_PROBE_BYTES), config)
        if rc != 0:
            raise ClusterDown(f"probe put returned {rc}")
        if client.is_exist(key) != 1:
            raise ClusterDown("probe object not found after put")
        client.remove(key, True)  # force: a fresh object is still under its lease
        with self._lock:
            self._up = True
            self._warned_outage = False
            self._counts["recoveries"] += 1
        logger.info("tutti: cluster tier (Mooncake) reachable again; publishing and reading "
                    "remote pages resumed")
