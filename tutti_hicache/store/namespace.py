"""A store's namespace on disk: its directories, metadata files, segment files and their handles.

At a glance:
    check_dirs(cfg)                         create missing store dirs (0700); each must be writable
                                            and accept O_DIRECT, else ValueError naming tutti_dirs
    fit_to_filesystems(cfg, ns_dirs, slot_nbytes) -> cfg   segment size chosen or checked, the
                                            capacity lowered to what the filesystems hold
    Namespace(cfg, fingerprint, placement, capacity_slots, dirs=None)
        .dirs                               <dir>/tutti-<fingerprint>, one per store directory, in
                                            stripe order (heal.resolve made them and their metadata)
        .n_rows                             segment rows that the capacity spans
        .existing_rows() -> [row]           rows with a segment file in some directory
        .segment_path(d, row), .row_dirs(row), .file_slots(d, row), .row_slots(row), .mtimes(row)
        .create_segment(path, n_slots)      O_EXCL + posix_fallocate, above the free-space floor,
                                            after reclaiming quarantined files (heal.reclaim)
        .fit_row(row)                       size a row's files to the slots the capacity holds
        .remove_rows(rows, writer)          the capacity shrank: delete unused rows beyond it
    segment_census(ns_dirs, placement) -> SegmentCensus   what a namespace's segment files hold,
                                            from their sizes, bounded by the files (fsck, inspect)
    FileTable(io_engine, namespace, writable)   engine file handles of the segment files
        .open_row(row, create) -> bool      open (with create: make) the row's files; idempotent
        .is_open(d, row), .slot_files(slots) -> (file, offset), .path(file), .paths()
        .dirs_of(files) -> directory index of each handle; .ns_dirs
    lock_paths(paths) -> fds | None         exclusive non-blocking flocks on every path, or none

A row is segment number r in every directory. Files are sized so that the sum over all files
never exceeds the slots that fit in tutti_capacity_gb (the last row can end mid-row).
Thread-safety: Namespace holds no mutable state. FileTable.open_row may run on several threads
(growth, re-scans); each handle is opened once, under the table's own lock. slot_files and dirs_of read
the table without a lock: an entry only ever changes from "not open" to its handle.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from typing import NamedTuple

import numpy as np

from .. import engine
from ..config import ENV_PREFIX, GiB, PREFIX, TuttiConfig
from .repair.heal import reclaim
from ..layout import Placement

logger = logging.getLogger("tutti_hicache.store")
MiB = 1 << 20


def check_dirs(cfg: TuttiConfig) -> None:
    """Create missing store directories (0700); check they are writable and accept O_DIRECT."""
    if not cfg.dirs:
        raise ValueError(f"{PREFIX}dirs: at least one store directory is required "
                         f"(or set {ENV_PREFIX}DIRS)")
    for d in cfg.dirs:
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{PREFIX}dirs: cannot create {d}: {e.strerror}") from None
        if not os.path.isdir(d):
            raise ValueError(f"{PREFIX}dirs: {d} is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"{PREFIX}dirs: {d} is not writable")
        try:
            direct = engine.probe_o_direct(d)
        except OSError as e:
            raise ValueError(f"{PREFIX}dirs: cannot create files in {d}: {e.strerror}") from None
        if not direct:
            raise ValueError(f"{PREFIX}dirs: the filesystem of {d} refuses O_DIRECT (some FUSE, "
                             "overlay or network filesystems do); use a directory on ext4, xfs, "
                             "btrfs or tmpfs")


def fit_to_filesystems(cfg: TuttiConfig, ns_dirs: list[str], slot_nbytes: int) -> TuttiConfig:
    """The configuration a store opens with, fitted to the filesystems under tutti_dirs.

    Segment size: tutti_segment_gb 0 picks 1 GiB, or an eighth of the smallest filesystem when
    that is less; a given size larger than a filesystem raises ValueError. Capacity: lowered,
    with one warning, to what the filesystems can hold: the store's own segment files plus the
    free space above tutti_free_space_floor_gb, shared evenly by the directories on one
    filesystem, times the number of directories (slots stripe evenly). Never below what the
    store already holds, so a fuller disk never shrinks a store at attach. Where not one slot
    fits, a warning and a store of one slot per directory (its writes fail until restarted)."""
    by_fs: dict[int, list[int]] = {}  # st_dev -> indices of the directories on it
    for i, d in enumerate(cfg.dirs):
        by_fs.setdefault(os.stat(d).st_dev, []).append(i)
    floor = int(cfg.free_space_floor_gb * GiB)
    room, sizes = {}, []  # directory -> its share of its filesystem's room; (fs bytes, a dir)
    for idx in by_fs.values():
        st = os.statvfs(cfg.dirs[idx[0]])
        sizes.append((st.f_blocks * st.f_frsize, cfg.dirs[idx[0]]))
        free = max(0, st.f_bavail * st.f_frsize - floor)
        share = (sum(_segment_bytes(ns_dirs[i]) for i in idx) + free) // len(idx)
        room.update({cfg.dirs[i]: (share, free) for i in idx})
    segment = _segment_size(cfg, slot_nbytes, *min(sizes))
    tight = min(room, key=lambda d: room[d][0])
    fits = room[tight][0] * len(cfg.dirs) // slot_nbytes * slot_nbytes
    if fits == 0:  # the server runs on without this tier; a restart with room sizes it again
        logger.warning("tutti: %sdirs: no room for one %d KiB page slot in %s (%d KiB free%s): "
                       "nothing is stored until space is freed there and the server restarts",
                       PREFIX, slot_nbytes >> 10, tight, room[tight][1] >> 10,
                       f" above {PREFIX}free_space_floor_gb" if floor else "")
        return cfg.with_(capacity_gb=slot_nbytes * len(cfg.dirs) / GiB, segment_gb=segment / GiB)
    if fits < cfg.capacity_bytes:
        logger.warning("tutti: %scapacity_gb %g is more than tutti_dirs' filesystems can hold "
                       "(their free space%s plus this store's own segments): the store is "
                       "capped at %s", PREFIX, cfg.capacity_gb,
                       f" above {PREFIX}free_space_floor_gb" if floor else "",
                       f"{fits / GiB:.1f} GiB" if fits >= GiB else f"{fits / MiB:.1f} MiB")
        return cfg.with_(capacity_gb=fits / GiB, segment_gb=segment / GiB)
    return cfg.with_(segment_gb=segment / GiB)


def _segment_size(cfg: TuttiConfig, slot_nbytes: int, fs_nbytes: int, d: str) -> int:
    """tutti_segment_gb in bytes, or (0) the adaptive size: 1 GiB, at most fs_nbytes / 8."""
    if cfg.segment_bytes == 0:
        return max(slot_nbytes, min(GiB, fs_nbytes // 8 // MiB * MiB))
    if cfg.segment_bytes > fs_nbytes:
        raise ValueError(f"{PREFIX}segment_gb: a {cfg.segment_bytes / MiB:.0f} MiB segment does "
                         f"not fit in the {fs_nbytes / MiB:.0f} MiB filesystem of {d}; leave it "
                         f"unset (0: sized to the filesystem) or set it below "
                         f"{fs_nbytes / GiB:.4g}")
    return cfg.segment_bytes


def _segment_bytes(ns: str) -> int:
    """Bytes of the segment files in a namespace directory (0 where there is none yet, or a
    damaged one that attach's healing rebuilds next)."""
    try:
        return sum(os.lstat(os.path.join(ns, name)).st_size for _, name in _segment_files(ns))
    except OSError:
        return 0


def _segment_files(ns: str) -> list[tuple[int, str]]:
    """(row, file name) of every segment file in a namespace directory (none where the
    directory itself is missing: fsck looks at a namespace as it is)."""
    try:
        names = os.listdir(ns)
    except FileNotFoundError:
        return []
    return [(int(name[4:-4]), name) for name in names
            if name.startswith("seg-") and name.endswith(".dat") and name[4:-4].isdigit()]


def segment_name(row: int) -> str:
    """The file name of a row's segment in each directory."""
    return f"seg-{row:06d}.dat"


def namespace_dirs(dirs, fingerprint: bytes) -> list[str]:
    return [os.path.join(d, "tutti-" + fingerprint.hex()) for d in dirs]


class SegmentCensus(NamedTuple):
    """A namespace's segment files as found (segment_census)."""
    rows: int  # rows 0 .. rows-1: each has a file in some directory (the rows that count)
    slots: int  # whole slots in those files, at most a segment's per file: the capacity
    span: int  # 1 + the highest slot those files hold (0: none); reads past a file's end miss
    issues: list  # one line per file that is missing, short, cut mid-slot or not the store's


def segment_census(ns_dirs: list[str], placement: Placement) -> SegmentCensus:
    """What the segment files of a namespace hold, from their sizes (the store fits every file
    to its capacity, the last row cut short: Namespace.fit_row). Rows count from 0 while some
    directory has the row's file; a file past them (a stray name, a row after a missing one) is
    reported and ignored, so nothing is sized from a file name. Reported too: a file that is
    missing or shorter than its row needs (a row before the last needs a whole segment in every
    directory; the last row may end mid-row, one slot more in the first directories at most),
    a size that is not a whole number of slots, anything that is not a regular file."""
    n, slot, sps = len(ns_dirs), placement.slot_nbytes, placement.slots_per_segment
    issues: list[str] = []
    sizes: dict[tuple[int, int], int] = {}  # (directory, row) -> bytes
    for d, ns in enumerate(ns_dirs):
        for row, name in sorted(_segment_files(ns)):
            path = os.path.join(ns, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if name != segment_name(row):
                issues.append(f"{path}: not a segment name of this store: ignored")
            elif not stat.S_ISREG(st.st_mode):
                issues.append(f"{path}: not a regular file: ignored (attach removes it)")
            else:
                sizes[d, row] = st.st_size
    present = {row for _, row in sizes}
    rows = 0
    while rows in present:
        rows += 1
    stray = sorted((row, d) for d, row in sizes if row >= rows)
    for row, d in stray[:5]:
        issues.append(f"{os.path.join(ns_dirs[d], segment_name(row))}: past the store's rows "
                      f"({segment_name(rows)} is in no directory): ignored, not checked")
    if len(stray) > 5:
        issues.append(f"{len(stray) - 5} more segment files past the store's rows: ignored")
    slots, span = 0, 0
    for row in range(rows):
        have = [min(sizes.get((d, row), 0), sps * slot) // slot for d in range(n)]
        if row < rows - 1:
            need = [sps] * n
        else:  # the last row: the capacity may end mid-row, after directory (end - 1) % n
            end = max(((k - 1) * n + d + 1 for d, k in enumerate(have) if k), default=0)
            need = [max(0, -(-(end - d) // n)) for d in range(n)]
        for d in range(n):
            path = os.path.join(ns_dirs[d], segment_name(row))
            size = sizes.get((d, row))
            if size is not None and size % slot:
                issues.append(f"{path}: {size} bytes, not a whole number of {slot}-byte slots "
                              f"(cut mid-slot: the page it ends in is lost)")
            if size is not None and size > sps * slot:
                issues.append(f"{path}: {size} bytes, longer than a {sps}-slot segment: the "
                              f"bytes past it are ignored")
            if size is None and need[d]:
                issues.append(f"{path}: missing (deleted?): the pages of its {need[d]} slots are "
                              f"lost; a server's attach recreates it empty")
            elif have[d] < need[d]:
                issues.append(f"{path}: holds {have[d]} of the {need[d]} slots its row needs "
                              f"(truncated?): the pages past its end are lost; a server's "
                              f"attach sizes it again")
            slots += have[d]
            if have[d]:
                span = max(span, ((row * sps + have[d] - 1) * n + d) + 1)
    return SegmentCensus(rows, slots, span, issues)


class Namespace:
    """Paths and file operations of one identity's namespace (no state beyond its geometry)."""

    def __init__(self, cfg: TuttiConfig, fingerprint: bytes, placement: Placement,
                 capacity_slots: int, dirs: list[str] | None = None):
        self.dirs = dirs or namespace_dirs(cfg.dirs, fingerprint)
        self.placement = placement
        self.capacity_slots = capacity_slots
        self.n_rows = placement.segments_for(capacity_slots)
        self.free_space_floor = int(cfg.free_space_floor_gb * (1 << 30))

    # ------------------------------------------------------------------ layout
    def segment_path(self, d: int, row: int) -> str:
        return os.path.join(self.dirs[d], segment_name(row))

    def file_slots(self, d: int, row: int) -> np.ndarray:
        """Slots of segment (d, row) that fit in the capacity, in file order."""
        s = self.placement.segment_slots(d, row)
        return s[s < self.capacity_slots]

    def row_slots(self, row: int) -> np.ndarray:
        """Every slot of a row that fits in the capacity, sorted."""
        return np.sort(np.concatenate([self.file_slots(d, row) for d in range(len(self.dirs))]))

    def row_dirs(self, row: int) -> list[int]:
        """Directories holding at least one slot of `row` (the capacity can end mid-row)."""
        return [d for d in range(len(self.dirs)) if len(self.file_slots(d, row))]

    def existing_rows(self) -> list[int]:
        return _existing_rows(self.dirs)

    def mtimes(self, row: int) -> list[int]:
        """st_mtime_ns of the row's file in each directory (-1: no file)."""
        out = []
        for d in range(len(self.dirs)):
            try:
                out.append(os.stat(self.segment_path(d, row)).st_mtime_ns)
            except FileNotFoundError:
                out.append(-1)
        return out

    # ------------------------------------------------------------------- files
    def create_segment(self, path: str, n_slots: int, reclaim_space: bool = True) -> None:
        """Make and fallocate a segment file. reclaim_space: first delete set-aside segments
        (heal.reclaim) until the store fits its capacity; fsck, which knows only the capacity
        the files show, passes False (it would delete pages a writer has yet to re-home)."""
        nbytes = n_slots * self.placement.slot_nbytes
        if reclaim_space:
            reclaim(self.dirs, nbytes, self.capacity_slots * self.placement.slot_nbytes, path,
                    self.free_space_floor, len(self.dirs) * self.placement.segment_file_nbytes)
        st = os.statvfs(os.path.dirname(path))
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"only {free >> 20} MiB free for a {nbytes >> 20} MiB segment", path)
        if free - nbytes < self.free_space_floor:
            raise OSError(errno.ENOSPC, "free space would fall below tutti_free_space_floor_gb", path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)

    def fit_row(self, row: int) -> None:
        """Size an owned row's files to exactly the slots that fit in the capacity."""
        for d in self.row_dirs(row):
            path = self.segment_path(d, row)
            want = len(self.file_slots(d, row)) * self.placement.slot_nbytes
            have = os.path.getsize(path)
            if have > want:
                os.truncate(path, want)
            elif have < want:
                fd = os.open(path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, want)
                finally:
                    os.close(fd)

    def remove_rows(self, rows: list[int], writer: bool) -> None:
        """Remove rows beyond the capacity (it shrank since they were written), if unused."""
        for r in rows:
            paths = [p for p in (self.segment_path(d, r) for d in range(len(self.dirs)))
                     if os.path.exists(p)]
            fds = lock_paths(paths) if writer else None
            if fds is None:
                logger.warning("tutti: segment row %d lies beyond tutti_capacity_gb and is in "
                               "use by another process (or this one is read-only): ignored", r)
                continue
            for p in paths:
                os.unlink(p)
            for fd in fds:
                os.close(fd)
            logger.warning("tutti: capacity shrank: removed segment row %d", r)


class FileTable:
    """Engine file handles of a namespace's segment files, [directory, row] -> handle."""

    def __init__(self, io_engine, ns: Namespace, writable: bool):
        self._engine = io_engine
        self._ns = ns
        self._writable = writable
        self._lock = threading.Lock()  # opening a handle (check and set)
        self._table = np.full((len(ns.dirs), ns.n_rows), -1, dtype=np.int64)
        self._paths: dict[int, str] = {}
        self._unopenable: set = set()  # paths an open refused (said once)
        self._dir_of = np.zeros(0, dtype=np.int64)  # handle -> directory; replaced, never mutated

    @property
    def ns_dirs(self) -> list[str]:
        return self._ns.dirs

    def open_row(self, row: int, create: bool) -> bool:
        """Open the row's files that exist (with create: make and fallocate missing ones).

        Returns True when every file of the row is open."""
        complete = True
        for d in self._ns.row_dirs(row):
            if self._table[d, row] >= 0:
                continue
            path = self._ns.segment_path(d, row)
            if create and not os.path.exists(path):
                try:
                    self._ns.create_segment(path, len(self._ns.file_slots(d, row)))
                except FileExistsError:
                    pass  # another writer made it between the check and the create: open it
            if not os.path.exists(path):
                complete = False
                continue
            with self._lock:
                if self._table[d, row] < 0:
                    try:
                        f = self._engine.open_file(path, self._writable, True)
                    except OSError as e:  # a directory, no permission: the row stays incomplete
                        if path not in self._unopenable:  # (every caller copes with that), once
                            self._unopenable.add(path)
                            logger.warning("tutti: cannot open segment file %s: %s; its row is "
                                           "left out until it can be", path, e)
                        complete = False
                        continue
                    self._paths[f] = path
                    dir_of = np.zeros(max(len(self._dir_of), f + 1), dtype=np.int64)
                    dir_of[:len(self._dir_of)] = self._dir_of
                    dir_of[f] = d
                    self._dir_of = dir_of  # before the handle is published in the table
                    self._table[d, row] = f
        return complete

    def is_open(self, d: int, row: int) -> bool:
        return bool(self._table[d, row] >= 0)

    def slot_files(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(engine file handle, byte offset in that file) of each slot."""
        d, row, off = self._ns.placement.locate(slots)
        return self._table[d, row], off

    def dirs_of(self, files: np.ndarray) -> np.ndarray:
        """Directory index of each engine file handle opened here (vectorized, no lock)."""
        return self._dir_of[files]

    def path(self, file: int) -> str:
        return self._paths[int(file)]

    def paths(self) -> dict[int, str]:
        """Every open handle and its segment file path."""
        with self._lock:
            return dict(self._paths)


def registry_entry(path: str) -> tuple[str, int]:
    """How an entry of a namespace's writers/ registry stands (Rows.register makes them):
    ("live", -1) another process holds its flock; ("unopenable", -1) no writer can hold it (no
    permission, a directory, gone); ("taken", fd) this process now holds its flock (a dead
    writer's, or one a writer is registering: the caller tells them apart and closes fd);
    ("unknown", -1) the flock failed otherwise. A FIFO is never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return "unopenable", -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "live", -1
    except OSError:
        os.close(fd)
        return "unknown", -1
    return "taken", fd


def lock_paths(paths: list[str]):
    """Exclusive non-blocking flocks on every path, or None (nothing held) if any fails."""
    fds = []
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _existing_rows(ns_dirs: list[str]) -> list[int]:
    return sorted({row for ns in ns_dirs for row, _ in _segment_files(ns)})

