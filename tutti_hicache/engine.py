"""Loads the C++ extension and picks the I/O engine.

At a glance:
    extension() -> module          the compiled ``tutti_hicache._engine`` (clear ImportError if absent)
    open_engine(kind, queue_depth, threads, read_inflight_bytes, write_inflight_bytes)
                                    io_uring, or the POSIX thread pool; `auto` logs why it fell back
    engine_for(cfg) -> Engine       the same from a TuttiConfig (tutti_engine, _queue_depth, ...)
    inflight_for(cfg)               (ring depth, read bytes, write bytes): tutti_queue_depth, or
                                    derived from the devices (iodepth.py)
    probe_o_direct(dir) -> bool     whether files in `dir` accept O_DIRECT

An Engine moves batches of requests given as arrays (file index, file offset, nbytes,
address): ``engine.submit("read" | "write", files, offsets, nbytes, addrs)`` returns one int32
per request (nbytes or -errno), with the GIL released for the whole batch; with
``group_starts`` (a read) it returns ``(results, sums)``, each group's XXH3-64 computed as its
last request lands (0 when one failed). ``engine.read_stream(...)`` keeps the chunks of a
many-chunk read back to back. Reads and writes have separate submission paths (two rings / two
worker pools), so one thread's write batch never waits behind another thread's read batch.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import sys
import tempfile
from types import ModuleType

from .config import TuttiConfig

logger = logging.getLogger("tutti_hicache.engine")
_ext: ModuleType | None = None
_fallback_logged = False


def extension() -> ModuleType:
    """The compiled module: the installed one, or the file named by TUTTI_EXTENSION (a sanitizer
    build that scripts/sanitize.sh made outside the package; the installed one stays as it is)."""
    global _ext
    if _ext is None:
        path = os.environ.get("TUTTI_EXTENSION")
        if path:
            _ext = _load_extension_file(path)
            return _ext
        try:
            from . import _engine  # type: ignore[attr-defined]
        except ImportError as e:
            raise ImportError(
                "tutti_hicache._engine (the C++ I/O engine) is not built; install the package "
                f"with `pip install .` (needs a C++17 compiler and cmake): {e}") from e
        _ext = _engine
    return _ext


def _load_extension_file(path: str) -> ModuleType:
    """Load `path` as tutti_hicache._engine, so a later `from . import _engine` gets it too."""
    spec = importlib.util.spec_from_file_location(f"{__package__}._engine", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"TUTTI_EXTENSION={path!r}: not a compiled extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    sys.modules[spec.name] = module
    return module


_DEFAULTS = TuttiConfig()


AUTO_RING_DEPTH = 1024  # ring entries when the bytes in flight are derived (iodepth.py)


def open_engine(kind: str = _DEFAULTS.engine, queue_depth: int = AUTO_RING_DEPTH,
                threads: int = _DEFAULTS.threads, read_inflight_bytes: int = 0,
                write_inflight_bytes: int = 0, max_op_bytes: int = 1 << 30):
    """Create an engine. kind: auto | uring | posix. `uring` raises OSError if unavailable.
    queue_depth: ring entries (operations in flight); *_inflight_bytes: io_uring's cap on bytes
    in flight per ring (0: none); max_op_bytes: the largest operation contiguous requests are
    coalesced into. Defaults are TuttiConfig's otherwise."""
    ext = extension()
    if kind not in ("auto", "uring", "posix"):
        raise ValueError(f"tutti_engine: expected auto, uring or posix, got {kind!r}")
    args = (queue_depth, threads, max_op_bytes, read_inflight_bytes, write_inflight_bytes)
    if kind in ("auto", "uring"):
        try:
            return ext.make_engine("uring", *args)
        except OSError as e:
            if kind == "uring":
                raise
            _log_fallback(e, ext.uring_compiled())
    return ext.make_engine("posix", *args)


def inflight_for(cfg: TuttiConfig) -> tuple[int, int, int]:
    """(ring depth, read bytes, write bytes) in flight: tutti_queue_depth when set, else derived
    from the devices under tutti_dirs (iodepth.derive; 0 bytes = no cap)."""
    if cfg.queue_depth:
        return cfg.queue_depth, 0, 0
    from . import iodepth
    d = iodepth.derive(cfg.dirs)
    return AUTO_RING_DEPTH, d.read_bytes, d.write_bytes


def engine_for(cfg: TuttiConfig):
    """The engine a store with this configuration uses."""
    depth, rd, wr = inflight_for(cfg)
    return open_engine(cfg.engine, depth, cfg.threads, rd, wr)


def _fallback_reason(err: OSError, compiled: bool) -> str:
    """Why `auto` fell back: a build without io_uring, or the kernel refusing it."""
    if not compiled:
        return "tutti was built without io_uring (a TUTTI_ALLOW_POSIX_ONLY=1 build)"
    return {
        errno.ENOSYS: "the kernel refused io_uring: it has none (ENOSYS)",
        errno.EPERM: "the kernel refused io_uring: blocked (EPERM, e.g. a container seccomp profile)",
        errno.EACCES: "the kernel refused io_uring: disabled (EACCES, e.g. kernel.io_uring_disabled)",
    }.get(err.errno, f"io_uring setup failed: {err}")


def _log_fallback(err: OSError, compiled: bool) -> None:
    global _fallback_logged
    if _fallback_logged:
        return
    _fallback_logged = True
    logger.warning("tutti: using the POSIX thread-pool engine: %s", _fallback_reason(err, compiled))


def probe_o_direct(directory: str) -> bool:
    """True when a file created in `directory` can be opened with O_DIRECT."""
    fd, path = tempfile.mkstemp(prefix=".tutti-probe-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        os.close(fd)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.unlink(path)
