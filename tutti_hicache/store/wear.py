"""SSD wear: the bytes this store hands the drives, per store directory (one per device) and by
kind, kept across restarts, and the drive writes per day they amount to.

At a glance:
    wear = Wear(ns_dirs, dirs_of, drive_capacity_gb)   ns_dirs: the namespace directory in each
                        store directory; dirs_of(files) -> directory index of engine file handles
    wear.wrote(kind, files, results)    [any thread] one engine write batch of kind "payload",
                        "header" or "tombstone": results per request (nbytes or -errno), a whole
                        number of requests per entry of files (e.g. a page's objects)
    wear.stored(files, page_nbytes)     logical bytes: pages the caller asked to store, published
    wear.wrote_meta(nbytes)             metadata files (identity, placement, the counter files)
    wear.load()                         at attach: the lifetime counters from the counter files
                                        (a damaged one is reset with a warning, never fatal)
    wear.maybe_flush() / wear.flush()   add this process's new bytes to each directory's counter
                                        file (maybe_: at most once a minute); never raises
    wear.snapshot() -> dict             per store directory ("devices"): bytes by kind, logical,
                                        write amplification, capacity; per drive ("drives": the
                                        directories on one filesystem together): drive writes per
                                        day (this session, lifetime)
    read_counters(path) -> dict         a counter file, validated (ValueError if damaged)
    lifetime(counters, capacity_bytes, now) -> dict   a counter file's bytes, amplification and
                                        drive writes per day since it began (inspect)
    drive_writes_per_day(nbytes, seconds, capacity_bytes) -> float
    drive_key(store_dir) -> tuple       which drive (filesystem) a directory is on: ("dev", st_dev),
                                        or ("dir", store_dir) when it cannot be read

Drive writes per day are a drive's: every store directory on one filesystem (st_dev) adds its
bytes to that drive's before they are divided by its capacity, so two directories on one drive
each show the drive's figure, not half of it (a directory's own bytes stay in its counters).

Physical bytes are the bytes of write requests that completed (a failed request counts nothing),
so physical / logical is the write amplification of our own format: slot headers, tombstones of
reused slots, object padding on the bounce path, payloads whose header then failed, metadata.
Not seen here: filesystem metadata and journal, and the drive's own (FTL) amplification;
compare with the drive's SMART "data units written" for those. fallocate writes no data.

Counter file: <dir>/tutti-<fingerprint>/wear.json, one per directory, JSON of the cumulative
bytes by kind and `since` (when counting began). Several processes share a namespace: each adds
its delta under an flock on the namespace directory and replaces the file atomically (written to
a temporary file, fsync'd, renamed); its meta bytes include its own writes.

Thread-safety: one lock around the counters, taken once per engine batch (the per-directory sums
are computed before it, vectorized); flushes are serialized by a second lock and do their file
I/O outside the first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger("tutti_hicache.store")

KINDS = ("payload", "header", "tombstone", "meta")  # physical bytes, by what they hold
COLUMNS = KINDS + ("logical",)
_COL = {k: i for i, k in enumerate(COLUMNS)}
PHYSICAL = slice(0, len(KINDS))
LOGICAL = _COL["logical"]
FILE_NAME = "wear.json"
FORMAT = 1
FLUSH_INTERVAL_S = 60.0
SECONDS_PER_DAY = 86400.0


def drive_writes_per_day(nbytes: int, seconds: float, capacity_bytes: int) -> float:
    """Drive writes per day of `nbytes` written over `seconds` on a drive of `capacity_bytes`
    (0.0 when either is unknown or zero)."""
    if seconds <= 0 or capacity_bytes <= 0:
        return 0.0
    return nbytes / capacity_bytes * SECONDS_PER_DAY / seconds


def write_amplification(physical: int, logical: int) -> Optional[float]:
    """physical / logical bytes; None before any page was stored."""
    return physical / logical if logical > 0 else None


def drive_capacity(store_dir: str, configured_gb: float = 0.0) -> int:
    """Bytes of the drive behind store_dir: configured_gb (GB = 10^9 bytes, as drives are rated)
    when > 0, else the size of its filesystem (statvfs); 0 when neither is known."""
    if configured_gb > 0:
        return int(configured_gb * 1e9)
    try:
        st = os.statvfs(store_dir)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def drive_key(store_dir: str) -> tuple:
    """The drive holding store_dir: ("dev", st_dev of its filesystem); a directory that cannot
    be read is a drive of its own, ("dir", store_dir)."""
    try:
        return ("dev", os.stat(store_dir).st_dev)
    except OSError:
        return ("dir", store_dir)


def read_counters(path: str) -> Optional[dict]:
    """The counter file at path as {kind: bytes, "logical": bytes, "since": unix s}; None when
    there is none; ValueError when it is damaged (not JSON, another format, a bad field)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} counter file")
    out = {}
    for k in COLUMNS:
        v = obj.get(k)
        if type(v) is not int or not 0 <= v < 1 << 63:  # counters are int64 where they are added
            raise ValueError(f"field {k!r} is {v!r}, not a byte count")
        out[k] = v
    since = obj.get("since")
    if type(since) not in (int, float) or not 0 < since < 1e11:
        raise ValueError(f"field 'since' is {since!r}, not a time")
    out["since"] = float(since)
    return out


def lifetime(counters: dict, capacity_bytes: int, now: Optional[float] = None) -> dict:
    """A counter file's view: bytes by kind, physical, logical, write amplification, and drive
    writes per day over the time since it began."""
    seconds = (time.time() if now is None else now) - counters["since"]
    return {"since": counters["since"], "seconds": seconds,
            **_view(_counter_row(counters), seconds, capacity_bytes)}


def _counter_row(counters: dict) -> np.ndarray:
    return np.array([counters[k] for k in COLUMNS], dtype=np.int64)


class Wear:
    def __init__(self, ns_dirs: Sequence[str], dirs_of: Callable[[np.ndarray], np.ndarray],
                 drive_capacity_gb: float = 0.0):
        self.ns_dirs = [str(d) for d in ns_dirs]
        self._dirs_of = dirs_of
        self._drive_gb = drive_capacity_gb
        n = len(self.ns_dirs)
        self._lock = threading.Lock()  # the arrays below
        self._session = np.zeros((n, len(COLUMNS)), np.int64)  # this process, since attach
        self._pending = np.zeros_like(self._session)  # not yet in the counter files
        self._flushing = np.zeros_like(self._session)  # being added to them now
        self._base = np.zeros_like(self._session)  # the files' totals when last read
        self._since = np.full(n, time.time())
        self._t0 = time.monotonic()
        self._flush_lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._capacity = [0] * n
        self._drive: list = [None] * n  # drive_key of each directory (load)
        self._warned: set = set()  # tags warned once (a racing duplicate is harmless)

    # ----------------------------------------------------------------- counting
    def wrote(self, kind: str, files: np.ndarray, results: np.ndarray) -> None:
        """Count one engine write batch: results [len(files) * k] (nbytes or -errno), k requests
        per entry of files in order (the aligned payload path submits a page's objects)."""
        files = np.asarray(files, dtype=np.int64)
        if len(files):
            done = np.maximum(np.asarray(results, dtype=np.int64), 0)
            self._add(_COL[kind], files, lambda: done.reshape(len(files), -1).sum(axis=1))

    def stored(self, files: np.ndarray, page_nbytes: int) -> None:
        """Count the logical bytes of pages published in these files (one entry per page)."""
        files = np.asarray(files, dtype=np.int64)
        if len(files):
            self._add(LOGICAL, files, lambda: np.full(len(files), page_nbytes, np.int64))

    def wrote_meta(self, nbytes: Sequence[int]) -> None:
        """Count metadata bytes written, one entry per directory."""
        add = np.zeros_like(self._session)
        add[:, _COL["meta"]] = np.asarray(nbytes, dtype=np.int64)
        with self._lock:
            self._session += add
            self._pending += add

    def _add(self, col: int, files: np.ndarray, nbytes: Callable[[], np.ndarray]) -> None:
        """Add nbytes() per file to column col of the files' directories. Never raises: the
        bytes are already written, and counting them must not turn a write into a failure."""
        try:
            # bincount sums in float64: exact below 2^53 bytes (9 PB) per batch
            per_dir = np.bincount(self._dirs_of(files), weights=nbytes(),
                                  minlength=len(self.ns_dirs)).astype(np.int64)
        except Exception as e:  # a bug here: log once, keep storing
            if "count" not in self._warned:
                self._warned.add("count")
                logger.error("tutti: wear counters cannot count a write batch: %r", e)
            return
        with self._lock:
            self._session[:, col] += per_dir
            self._pending[:, col] += per_dir

    # -------------------------------------------------------------- persistence
    def load(self) -> None:
        """Read each directory's counter file (lifetime totals) and its drive's capacity."""
        for d, ns in enumerate(self.ns_dirs):
            store_dir = os.path.dirname(ns) or ns
            self._capacity[d] = drive_capacity(store_dir, self._drive_gb)
            self._drive[d] = drive_key(store_dir)
            try:
                c = read_counters(os.path.join(ns, FILE_NAME))
            except (OSError, ValueError) as e:
                self._warn_damaged(ns, e)
                continue
            if c is not None:
                with self._lock:
                    self._base[d] = _counter_row(c)
                    self._since[d] = c["since"]

    def maybe_flush(self) -> None:
        """flush() when the last one is a minute old (FLUSH_INTERVAL_S)."""
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> bool:
        """Add the bytes counted since the last flush to each directory's counter file. Returns
        False when a file could not be written (its bytes stay pending; logged once)."""
        with self._flush_lock:
            self._last_flush = time.monotonic()
            with self._lock:
                delta = self._pending.copy()
                self._pending[:] = 0
                self._flushing += delta
            ok = True
            for d in np.flatnonzero(delta.any(axis=1)).tolist():
                try:
                    total, since, nbytes = self._merge(d, delta[d])
                except OSError as e:
                    ok = False
                    with self._lock:
                        self._flushing[d] -= delta[d]
                        self._pending[d] += delta[d]
                    if ("io", d) not in self._warned:
                        self._warned.add(("io", d))
                        logger.warning("tutti: cannot write the wear counters in %s: %s",
                                       self.ns_dirs[d], e)
                    continue
                with self._lock:
                    self._flushing[d] -= delta[d]
                    self._base[d] = total
                    self._since[d] = since
                    self._session[d, _COL["meta"]] += nbytes  # the counter file itself
            return ok

    def _merge(self, d: int, delta: np.ndarray) -> tuple[np.ndarray, float, int]:
        """Under an flock on the namespace directory: read, add delta, replace the file. Returns
        (the file's new totals, its since, bytes written; the totals count the file itself)."""
        ns = self.ns_dirs[d]
        path = os.path.join(ns, FILE_NAME)
        fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                cur = read_counters(path)
            except ValueError as e:
                self._warn_damaged(ns, e)
                cur = None
            if cur is None:
                cur = {**dict.fromkeys(COLUMNS, 0), "since": float(self._since[d])}
            total, data = _encode(_counter_row(cur) + delta, cur["since"])
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                try:
                    if os.write(out, data) != len(data):
                        raise OSError(errno.ENOSPC, "short write", tmp)
                    os.fsync(out)
                finally:
                    os.close(out)
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return total, cur["since"], len(data)
        finally:
            os.close(fd)  # drops the flock

    def _warn_damaged(self, ns: str, err: Exception) -> None:
        key = ("damaged", ns)
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("tutti: the wear counters in %s are damaged (%s): counting again from "
                           "zero", os.path.join(ns, FILE_NAME), err)

    # ------------------------------------------------------------------- views
    def snapshot(self) -> dict:
        """Counters of this session and of the drive's life (the counter files plus what is not
        flushed yet), per store directory ("devices"), and drive writes per day at each rate per
        drive ("drives": the bytes of every directory on one filesystem over its capacity; each
        directory's entry repeats its drive's figure)."""
        with self._lock:
            session = self._session.copy()
            life = self._base + self._flushing + self._pending
            since = self._since.copy()
        seconds, now = time.monotonic() - self._t0, time.time()
        devices = []
        for d, ns in enumerate(self.ns_dirs):
            cap = self._capacity[d]
            dev = {"dir": os.path.dirname(ns), "capacity_bytes": cap, "seconds": seconds,
                   **_view(session[d], seconds, cap)}
            dev["lifetime"] = lifetime({"since": float(since[d]),
                                        **dict(zip(COLUMNS, life[d].tolist()))}, cap, now)
            devices.append(dev)
        drives = []
        for group in self._drive_groups():
            cap = self._capacity[group[0]]
            rate = sum(devices[d]["lifetime"]["physical_bytes"] / devices[d]["lifetime"]["seconds"]
                       for d in group if devices[d]["lifetime"]["seconds"] > 0)
            phys = int(session[group][:, PHYSICAL].sum())
            drive = {"device": min(devices[d]["dir"] for d in group),
                     "dirs": [devices[d]["dir"] for d in group], "capacity_bytes": cap,
                     "physical_bytes": phys, "seconds": seconds,
                     "drive_writes_per_day": drive_writes_per_day(phys, seconds, cap),
                     "lifetime_drive_writes_per_day": drive_writes_per_day(
                         rate * SECONDS_PER_DAY, SECONDS_PER_DAY, cap)}
            for d in group:  # each directory shows its drive's figures
                dev = devices[d]
                dev["drive_dirs"] = drive["dirs"]
                dev["drive_writes_per_day"] = drive["drive_writes_per_day"]
                dev["lifetime"]["drive_writes_per_day"] = drive["lifetime_drive_writes_per_day"]
            drives.append(drive)
        phys, logical = int(session[:, PHYSICAL].sum()), int(session[:, LOGICAL].sum())
        return {"physical_bytes": phys, "logical_bytes": logical,
                "write_amplification": write_amplification(phys, logical), "seconds": seconds,
                "devices": devices, "drives": drives}

    def _drive_groups(self) -> list[list[int]]:
        """Directory indices grouped by drive (filesystem), in directory order; a directory whose
        filesystem is unknown is a drive of its own."""
        groups: dict = {}
        for d, key in enumerate(self._drive):
            groups.setdefault(key if key is not None else ("index", d), []).append(d)
        return list(groups.values())


def _encode(total: np.ndarray, since: float) -> tuple[np.ndarray, bytes]:
    """(totals, the counter file's bytes) where the meta bytes include the file's own length:
    iterate to the fixed point (the length only grows with the digits, so this converges)."""
    updated, own = time.time(), 0
    while True:
        row = total.copy()
        row[_COL["meta"]] += own
        data = json.dumps({"format": FORMAT, "since": since, "updated": updated,
                           **{k: int(v) for k, v in zip(COLUMNS, row)}}, sort_keys=True).encode()
        if len(data) == own:
            return row, data
        own = len(data)


def _view(row: np.ndarray, seconds: float, capacity: int) -> dict:
    """One directory's counters as a dict, with write amplification and drive writes per day."""
    phys = int(row[PHYSICAL].sum())
    out = {f"{k}_bytes": int(row[i]) for i, k in enumerate(KINDS)}
    out.update(physical_bytes=phys, logical_bytes=int(row[LOGICAL]),
               write_amplification=write_amplification(phys, int(row[LOGICAL])),
               drive_writes_per_day=drive_writes_per_day(phys, seconds, capacity))
    return out
