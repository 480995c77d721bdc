"""The raw medium: O_DIRECT reads and writes of plain files, the reference every figure is set against.

At a glance:
    write_raw_file(path, nbytes)                    random bytes, O_DIRECT, 8 MiB requests
    raw_read_GBps(path, nbytes, req, threads) -> GB/s   O_DIRECT read into distinct, pre-faulted memory
    raw_read_uring_GBps(path, nbytes, req, batch_nbytes, dirs, ...) -> GB/s
                                                    the same through tutti's own engine: io_uring,
                                                    its queue depth, `req`-byte operations
    raw_read_dirs(dirs, nbytes, reqs, engine_req) -> dict   one file per directory, every directory
                                                    at once; with engine_req also through tutti's
                                                    engine in requests of that size, on the same files
    drop_page_cache(paths) -> str                   drop_caches when allowed, else fadvise per file
    raw_write_dirs(dirs, nbytes, req, threads) -> dict  O_DIRECT writes of one file per directory,
                                                    all at once: into fallocated (unwritten) space,
                                                    then as overwrites of the same, written space
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time

import numpy as np


def drop_page_cache(paths) -> str:
    """Evict files from the page cache: drop_caches when allowed, else fadvise per file."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)


def write_raw_file(path: str, nbytes: int, chunk: int = 8 << 20) -> None:
    buf = _aligned(chunk)
    buf.write(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for off in range(0, nbytes, chunk):
            os.pwritev(fd, [memoryview(buf)[: min(chunk, nbytes - off)]], off)
    finally:
        os.close(fd)


def raw_read_GBps(path: str, nbytes: int, req: int, threads: int) -> float:
    """O_DIRECT read of [0, nbytes) in `req`-byte requests over `threads` threads; GB/s.

    Requests land in distinct memory (a buffer of up to 1 GiB, as a restore fills a host pool),
    not one small reused buffer: on a RAM-backed medium the read is a memcpy, and a hot 8 MiB
    destination that stays in the CPU caches would overstate the medium (seen: 7.0 vs 4.2 GB/s)."""
    req = max(4096, req // 4096 * 4096)
    offsets = list(range(0, nbytes - req + 1, req))
    span = max(req, min(nbytes, 1 << 30) // req * req)
    buf = _aligned(span)
    np.frombuffer(buf, dtype=np.uint8)[:] = 1  # fault the pages in, as a host pool already is
    seconds = _direct_pass([path], offsets, req, threads, buf, write=False)
    return len(offsets) * req / seconds / 1e9


def raw_read_uring_GBps(path, nbytes: int, req: int, batch_nbytes: int, dirs,
                        kind: str = "auto", queue_depth: int = 0, threads: int = 8) -> float:
    """O_DIRECT read of [0, nbytes) of `path` (or of each of a list of paths, their requests
    interleaved, as a restore's pages spread over the directories) through the engine a store on
    `dirs` would open (the same kind, ring depth and bytes in flight: tutti_engine,
    tutti_queue_depth, derived from the devices when 0), in operations of exactly `req` bytes
    (never coalesced into larger ones), one engine batch per batch_nbytes as a restore submits
    one batch of pages, into distinct pre-faulted memory; GB/s. A plain file read at tutti's own
    operation size and depth."""
    from ..config import TuttiConfig
    from ..engine import extension, inflight_for, open_engine
    ext = extension()
    paths = [path] if isinstance(path, str) else list(path)
    req = max(4096, req // 4096 * 4096)
    cfg = TuttiConfig(dirs=tuple(dirs), engine=kind, queue_depth=queue_depth, threads=threads)
    depth, read_bytes, write_bytes = inflight_for(cfg)
    engine = open_engine(kind, depth, threads, read_bytes, write_bytes, max_op_bytes=req)
    try:
        per_file = np.arange(0, nbytes - req + 1, req, dtype=np.int64)
        fds = np.array([engine.open_file(p, False, True) for p in paths], dtype=np.int64)
        files = np.tile(fds, len(per_file))  # request k: file k % len(paths)
        offsets = np.repeat(per_file, len(paths))
        span = max(req, min(len(offsets) * req, 1 << 30) // req * req)
        buf = ext.AlignedBuffer(span)
        np.frombuffer(buf, dtype=np.uint8)[:] = 1  # fault the pages in, as a host pool already is
        mem = np.arange(len(offsets), dtype=np.int64) * req % span
        per = max(1, batch_nbytes // req)
        t0 = time.perf_counter()
        for i in range(0, len(offsets), per):
            res = engine.submit("read", files[i:i + per], offsets[i:i + per],
                                np.full(len(offsets[i:i + per]), req, np.int64),
                                (buf.address + mem[i:i + per]).astype(np.uint64))
            if (res != req).any():
                bad = int(res[res != req][0])
                raise OSError(-bad if bad < 0 else errno.EIO, "raw read failed", ", ".join(paths))
        return len(offsets) * req / (time.perf_counter() - t0) / 1e9
    finally:
        engine.close()


@contextlib.contextmanager
def _dir_files(dirs, nbytes: int, name: str):
    """One file of random bytes per directory (nbytes in all), out of the page cache; removed
    after. Yields (paths, bytes per file)."""
    paths, per = [], nbytes // len(dirs) // 4096 * 4096
    try:
        for d in dirs:
            paths.append(os.path.join(d, name))
            write_raw_file(paths[-1], per)
        drop_page_cache(paths)
        yield paths, per
    finally:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def raw_read_dirs(dirs, nbytes: int, reqs=(256 << 10, 8 << 20), threads: int = 8,
                  engine_req: int = 0) -> dict:
    """Raw O_DIRECT read of a same-size file per directory (nbytes in all), all directories at
    once (`threads` readers each, distinct pre-faulted memory): the sum of the per-directory
    rates, per request size, and the best of them as raw_read_GBps; with engine_req, also
    raw_engine_GBps: the same files through tutti's engine in operations of engine_req bytes,
    every directory at once (raw_read_uring_GBps), not counted in raw_read_GBps."""
    out = {}
    with _dir_files(dirs, nbytes, "raw-read.bin") as (paths, per):
        for req in reqs:
            rates = []
            ts = [threading.Thread(target=lambda p=p: rates.append(raw_read_GBps(p, per, req, threads)))
                  for p in paths]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out[f"raw_{req >> 10}KiB_GBps"] = sum(rates)
        out["raw_read_GBps"] = max(out.values())
        if engine_req:
            out["raw_engine_GBps"] = raw_read_uring_GBps(paths, per, engine_req, 256 << 20, dirs)
    return out


def _source(nbytes: int) -> mmap.mmap:
    """Distinct, pre-faulted source memory (up to 1 GiB), never all zero, as a host pool is."""
    mib = 1 << 20
    buf = _aligned(max(mib, min(nbytes, 1 << 30) // mib * mib))
    pattern = np.frombuffer(os.urandom(mib), dtype=np.uint8) | 1
    np.frombuffer(buf, dtype=np.uint8).reshape(-1, mib)[:] = pattern
    return buf


def _direct_pass(paths, offsets, req: int, threads: int, mem: mmap.mmap, write: bool) -> float:
    """O_DIRECT requests of `req` bytes at `offsets` of every path at once, `threads` threads per
    path, request k at memory offset (offset % len(mem)); returns the wall seconds."""
    span = len(mem) // req * req
    view = memoryview(mem)

    def worker(p: str, k: int) -> None:
        fd = os.open(p, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
        try:
            for off in offsets[k::threads]:
                at = off % span
                (os.pwritev if write else os.preadv)(fd, [view[at:at + req]], off)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(p, k)) for p in paths for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _write_pass(paths, per: int, req: int, threads: int, src: mmap.mmap) -> float:
    """One O_DIRECT write pass over [0, per) of every path at once; GB/s."""
    offsets = list(range(0, per - req + 1, req))
    return len(paths) * len(offsets) * req / _direct_pass(paths, offsets, req, threads, src, True) / 1e9


def raw_write_dirs(dirs, nbytes: int, req: int = 8 << 20, threads: int = 8) -> dict:
    """Raw O_DIRECT writes of nbytes split over one file per directory, every directory at once:
    first into posix_fallocate'd space (unwritten extents, as the store's segments start), then
    again over the same, now written, space (the store's steady state once it evicts)."""
    req = max(4096, req // 4096 * 4096)
    per = max(req, nbytes // len(dirs) // req * req)
    paths = [os.path.join(d, "raw-write.bin") for d in dirs]
    src = _source(per * len(dirs))
    try:
        for p in paths:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, per)
            finally:
                os.close(fd)
        pre = _write_pass(paths, per, req, threads, src)
        over = _write_pass(paths, per, req, threads, src)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return {"raw_prealloc_GBps": pre, "raw_overwrite_GBps": over, "raw_write_req": req,
            "raw_write_threads": threads}
