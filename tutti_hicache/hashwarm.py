"""SGLang's page-hash module, built at attach instead of inside the first request.

With a storage tier or an external linker, SGLang keys every page by a hash chain (its
`get_hash_str`), which 0.5.23 computes in a C++ module that torch's cpp_extension compiles on
first use: on a fresh machine ninja ran for ~9 s inside the first request's prefix match (the
scheduler's main thread, SGLang's `UnifiedCacheLinkerWrapper._tail_hashes`), and after a
restart the up-to-date check and load still cost the first match a few hundred ms. Both tutti
front doors start that build on a background thread at attach, while the server captures its CUDA
graphs; a request that arrives before it ends waits on torch's build lock, never builds twice.

At a glance:
    start() -> threading.Thread | None     begins the build (once per process; None where this
                                           SGLang has no native hash module, or it is loaded)
Failure is logged and left to SGLang, which builds (or fails) on its own path as before.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Optional

logger = logging.getLogger("tutti_hicache.storage")

_MODULE = "sglang.srt.mem_cache.cpp_utils.native_hash"
_lock = threading.Lock()
_thread: Optional[threading.Thread] = None


def _loader():
    """SGLang's cached loader of the hash module, or None where this SGLang has none (0.5.17)."""
    try:
        mod = importlib.import_module(_MODULE)
    except ImportError:
        return None
    return getattr(mod, "_load_native_hash_module", None)


def _build(load) -> None:
    t0 = time.perf_counter()
    try:
        load()
    except Exception as e:  # SGLang's own first hash raises the same, with its message
        logger.warning("tutti: building SGLang's page-hash module at attach failed (%s); SGLang "
                       "builds it at the first request instead", e)
        return
    logger.info("tutti: SGLang's page-hash module ready in %.1f s (built at attach, not in the "
                "first request)", time.perf_counter() - t0)


def start() -> Optional[threading.Thread]:
    global _thread
    load = _loader()
    if load is None:
        return None
    cache_info = getattr(load, "cache_info", None)
    if cache_info is not None and cache_info().currsize:
        return None  # already loaded in this process
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build, args=(load,), name="tutti-hashwarm",
                                       daemon=True)
            _thread.start()
        return _thread
