"""Drive SGLang's own HiCache L2<->L3 code on CPU, for tests, the demo and the benchmark.

Primitives at a glance:
    ensure_sglang(), sglang_version()   import SGLang's HiCache modules (torchvision stub if needed)
    make_storage_config(...)            a real HiCacheStorageConfig
    make_mha_host_pool(...), make_mla_host_pool(...)
                                        real host KV pools on CPU (pin_memory=False), SGLang's
                                        10 GiB free-memory reserve lowered to 256 MiB meanwhile
    fill_random(pool, host_indices, seed), page_bytes(pool, host_indices)
    (controller.py: SGLang's own cache controller driven on these pools)
    make_page_keys(n, seed)             64-hex page keys

SGLang is imported lazily inside functions: importing this module needs neither SGLang nor torch.
Supported: SGLang 0.5.17 and 0.5.23. Differences met (0.5.17 -> 0.5.23):
  - Dense-model controller: HiCacheController (built by HiRadixCache) -> HybridCacheController, a
    HiCacheController subclass (HiRadixCache is gone; every model uses UnifiedRadixCache).
  - controller.mem_pool_host: the KV host pool -> a HostPoolGroup whose anchor entry is that pool;
    0.5.23 adds controller.storage_host_pool (the KV pool) and reads and writes pages through it.
  - MHA/MLATokenToKVPoolHost(device_pool, ...) -> (buffer_info, ..., *, device_capacity_tokens,
    start_layer, end_layer[, target_layer_num for MLA]), buffer_info taken from
    device_pool.get_device_pool_infos()[0]. Device pool constructors are unchanged.
  - backup_skip: an attribute set at attach (MLA and tp_rank != 0) -> a property,
    `not storage_config.is_storage_writer`.
  - HiCacheStorageConfig gains dp_rank, dcp_size, dcp_rank, logical_page_size, is_storage_writer.
  - Attach: register_mem_pool_host(pool) -> then register_mem_host_pool_v2(pool, name) per group
    entry and on_host_pools_registered() (not in 0.5.17's HiCacheStorage).
  - PrefetchOperation(request_id: str, ...) -> (handle: CacheRequestHandle, ...), no increment().
  - _page_get_zero_copy/_generic_page_get: add tokens via operation.increment() -> return pages.
  - _page_transfer: result only in operation.completed_tokens, no exception handling (a raising
    backend kills 0.5.17's prefetch io thread; a short batch_get_v1 list raises IndexError) ->
    catches per batch (0 pages), puts one PrefetchAck per batch (cumulative completed_tokens) on
    prefetch_sync_queue; the hybrid subclass returns None.
  - _storage_hit_query: self.get_hash_str and batch_exists per 128 keys -> module-level
    get_storage_hash_str; the hybrid subclass calls batch_exists once with all keys.
  - _page_backup: exceptions escape in both; 0.5.17's backup thread then dies, 0.5.23's thread
    calls _page_backup_or_log. The hybrid subclass holds mem_pool_host.layout_lease() around it.
  - 0.5.17 extends prefix_keys in place (`+=`) between batches; 0.5.23 builds new lists.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import warnings
from typing import Any, Optional

from .torchvision_stub import install_torchvision_stub

_SGLANG_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
)

INSTALL_HINT = ("install SGLang 0.5.17-0.5.23 with its dependencies: pip install "
                "'tutti-hicache[sglang]' (or pip install 'sglang==0.5.23')")

# Warnings that third-party code emits while SGLang is imported on a CPU-only torch; ignored only
# during that import. (category, regex matched at the start of the message)
_IMPORT_WARNINGS = (
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),  # torch internals
    (UserWarning, r"Only CUDA, .* support (AWQ|GGUF)"),  # sglang quantization modules
    (UserWarning, r"Triton is not supported on current platform"),  # sglang 0.5.17 fla utils
)


# --------------------------------------------------------------------------- import


def sglang_version() -> str:
    """Installed SGLang version, from package metadata (SGLang is not imported).

    Raises ImportError with an install hint when SGLang is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        raise ImportError(f"SGLang is not installed; {INSTALL_HINT}", name="sglang") from None


def ensure_sglang() -> str:
    """Import SGLang's storage, host-pool and controller modules; return the SGLang version.

    Installs the torchvision stub first when needed. Raises ImportError with an install hint when
    SGLang or one of its small dependencies is missing. ~4-5 s the first time, then cheap.
    """
    ver = sglang_version()
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"SGLang's package metadata is installed but not the package; "
                          f"{INSTALL_HINT}", name="sglang")
    install_torchvision_stub()
    with warnings.catch_warnings():
        for category, message in _IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for name in _SGLANG_MODULES:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ImportError(
                    f"SGLang {ver} is installed but {name} does not import ({exc}); "
                    f"{INSTALL_HINT}", name="sglang"
                ) from exc
    return ver


# --------------------------------------------------------------------------- config and pools


def make_storage_config(
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    is_page_first_layout: bool = False,
    model_name: Optional[str] = "test-model",
    extra_config: Optional[dict] = None,
    **kw: Any,
):
    """A real HiCacheStorageConfig; `kw` sets any other field of the installed version.

    Fields absent from the installed version are left out of the defaults; passing one in `kw`
    raises TypeError (e.g. dp_rank on 0.5.17). extra_config defaults to {} as SGLang's attach does.
    """
    ensure_sglang()
    import dataclasses

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values = dict(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=False,
        is_page_first_layout=is_page_first_layout, model_name=model_name,
        extra_config=dict(extra_config or {}),
    )
    fields = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
    values = {k: v for k, v in values.items() if k in fields}
    values.update(kw)
    return HiCacheStorageConfig(**values)


# SGLang refuses a host pool unless free memory minus HICACHE_HOST_MEMORY_RESERVE_BYTES (10 GiB, a
# server's margin for the rest of the machine; a module global of pool_host/base.py in 0.5.17 and
# 0.5.23) holds it. The pools built here are sized by their callers (kilobytes to megabytes in the
# tests), so while building one the reserve is this instead: a machine with a few GB free passes.
HOST_MEMORY_RESERVE_BYTES = 256 << 20


class HostMemoryShort(MemoryError):
    """SGLang refused a host pool even with HOST_MEMORY_RESERVE_BYTES kept free (tests skip)."""


@contextlib.contextmanager
def _host_memory_reserve(nbytes: int):
    """SGLang's host-memory reserve set to `nbytes` for the duration (restored after)."""
    from sglang.srt.mem_cache.pool_host import base

    saved, base.HICACHE_HOST_MEMORY_RESERVE_BYTES = base.HICACHE_HOST_MEMORY_RESERVE_BYTES, nbytes
    try:
        yield
    finally:
        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = saved


def _build_host_pool(cls, device_pool, layout: str, page_size: int, n_pages: int,
                     pin_memory: bool = False, **extra):
    """Host pool of `n_pages` pages (+1 padding page SGLang adds) over a one-page device pool.

    Raises HostMemoryShort when SGLang finds too little free memory for it beside
    HOST_MEMORY_RESERVE_BYTES."""
    ratio = float(n_pages)  # host tokens = device tokens (one page) * ratio
    if "buffer_info" in inspect.signature(cls.__init__).parameters:  # 0.5.23
        first = device_pool.get_device_pool_infos()[0].buffer_info
        extra.update(
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
        )
    else:  # 0.5.17: built from the device pool itself
        first = device_pool
        extra.clear()
    try:
        with _host_memory_reserve(HOST_MEMORY_RESERVE_BYTES):
            pool = cls(first, ratio, 0, page_size, layout, pin_memory=pin_memory, device="cpu", **extra)
    except ValueError as exc:
        if "Not enough host memory" in str(exc):
            raise HostMemoryShort(f"SGLang refused a host pool of {n_pages} pages: {exc}") from exc
        raise
    pool._tutti_device_pool = device_pool  # keep the device tensors alive (0.5.23 keeps only views)
    return pool


def make_mha_host_pool(layout, layer_num, head_num, head_dim, page_size, dtype, n_pages,
                       pin_memory=False):
    """Real MHATokenToKVPoolHost on CPU; layout: layer_first|page_first|page_first_direct|page_head.

    Allocatable slots: (n_pages + 1) * page_size tokens (SGLang adds one padding page).
    """
    ensure_sglang()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device_pool = MHATokenToKVPool(
        size=page_size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
        layer_num=layer_num, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )
    return _build_host_pool(MHATokenToKVPoolHost, device_pool, layout, page_size, n_pages,
                            pin_memory)


def make_mla_host_pool(
    layout, layer_num, kv_lora_rank, qk_rope_head_dim, page_size, dtype, n_pages, pin_memory=False
):
    """Real MLATokenToKVPoolHost on CPU, `layout` in layer_first|page_first|page_first_direct.

    Allocatable slots: (n_pages + 1) * page_size tokens (SGLang adds one padding page).
    """
    ensure_sglang()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device_pool = MLATokenToKVPool(
        size=page_size, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, device="cpu",
        enable_memory_saver=False,
    )
    return _build_host_pool(
        MLATokenToKVPoolHost, device_pool, layout, page_size, n_pages, pin_memory,
        target_layer_num=layer_num,
    )


def _page_starts(host_pool, host_indices) -> list[int]:
    """First slot of each page of `host_indices` (len must be a multiple of the page size)."""
    page_size = host_pool.page_size
    if len(host_indices) % page_size:
        raise ValueError(f"{len(host_indices)} slots is not whole {page_size}-token pages")
    return [int(i) for i in host_indices[::page_size]]


def fill_random(host_pool, host_indices, seed: int) -> None:
    """Fill the pages of `host_indices` with random bytes, none zero, via SGLang's own setter."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    template = host_pool.get_dummy_flat_data_page()
    nbytes = template.numel() * template.element_size()
    for start in _page_starts(host_pool, host_indices):
        raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        host_pool.set_from_flat_data_page(start, raw.view(template.dtype))


def page_bytes(host_pool, host_indices) -> list[bytes]:
    """Bytes of each page of `host_indices`, in the pool's flat page order (get_data_page).

    Comparable between pages of pools with the same layout and geometry.
    """
    import torch

    out = []
    for start in _page_starts(host_pool, host_indices):
        page = host_pool.get_data_page(start, flat=True).contiguous()
        out.append(page.view(torch.uint8).numpy().tobytes())
    return out


def make_page_keys(n: int, seed: int = 0) -> list[str]:
    """`n` distinct 64-hex keys: a sha256 chain, like SGLang's page hashes (not token-derived)."""
    keys, digest = [], hashlib.sha256(f"tutti-harness-{seed}".encode()).digest()
    for i in range(n):
        digest = hashlib.sha256(digest + i.to_bytes(4, "little")).digest()
        keys.append(digest.hex())
    return keys
