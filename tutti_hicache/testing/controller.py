"""SGLang's own HiCache cache controller on CPU, around the host pools of sglang.py.

At a glance:
    make_controller(backend, pool, page_size, config, zero_copy)
                                        the real dense-model controller class, made with __new__
    controller_backup, controller_hit_query, controller_transfer
                                        SGLang's _page_backup, _storage_hit_query, _page_transfer
The version differences it bridges are listed in sglang.py's docstring.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from queue import Empty, Queue
from typing import Optional, Sequence

from .sglang import ensure_sglang

def dense_controller_class():
    """The controller class SGLang builds for a dense (non-hybrid) model with HiCache."""
    ensure_sglang()
    if importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is not None:  # <= 0.5.17
        from sglang.srt.managers.cache_controller import HiCacheController

        return HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    return HybridCacheController


def _controller_host_pool(cls, host_pool):
    """What the controller keeps as mem_pool_host: a KV-only HostPoolGroup for the hybrid class."""
    from sglang.srt.managers.cache_controller import HiCacheController

    if cls is HiCacheController:
        return host_pool
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    entry = PoolEntry(
        name=PoolName.KV, host_pool=host_pool, device_pool=None,
        layer_mapper=lambda layer: layer, is_primary_index_anchor=True,
    )
    return HostPoolGroup([entry])


def _register_host_pools(ctrl, backend, host_pool) -> None:
    """The registration calls attach_storage_backend makes, in its order."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    backend.register_mem_pool_host(host_pool)
    if ctrl.mem_pool_host is not host_pool:  # 0.5.23 HybridCacheController
        for entry in ctrl.mem_pool_host.entries:
            backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    if hasattr(HiCacheStorage, "on_host_pools_registered"):  # 0.5.23
        backend.on_host_pools_registered()


def make_controller(
    backend, host_pool, page_size: int, storage_config, zero_copy: bool,
    backend_type: str = "dynamic", register: bool = True,
):
    """A real dense-model controller, made with __new__ plus what its storage I/O methods read.

    page_get_func/page_set_func are the controller's own _page_*_zero_copy (batch_*_v1) when
    `zero_copy`, else _generic_page_* (batch_get/batch_set). With `register`, the backend receives
    the host pool the way attach_storage_backend hands it over. No threads, no process groups.
    """
    cls = dense_controller_class()
    from sglang.srt.mem_cache.utils import get_hash_str

    ctrl = cls.__new__(cls)
    ctrl.storage_backend, ctrl.storage_backend_type = backend, backend_type
    ctrl.storage_config, ctrl.page_size = storage_config, page_size
    ctrl.mem_pool_host = _controller_host_pool(cls, host_pool)
    ctrl.storage_host_pool = host_pool  # read by 0.5.23 only
    ctrl.enable_storage, ctrl.has_draft, ctrl.host_memory_mode = True, False, "cache"
    ctrl.get_hash_str = get_hash_str  # 0.5.17 hashes through the instance
    ctrl.prefetch_queue, ctrl.backup_queue, ctrl.prefetch_sync_queue = Queue(), Queue(), Queue()
    ctrl.prefetch_sync_groups = ctrl.prefetch_hits_sync_groups = []  # 0.5.17 / 0.5.23 names
    ctrl.prefetch_completion_sync_groups = []
    if not isinstance(inspect.getattr_static(cls, "backup_skip", None), property):  # 0.5.17
        ctrl.backup_skip = storage_config.is_mla_model and storage_config.tp_rank != 0
    if zero_copy:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._page_get_zero_copy, ctrl._page_set_zero_copy
    else:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._generic_page_get, ctrl._generic_page_set
    if register:
        _register_host_pools(ctrl, backend, host_pool)
    return ctrl


def _take(queue: Queue) -> list:
    """Remove and return everything in `queue`."""
    items = []
    with contextlib.suppress(Empty):
        while True:
            items.append(queue.get_nowait())
    return items


def _prefetch_operation(ctrl, n_pages: int, prefix_keys: Optional[list] = None):
    """A PrefetchOperation made by the controller's own prefetch() (taken back off its queue)."""
    if list(inspect.signature(ctrl.prefetch).parameters)[0] == "handle":  # 0.5.23
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        request = CacheRequestHandle(rid="tutti-harness", attempt_id=0)
    else:
        request = "tutti-harness"
    _take(ctrl.prefetch_queue)
    ctrl.prefetch(request, list(range(n_pages * ctrl.page_size)), None, prefix_keys)
    return ctrl.prefetch_queue.get_nowait()


@contextlib.contextmanager
def _hashes_are(ctrl, keys: Sequence[str]):
    """Make the controller's page hashing return `keys` (tests choose keys, not tokens).

    Patches the module global get_storage_hash_str (0.5.23) for the duration: not thread-safe
    against a controller running its own threads in this process.
    """
    from unittest import mock

    def fake(*args, **kwargs):
        return list(keys)

    module = sys.modules[type(ctrl)._storage_hit_query.__module__]
    saved = ctrl.get_hash_str
    ctrl.get_hash_str = fake  # 0.5.17
    try:
        with contextlib.ExitStack() as stack:
            if hasattr(module, "get_storage_hash_str"):  # 0.5.23
                stack.enter_context(mock.patch.object(module, "get_storage_hash_str", fake))
            yield
    finally:
        ctrl.get_hash_str = saved


def controller_backup(ctrl, keys: Sequence[str], host_indices, prefix_keys=None) -> int:
    """Write pages through SGLang's _page_backup; return the pages it reports written.

    `host_indices`: CPU int64, len(keys) * page_size slots, page i at host_indices[i*page_size].
    Batches of STORAGE_BATCH_SIZE (128) pages; the first failed batch stops the operation.
    Backend exceptions propagate (0.5.17's backup thread would die; 0.5.23's logs them).
    A rank that must not write (MLA, not the storage writer) writes nothing and returns 0.
    """
    from sglang.srt.managers.cache_controller import HiCacheController

    ctrl.write_storage(host_indices, [0] * len(host_indices), list(keys), prefix_keys)
    operation = ctrl.backup_queue.get_nowait()
    base_thread = type(ctrl).backup_thread_func is HiCacheController.backup_thread_func
    if base_thread and ctrl.backup_skip:  # the base class's thread skips the whole operation
        return 0
    ctrl._page_backup(operation)
    return operation.completed_tokens // ctrl.page_size


def controller_hit_query(ctrl, keys: Sequence[str], prefix_keys=None) -> int:
    """Leading pages of `keys` that SGLang's _storage_hit_query reports present (batch_exists).

    Before any rank reduction or prefetch threshold. Backend exceptions propagate (0.5.23's
    prefetch thread would count 0 hits; 0.5.17's would die).
    """
    operation = _prefetch_operation(ctrl, len(keys), prefix_keys)
    with _hashes_are(ctrl, keys):
        hashes, hit_tokens = ctrl._storage_hit_query(operation)
    if list(hashes) != list(keys[: len(hashes)]):
        raise RuntimeError("the controller hashed tokens itself: key patching did not take effect")
    return hit_tokens // ctrl.page_size


def controller_transfer(ctrl, keys: Sequence[str], host_indices, prefix_keys=None) -> int:
    """Read pages into `host_indices` through SGLang's _page_transfer; return completed tokens.

    Completed tokens = the last cumulative PrefetchAck (0.5.23) or operation.completed_tokens
    (0.5.17): pages up to the first one the backend missed, whole batches of 128 after a short one
    skipped. 0.5.23 catches backend exceptions (0 pages for that batch); 0.5.17 lets them propagate.
    """
    operation = _prefetch_operation(ctrl, len(keys), prefix_keys)
    operation.hash_value = list(keys)  # as the prefetch thread and the scheduler leave it
    operation.storage_hit_count = len(keys) * ctrl.page_size
    operation.host_indices = host_indices
    _take(ctrl.prefetch_sync_queue)
    ctrl._page_transfer(operation)
    acks = [a.completed_tokens for a in _take(ctrl.prefetch_sync_queue)
            if getattr(a, "completed_tokens", None) is not None]
    return acks[-1] if acks else operation.completed_tokens


