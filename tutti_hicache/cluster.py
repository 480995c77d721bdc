"""The cluster tier of the tiered backend: SGLang's own MooncakeStore, pinned to this node, behind
a health gate that turns an unreachable, hung or dead Mooncake into "local only" instead of errors.

At a glance:
    mooncake_missing() -> str | None         why the Mooncake client cannot be used here (None: it can)
    mooncake_timeouts(timeout_s) -> dict     the MC_* variables that bound a hung master or peer
    ClusterTier(storage_config, host_pool, tag, retry_s, timeout_s)
        with .call() as mc:                  the MooncakeStore for one call of SGLang's threads
                                             while the tier is up, else None; close() leaves
                                             the client to the last call still in it
        .failed(exc)                         an operation saw an outage: local only, one warning
        .retire_published() -> int          clear(): this client's objects go, never read again
        .wait_up(timeout), .wait_retired(timeout) -> bool   for tests and tools
        .state, .stats(), .close()

Why SGLang's MooncakeStore and not our own client code: its key naming (model prefix, ``_k``/``_v``
objects, TP and PP suffixes, MLA's rank-replicated keys), its buffer registration of the host pool
and its batch zero-copy calls are what SGLang's own ``mooncake`` backend writes, so the layouts it
supports and refuses are SGLang's. What changes (PinnedMooncakeStore):
  * every put carries ``preferred_segment`` = this client's own segment. Without it Mooncake places
    objects on any mounted segment, often the reader's, and a page then dies with whichever
    process happened to hold it; pinned, a page lives exactly as long as its writer (a client's
    objects vanish when it exits, which is why the tiered backend promotes what it reads);
  * an outage code (RPC_FAIL, RPC_TIMEOUT) raises ClusterDown instead of reading as a miss, so the
    gate can stop calling a dead or hung master; a failed transfer (TRANSFER_FAIL: a peer node
    that stopped answering) raises PeerTransferFailed, which closes the gate the same way;
  * a get that delivers fewer bytes than the page's object is a miss (SGLang accepts any count > 0);
  * a get reads only from segments already open (Peers): Mooncake's first transfer from a node
    waits 60 s per object for a handshake reply, which no MC_* variable bounds;
  * the keys of the objects it put are remembered (OwnObjects), so that clear() can remove them:
    SGLang's MooncakeStore.clear() would remove every node's objects. Retired keys read as absent,
    are never fetched and never put again until the cluster thread has removed them.

Failure handling: the Mooncake client is made by a background thread, never on SGLang's threads,
and only after the master has answered a client's setup made in a child process (``setup`` holds
the GIL while it waits: against a master that accepts connections but does not answer, it froze
every thread of the process for 20 x MC_RPC_TIMEOUT_MS). ``timeout_s`` is written to Mooncake's
timeout variables before the client exists, so a hung master or a frozen peer costs one call that
long (twice for a get: its replica query, then the transfer), then the gate is closed. After an
outage the same client is kept: it re-mounts its segment by itself once a master answers again;
the thread probes it (a small put, replica query, remove in its own segment) no sooner than
``retry_s`` after the gate closed and reopens the gate when the probe passes. One warning per
outage (failed reads from peers: at most one per 5 minutes), an info line at recovery.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional

import torch

logger = logging.getLogger("tutti_hicache.cluster")

# Mooncake ErrorCode values
OUTAGE_CODES = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT: the master cannot be reached
TRANSFER_FAIL = -800  # the bytes did not come from (or reach) the segment holding the object
OBJECT_NOT_FOUND = -704
_PROBE_BYTES = 4096
_BATCH = 1024  # keys per maintenance request
_TIMEOUT_VARS = ("MC_RPC_TIMEOUT_MS", "MC_TCP_PROGRESS_TIMEOUT_SEC")
_env_lock = threading.Lock()
_env_set_by_us: dict[str, str] = {}  # the values this module wrote (a user's export is left alone)


class ClusterDown(RuntimeError):
    """A Mooncake call reported an outage code."""


class PeerTransferFailed(ClusterDown):
    """A Mooncake get reported TRANSFER_FAIL: the node holding the object did not deliver it."""


def mooncake_missing() -> Optional[str]:
    """None when the Mooncake client and SGLang's MooncakeStore import, else the reason."""
    try:
        import mooncake.store  # noqa: F401
        from sglang.srt.mem_cache.storage.mooncake_store import mooncake_store  # noqa: F401
    except Exception as exc:  # ImportError, or a missing shared library (OSError)
        return f"{type(exc).__name__}: {exc}"
    return None


def mooncake_timeouts(timeout_s: float) -> dict[str, str]:
    """Mooncake's variables for `timeout_s`: a master request, and a TCP transfer from a peer that
    makes no progress (whole seconds; a frozen peer's read fails after one to two times that)."""
    return {"MC_RPC_TIMEOUT_MS": str(max(1, round(timeout_s * 1000))),
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(max(1, math.ceil(timeout_s)))}


def apply_timeouts(timeout_s: float) -> dict[str, str]:
    """Write mooncake_timeouts(timeout_s) into the environment, where Mooncake reads them when a
    client is made, except a variable set by someone else (the user's export wins). The values in
    effect."""
    with _env_lock:
        for name, value in mooncake_timeouts(timeout_s).items():
            current = os.environ.get(name)
            if current is None or (current == _env_set_by_us.get(name) and current != value):
                os.environ[name] = value
                _env_set_by_us[name] = value
        return {name: os.environ[name] for name in _TIMEOUT_VARS}


def _checked(results: Sequence[int], what: str) -> Sequence[int]:
    bad = [r for r in results if r in OUTAGE_CODES]
    if bad:
        raise ClusterDown(f"Mooncake {what}: error {bad[0]} on {len(bad)} of {len(results)} keys")
    return results


class OwnObjects:
    """The keys of the objects one client put into its own segment (published), and those clear()
    retired: retired keys read as absent, are neither fetched nor put, and are removed by the
    cluster thread (``unconfirmed``: not yet checked to be in this client's segment; a page evicted
    from it and published again by another node is that node's and is left alone).

    published is bounded: past `cap` keys the cluster thread drops those no longer in this
    client's segment (its segment holds at most segment_bytes / smallest object of them)."""

    def __init__(self, segment_bytes: int, wake: threading.Event):
        self.lock = threading.Lock()
        self.published: dict[str, int] = {}  # key -> sequence number of its put
        self.retired: set[str] = set()
        self.unconfirmed: set[str] = set()
        self.segment_bytes = segment_bytes
        self.min_bytes = 0
        self.prune = False
        self._seq = 0
        self._wake = wake

    MIN_CAP = 4096

    @property
    def cap(self) -> int:
        return max(self.MIN_CAP, 2 * self.segment_bytes // max(1, self.min_bytes))

    def pending(self) -> bool:
        return bool(self.retired) or self.prune

    def allowed(self, keys: Sequence[str]) -> list[int]:
        """Indices of the keys not retired."""
        retired = self.retired
        if not retired:
            return list(range(len(keys)))
        with self.lock:
            return [i for i, k in enumerate(keys) if k not in retired]

    def note_put(self, keys: Sequence[str], results: Sequence[int], sizes: Sequence[int]) -> None:
        with self.lock:
            for key, rc, size in zip(keys, results, sizes):
                if rc == 0:
                    self._seq += 1
                    self.published[key] = self._seq
                    self.min_bytes = size if not self.min_bytes else min(self.min_bytes, size)
            if len(self.published) > self.cap and not self.prune:
                self.prune = True
                self._wake.set()

    def retire(self) -> int:
        with self.lock:
            keys = self.published
            self.published = {}
            self.retired.update(keys)
            self.unconfirmed.update(keys)
            return len(keys)


def _memory_replicas(replicas) -> list[tuple[str, int]]:
    """(transport endpoint, size) of each replica in a node's memory segment."""
    out = []
    for r in replicas:
        if r.is_memory_replica():
            d = r.get_memory_descriptor().buffer_descriptor
            out.append((d.transport_endpoint, d.size))
    return out


class Peers:
    """The segments one client reads from. Mooncake opens a segment at its first transfer from it,
    by a handshake with the node holding it whose reply it awaits 60 s (hard-coded in 0.3.13, no
    MC_* variable bounds it) for every object of the batch: a node that stopped answering before
    this client ever read from it would hold SGLang's thread for minutes. So a get reads only from
    segments already open (this client's own, and those it read from); for another, one 4 KiB range
    of one of its objects is read by a thread of its own, which opens it, and the get waits for
    that at most timeout_s (a node that answers takes milliseconds) before the pages are misses.

    A failed transfer from a segment forgets it (Mooncake may have dropped it): it is opened again
    the same way. An open that failed is retried no sooner than retry_s later."""

    SCRATCH = 4096

    def __init__(self, client, timeout_s: float, retry_s: float):
        self._client = client
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self.opened: set[str] = set()
        self._opening: dict[str, threading.Event] = {}
        self._failed_at: dict[str, float] = {}
        self.skipped = 0  # objects not read because their segment was not open
        self._scratch = torch.empty(self.SCRATCH, dtype=torch.uint8)  # the opening reads land here
        rc = client.register_buffer(self._scratch.data_ptr(), self.SCRATCH)
        if rc != 0:
            raise ClusterDown(f"registering a {self.SCRATCH}-byte buffer returned {rc}")

    def select(self, keys: Sequence[str], candidates: list[int]) -> tuple[list[int], dict]:
        """The candidates the get may read now, and the segment each is read from. Raises
        PeerTransferFailed when a segment this call began to open did not open in time."""
        descs = self._client.batch_get_replica_desc([keys[i] for i in candidates])
        keep, source, waiting, started = [], {}, {}, {}
        for i in candidates:
            replicas = _memory_replicas(descs.get(keys[i]) or ())
            if not replicas:  # no answer for it (absent, or the master failed): the get answers
                keep.append(i)
                continue
            ready = [e for e, _ in replicas if e in self.opened]
            if ready:
                keep.append(i)
                source[i] = ready[0]
                continue
            endpoint, size = replicas[0]
            waiting.setdefault(endpoint, []).append(i)
            event, new = self._open(endpoint, keys[i], size)
            if new:
                started[endpoint] = event
        deadline = time.monotonic() + self._timeout_s
        for event in started.values():
            event.wait(max(0.0, deadline - time.monotonic()))
        for endpoint, idx in waiting.items():
            if endpoint in self.opened:
                keep.extend(idx)
                source.update((i, endpoint) for i in idx)
            else:
                self.skipped += len(idx)
        late = [e for e in started if e not in self.opened]
        if late:
            raise PeerTransferFailed(f"the node serving segment {late[0]} did not answer the "
                                     f"first read from it within {self._timeout_s:.1f} s")
        return sorted(keep), source

    def busy(self) -> bool:
        """An opening read is under way (it may wait 60 s for a node that does not answer)."""
        return bool(self._opening)

    def lost(self, endpoints) -> None:
        with self._lock:
            self.opened.difference_update(endpoints)

    def _open(self, endpoint: str, key: str, size: int) -> tuple[threading.Event, bool]:
        """(the event set when the opening read of `endpoint` ends, whether this call began it)."""
        with self._lock:
            event = self._opening.get(endpoint)
            if event is not None:
                return event, False
            event = threading.Event()
            failed = self._failed_at.get(endpoint)
            if failed is not None and time.monotonic() - failed < self._retry_s:
                event.set()  # failed a moment ago: not yet again
                return event, False
            self._opening[endpoint] = event
        threading.Thread(target=self._read_range, args=(endpoint, key, size, event),
                         name="tutti-cluster-open", daemon=True).start()
        return event, True

    def _read_range(self, endpoint: str, key: str, size: int, event: threading.Event) -> None:
        n = max(1, min(self.SCRATCH, size))
        try:
            got = self._client.get_into_ranges([self._scratch.data_ptr()], [[key]], [[[0]]],
                                               [[[0]]], [[[n]]])
            ok = got[0][0][0] == n
        except Exception as exc:
            logger.debug("tutti: opening Mooncake segment %s failed: %s", endpoint, exc)
            ok = False
        with self._lock:
            if ok:
                self.opened.add(endpoint)
                self._failed_at.pop(endpoint, None)
            else:
                self._failed_at[endpoint] = time.monotonic()
            self._opening.pop(endpoint, None)
        event.set()


def _subset(impl, keys, ptrs, sizes, keep: list[int], missing: int) -> list[int]:
    """impl on the kept indices only; the others answer `missing`."""
    if len(keep) == len(keys):
        return list(impl(keys, ptrs, sizes))
    out = [missing] * len(keys)
    if keep:
        got = impl([keys[i] for i in keep], [ptrs[i] for i in keep], [sizes[i] for i in keep])
        for i, r in zip(keep, got):
            out[i] = r
    return out


def pinned_store_class():
    """SGLang's MooncakeStore, with puts pinned to this client's segment, outages and failed
    transfers raised, and its own objects tracked (OwnObjects, set as .tutti_own)."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    class PinnedMooncakeStore(MooncakeStore):
        tutti_own: Optional[OwnObjects] = None
        tutti_peers: Optional[Peers] = None

        def _put_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes, group_ids=None,
                                      session_ids=None):
            config = self._replicate_config_cls()
            config.preferred_segment = self.store.get_hostname()
            if group_ids is not None and self._can_use_group_semantics():
                config.group_ids = group_ids
            if session_ids is not None and self._supports_session_ids:
                config.session_ids = session_ids

            def put(keys, ptrs, sizes):
                if self._uses_multi_buffer(ptrs):
                    return self.store.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
                return self.store.batch_put_from(keys, ptrs, sizes, config)

            own = self.tutti_own
            if own is None:
                return _checked(put(key_strs, buffer_ptrs, buffer_sizes), "put")
            if group_ids is not None or session_ids is not None:  # per-key lists: all or nothing
                keep = own.allowed(key_strs)
                if len(keep) != len(key_strs):
                    return [-1] * len(key_strs)
            out = _checked(_subset(put, key_strs, buffer_ptrs, buffer_sizes,
                                   own.allowed(key_strs), -1), "put")
            own.note_put(key_strs, out, [sum(s) if isinstance(s, Sequence) else s
                                         for s in buffer_sizes])
            return out

        def _get_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes):
            own, peers = self.tutti_own, self.tutti_peers
            keep = own.allowed(key_strs) if own is not None else list(range(len(key_strs)))
            source = {}
            if peers is not None and keep:
                keep, source = peers.select(key_strs, keep)
            got = _checked(_subset(super()._get_batch_zero_copy_impl, key_strs, buffer_ptrs,
                                   buffer_sizes, keep, -1), "get")
            failed = [i for i, r in enumerate(got) if r == TRANSFER_FAIL]
            if failed:  # the pages' bytes are not trusted: every remote page of the call misses
                if peers is not None:
                    peers.lost({source[i] for i in failed if i in source})
                raise PeerTransferFailed(f"Mooncake get: TRANSFER_FAIL on {len(failed)} of "
                                         f"{len(got)} objects")
            # SGLang counts any positive byte count as a hit; a short object is a miss here
            want = [sum(s) if isinstance(s, Sequence) else s for s in buffer_sizes]
            return [r if r <= 0 or r == w else -1 for r, w in zip(got, want)]

        def _batch_exist(self, key_strs):
            got = list(_checked(super()._batch_exist(key_strs), "exists"))
            own = self.tutti_own
            if own is not None and own.retired:
                keep = set(own.allowed(key_strs))
                got = [r if i in keep else 0 for i, r in enumerate(got)]
            return got

    return PinnedMooncakeStore


def _mooncake_config(storage_config):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeBaseStore

    return MooncakeBaseStore()._load_config(storage_config)


def _master_address(cfg) -> tuple[str, int] | None:
    """(host, port) of the master from SGLang's own config resolution (extra config, file, env)."""
    addr = (cfg.master_server_address or "").strip()
    if not addr or ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _close_client(store) -> None:
    try:
        store.store.close()  # MooncakeStore.close() leaves it to the destructor
    except Exception:
        logger.exception("tutti: closing the Mooncake client failed")


def _reachable(addr: tuple[str, int] | None, timeout: float = 1.0) -> bool:
    if addr is None:  # no master address (a standalone client): let setup decide
        return True
    try:
        with socket.create_connection(addr, timeout=timeout):
            return True
    except OSError:
        return False


# A Mooncake client's setup in a child process: the master must answer it (a TCP accept does not
# prove that: the kernel completes it for a stopped process), over the configured transport (one
# that cannot start, e.g. RDMA without its device, retries inside setup for about 20 s holding
# the GIL: in the server that froze every thread at each retry). No segment is mounted; the
# child exits without closing the client (a close waits on the master too).
_ANSWER_CHECK = r"""
import json, os, sys
a = json.loads(sys.argv[1])
from mooncake.store import MooncakeDistributedStore
print("imported", flush=True)
client = MooncakeDistributedStore()
rc = client.setup(a["host"], "P2PHANDSHAKE", 0, 1 << 20, a["protocol"], a["device"], a["master"])
print("setup", rc, flush=True)
os._exit(0)
"""


def _read_line(proc: subprocess.Popen, buf: bytearray, timeout: float) -> Optional[str]:
    """The child's next stdout line within `timeout` s; None on a timeout or at its exit."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode(errors="replace").strip()


class ClusterTier:
    """The Mooncake side of one tiered backend (module docstring). `tag` isolates identities: it
    joins SGLang's key prefix (``extra_backend_tag``), so only identical layouts share keys."""

    def __init__(self, storage_config, host_pool, tag: str, retry_s: float, timeout_s: float = 3.0):
        extra = dict(storage_config.extra_config or {})
        user_tag = extra.get("extra_backend_tag")
        extra["extra_backend_tag"] = f"{user_tag}_{tag}" if user_tag is not None else tag
        # SGLang's metrics are the tiered backend's own (get_stats): the inner store's would
        # grow by one entry per remote get and publish, drained by no one
        self._sc = dataclasses.replace(storage_config, extra_config=extra,
                                       enable_storage_metrics=False)
        self._pool = host_pool
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._store: Any = None
        self._own: Optional[OwnObjects] = None
        self._peers: Optional[Peers] = None  # the segments its gets may read (Peers)
        self._endpoint: Optional[str] = None  # where this client's segment serves its objects
        self._up = False
        self._closed = False
        self._calls = 0  # under _lock: SGLang's threads inside a call of the client (call())
        self._close_after: Any = None  # under _lock: the client the last such call closes
        self._off = False  # the pool cannot be served: no retry
        self._down_at = 0.0  # when the gate last closed (monotonic)
        self._peer_failure = False  # the gate closed for a failed transfer, not an outage
        self._warned_outage = False  # under _lock: one warning per outage
        self._peer_warned_at: Optional[float] = None  # failed transfers: a warning per 5 min
        self._warned_connect = False
        self._warned_check = False
        self._wake = threading.Event()
        self._counts = {"outages": 0, "recoveries": 0, "connect_attempts": 0,
                        "transfer_failures": 0, "cleared_objects": 0}
        self._cfg = None
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

    @contextlib.contextmanager
    def call(self):
        """The MooncakeStore for one call of SGLang's threads (None: serve locally). close()
        never closes the client under a call: the last call still in it closes it (closed under
        a running get, the Mooncake client crashed the process)."""
        with self._lock:
            store = self._store if self._up and not self._closed else None
            if store is not None:
                self._calls += 1
        try:
            yield store
        finally:
            if store is not None:
                with self._lock:
                    self._calls -= 1
                    last = self._calls == 0 and self._close_after is store
                    if last:
                        self._close_after = None
                if last:
                    _close_client(store)

    def failed(self, exc: BaseException) -> None:
        """An operation failed with an outage, a failed transfer or an exception: close the gate
        until a probe passes, no sooner than retry_s from now."""
        peer = isinstance(exc, PeerTransferFailed)
        with self._lock:
            was_up, self._up = self._up, False
            first = False
            if was_up:
                self._down_at = time.monotonic()
                self._peer_failure = peer
                if peer:
                    self._counts["transfer_failures"] += 1
                    now = time.monotonic()
                    first = self._peer_warned_at is None or now - self._peer_warned_at > 300
                    if first:
                        self._peer_warned_at = now
                else:
                    self._counts["outages"] += 1
                    first, self._warned_outage = not self._warned_outage, True
        if first and peer:
            logger.warning("tutti: a cluster tier (Mooncake) read from another node failed (%s: "
                           "a node that stopped answering?); those pages are misses, and the "
                           "cluster tier pauses %.1f s after each such failure (this warning "
                           "repeats at most every 5 minutes)", exc, self._retry_s)
        elif first:
            logger.warning("tutti: cluster tier (Mooncake) failed (%s); serving the local SSD "
                           "tier only, retrying every %.1f s", exc, self._retry_s)
        else:
            logger.debug("tutti: cluster tier call failed while down: %s", exc)

    def retire_published(self) -> int:
        """clear(): every object this client put is removed from Mooncake by the cluster thread
        (now if the master answers, else once it does); until then this client neither reads nor
        puts those keys. The number of keys retired."""
        own = self._own
        if own is None:  # no client was ever made: nothing was published
            return 0
        n = own.retire()
        if n and self._up:
            logger.info("tutti: clear(): removing the %d Mooncake objects this node published",
                        n)
        elif n:
            logger.warning("tutti: clear(): the Mooncake master (%s) is not answering: the %d "
                           "objects this node published stay in its segment until it answers "
                           "again and are removed then; this node does not read them meanwhile",
                           self._address, n)
        self._wake.set()
        return n

    def wait_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._up and time.monotonic() < deadline and not self._closed:
            time.sleep(0.05)
        return self._up

    def wait_retired(self, timeout: float) -> bool:
        """Until every object retired by clear() is gone from Mooncake."""
        deadline = time.monotonic() + timeout
        while self._own is not None and self._own.retired and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._own is None or not self._own.retired

    def stats(self) -> dict:
        with self._lock:
            own, peers = self._own, self._peers
            return {**self._counts, "cluster_state": self.state,
                    "cluster_retired": len(own.retired) if own is not None else 0,
                    "segments_open": len(peers.opened) if peers is not None else 0,
                    "segment_skipped": peers.skipped if peers is not None else 0}

    def close(self) -> None:
        """Closes the client, unless the cluster thread is still making it (it then closes it) or
        a call of another thread is still in it (then the client goes with its last reference:
        closing it under a running call is not safe)."""
        self._closed = True
        self._up = False
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            store, self._store = self._store, None
            in_calls = store is not None and self._calls > 0
            if in_calls:
                self._close_after = store  # the last of SGLang's calls in it closes it
        peers = self._peers
        if store is not None and (in_calls or self._thread.is_alive() or (peers and peers.busy())):
            logger.debug("tutti: a Mooncake call is still running; the client closes after it")
        elif store is not None:
            _close_client(store)

    # ------------------------------------------------------- background thread
    def _run(self) -> None:
        try:
            self._cfg = _mooncake_config(self._sc)
            self._address = _master_address(self._cfg)
        except Exception as exc:
            self._off = True
            logger.warning("tutti: cluster tier off: no usable Mooncake config (%s)", exc)
            return
        while not self._closed:
            delay = self._retry_s
            if not self._up:
                backoff = self._down_at + self._retry_s - time.monotonic()
                if backoff > 0:
                    delay = backoff
                else:
                    try:
                        self._connect() if self._store is None else self._probe()
                    except Exception as exc:
                        self._not_yet(exc)
            own = self._own
            if self._up and own is not None and own.pending():
                try:
                    self._maintain()
                except Exception as exc:
                    self.failed(exc)
            self._wake.wait(delay)
            self._wake.clear()

    def _not_yet(self, exc: BaseException) -> None:
        if self._store is None and not self._warned_connect:
            self._warned_connect = True
            logger.warning("tutti: cluster tier (Mooncake master %s) not reachable (%s); serving "
                           "the local SSD tier only, retrying every %.1f s",
                           self._address, exc, self._retry_s)
        else:
            logger.debug("tutti: cluster tier still unavailable: %s", exc)

    def _check_answers(self) -> None:
        """Raise ConnectionError unless the master answers a client's setup (in a child process,
        bounded: a hung setup there holds no lock of this process)."""
        if self._address is None:
            return
        host = (self._cfg.local_hostname or "127.0.0.1").strip()
        arg = json.dumps({"host": host, "master": self._cfg.master_server_address.strip(),
                          "protocol": str(getattr(self._cfg, "protocol", "tcp") or "tcp"),
                          "device": str(getattr(self._cfg, "device_name", "") or "")})
        try:
            proc = subprocess.Popen([sys.executable, "-c", _ANSWER_CHECK, arg],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
        except OSError as exc:
            return self._check_unavailable(exc)
        buf = bytearray()
        try:
            if _read_line(proc, buf, 60.0) != "imported":
                if proc.poll() is None:
                    raise ConnectionError("the master check did not start within 60 s")
                return self._check_unavailable(f"exit status {proc.returncode}")
            # its first master request answers or times out; at least 5 s, so that a loaded
            # machine's client setup is not taken for a hung master
            limit = max(self._timeout_s + 2.0, 5.0)
            line = _read_line(proc, buf, limit)
            if line is None:
                raise ConnectionError(f"no client setup against {self._address} within {limit:.0f} s "
                                      "(the master does not answer, or the transport "
                                      f"{getattr(self._cfg, 'protocol', 'tcp')!r} cannot start)")
            if line != "setup 0":
                raise ConnectionError(f"a client's setup against {self._address} failed ({line})")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()

    def _check_unavailable(self, why) -> None:
        if not self._warned_check:
            self._warned_check = True
            logger.warning("tutti: cannot check in a child process that the Mooncake master "
                           "answers (%s); making the client without that check", why)

    def _connect(self) -> None:
        self._counts["connect_attempts"] += 1
        if not _reachable(self._address):
            raise ConnectionError(f"no listener at {self._address}")
        apply_timeouts(self._timeout_s)  # read by Mooncake when the client is made
        self._check_answers()
        if self._closed:
            return
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
        ranks = max(1, self._sc.tp_size * self._sc.pp_size)
        self._own = store.tutti_own = OwnObjects(self._cfg.global_segment_size // ranks,
                                                 self._wake)
        try:
            self._peers = store.tutti_peers = Peers(store.store, self._timeout_s, self._retry_s)
        except Exception:
            store.store.close()
            raise
        with self._lock:
            if not self._closed:
                self._store = store
        if self._store is not store:  # close() ran meanwhile and found no store to close
            store.store.close()
            return
        self._probe(first=True)

    def _probe(self, first: bool = False) -> None:
        """A put, replica query and remove of one small object in this client's own segment; the
        query also tells where this segment serves its objects (OwnObjects' segment check)."""
        if not _reachable(self._address):
            raise ConnectionError(f"no listener at {self._address}")
        client = self._store.store
        key = f"tutti-probe-{uuid.uuid4().hex}"
        config = self._store._replicate_config_cls()
        config.preferred_segment = client.get_hostname()
        rc = client.put(key, bytes(_PROBE_BYTES), config)
        if rc != 0:
            raise ClusterDown(f"probe put returned {rc}")
        try:
            endpoints = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                         for r in client.get_replica_desc(key) if r.is_memory_replica()]
        finally:
            client.remove(key, True)  # force: the query leased it, and no one else reads it
        if not endpoints:
            raise ClusterDown("probe object not found after put")
        self._endpoint = endpoints[0]
        self._peers.opened.add(self._endpoint)  # its own segment: a local copy
        with self._lock:
            self._up = True
            peer, self._peer_failure = self._peer_failure, False
            self._warned_outage = False
            if not first:
                self._counts["recoveries"] += 1
        if first:
            logger.info("tutti: cluster tier up: Mooncake segment %s, key prefix %s",
                        client.get_hostname(), self._store.config_prefix)
        elif peer:
            logger.debug("tutti: cluster tier resumed after a failed transfer")
        else:
            logger.info("tutti: cluster tier (Mooncake) reachable again; publishing and reading "
                        "remote pages resumed")

    # ------------------------------------------------- this client's objects
    def _maintain(self) -> None:
        """Remove the objects retire_published() retired; bound the published keys."""
        own, client = self._own, self._store.store
        with own.lock:
            unconfirmed = list(own.unconfirmed)
        for i in range(0, len(unconfirmed), _BATCH):
            chunk = unconfirmed[i:i + _BATCH]
            ours, unknown = self._in_own_segment(client, chunk)
            with own.lock:  # absent, or in another node's segment: not ours to remove
                own.unconfirmed.difference_update(k for k in chunk if k not in unknown)
                own.retired.difference_update(k for k in chunk if k not in ours and
                                              k not in unknown)
        with own.lock:
            confirmed = sorted(own.retired - own.unconfirmed)
        removed = 0
        for i in range(0, len(confirmed), _BATCH):
            chunk = confirmed[i:i + _BATCH]
            codes = _checked(client.batch_remove(chunk, False), "remove")  # leased ones stay
            gone = [k for k, rc in zip(chunk, codes) if rc in (0, OBJECT_NOT_FOUND)]
            removed += sum(rc == 0 for rc in codes)
            with own.lock:
                own.retired.difference_update(gone)
        if removed:
            with self._lock:
                self._counts["cleared_objects"] += removed
            logger.info("tutti: clear(): removed %d Mooncake objects of this node; %d to go "
                        "(read by other nodes within the master's lease time)", removed,
                        len(own.retired))
        if own.prune:
            self._prune(own, client)

    def _prune(self, own: OwnObjects, client) -> None:
        with own.lock:
            snapshot = list(own.published.items())
        for i in range(0, len(snapshot), _BATCH):
            chunk = snapshot[i:i + _BATCH]
            ours, unknown = self._in_own_segment(client, [k for k, _ in chunk])
            with own.lock:
                for key, seq in chunk:  # a key put again meanwhile has a newer number: kept
                    if key not in ours and key not in unknown and own.published.get(key) == seq:
                        del own.published[key]
        own.prune = False

    def _in_own_segment(self, client, keys: list[str]) -> tuple[set, set]:
        """(keys whose object is in this client's segment, keys the master gave no answer for)."""
        codes = _checked(client.batch_is_exist(keys), "exists")
        present = [k for k, rc in zip(keys, codes) if rc == 1]
        unknown = {k for k, rc in zip(keys, codes) if rc not in (0, 1)}
        if not present:
            return set(), unknown
        replicas = client.batch_get_replica_desc(present)
        ours = set()
        for key in present:
            reps = replicas.get(key)
            if not reps:  # the query failed for it (it existed a moment ago): ask again later
                unknown.add(key)
            elif any(r.is_memory_replica() and r.get_memory_descriptor().buffer_descriptor
                     .transport_endpoint == self._endpoint for r in reps):
                ours.add(key)
        return ours, unknown
