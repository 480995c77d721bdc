"""SGLang plugin: makes ``tutti`` a backend name without patching SGLang.

Entry point ``tutti = "tutti_hicache.plugin:register"`` in the ``sglang.srt.plugins`` group.
SGLang runs ``register()`` in every process before parsing arguments; it registers hooks
that SGLang applies right after:

  * argparse: ``tutti`` and ``tutti-mooncake`` join the choices of ``--hicache-storage-backend``,
    ``tutti`` also those of (SGLang 0.5.23) ``--unified-cache-external-linker-backend``;
  * the storage factory: ``tutti`` is registered lazily and built as
    ``TuttiStorage(storage_config, mem_pool_host)``, ``tutti-mooncake`` as
    ``TieredStorage(...)`` (tiered.py: local SSD tier + Mooncake cluster tier);
  * the cache controller: after attaching either, the zero-copy page functions
    (``batch_get_v1``/``batch_set_v1``) are selected, as SGLang does for its own zero-copy
    backends;
  * the linker factory (0.5.23): backend ``tutti`` builds ``TuttiLinker`` with the given
    ``--unified-cache-external-linker-config`` as its extra config;
  * the linker's load-back (0.5.23): prefix tokens that TuttiLinker restores from the SSD are
    reported as ``storage`` in ``cached_tokens_details`` and SGLang's storage-hit metrics (SGLang
    files every external-linker hit under ``host``, a tier the linker path does not have).

On an SGLang version outside the supported range, or whose hook targets are missing,
``register()`` raises with a message naming the version: SGLang logs the failure at plugin
load, and ``--hicache-storage-backend tutti`` is then rejected by argparse (never silently
served by something else).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re

logger = logging.getLogger("tutti_hicache.plugin")

SUPPORTED = ((0, 5, 17), (0, 5, 23))
NAME = "tutti"
TIERED = "tutti-mooncake"
# storage backend name -> (module, class)
BACKENDS = {NAME: ("tutti_hicache.storage", "TuttiStorage"),
            TIERED: ("tutti_hicache.tiered", "TieredStorage")}
_FACTORY = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory"
_CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"
_LINKER_FACTORY = "sglang.srt.mem_cache.unified_cache.linker_factory"
_LINKER = "sglang.srt.mem_cache.unified_cache.unified_cache_linker"


def _version_tuple(text: str) -> tuple:
    """(major, minor, patch) from a version string: the leading digits of each of its first three
    parts, so a pre-release or local tag never joins the patch number ("0.5.2rc2" is 0.5.2)."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if m is None:
        return (0, 0, 0)
    return tuple(int(g or 0) for g in m.groups())


def check_version(version: str | None = None) -> str:
    """Return SGLang's version, or raise RuntimeError when tutti does not support it."""
    version = version or importlib.metadata.version("sglang")
    if not SUPPORTED[0] <= _version_tuple(version) <= SUPPORTED[1]:
        raise RuntimeError(
            f"tutti_hicache plugin: SGLang {version} is not supported (supported: "
            f"{'.'.join(map(str, SUPPORTED[0]))} to {'.'.join(map(str, SUPPORTED[1]))}); "
            f"--hicache-storage-backend {NAME} stays unavailable")
    return version


def _add_choices(result, parser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args: add `tutti` (and `tutti-mooncake`) to the backend choices."""
    names = {"hicache_storage_backend": list(BACKENDS),
             "unified_cache_external_linker_backend": [NAME]}
    for action in parser._actions:
        if action.dest in names and action.choices is not None:
            new = [n for n in names[action.dest] if n not in action.choices]
            if new:
                action.choices = list(action.choices) + new
    return result


def _create_backend(orig, cls, backend_name, storage_config, mem_pool_host, **kwargs):
    """AROUND StorageBackendFactory.create_backend: register `tutti` / `tutti-mooncake` on first use."""
    if backend_name in BACKENDS and backend_name not in cls._registry:
        cls.register_backend(backend_name, *BACKENDS[backend_name])
    return orig(cls, backend_name, storage_config, mem_pool_host, **kwargs)


def _create_builtin(orig, cls, backend_name, backend_class, storage_config, mem_pool_host):
    """AROUND StorageBackendFactory._create_builtin_backend: construct TuttiStorage/TieredStorage."""
    if backend_name in BACKENDS:
        return backend_class(storage_config, mem_pool_host)
    return orig(cls, backend_name, backend_class, storage_config, mem_pool_host)


def _zero_copy(result, self, *args, **kwargs):
    """AFTER HiCacheController.attach_storage_backend: pick the zero-copy page functions."""
    if getattr(self, "storage_backend_type", None) in BACKENDS and getattr(self, "enable_storage", False):
        self.page_get_func = self._page_get_zero_copy
        self.page_set_func = self._page_set_zero_copy
        logger.info("tutti: zero-copy batch_get_v1/batch_set_v1 selected")
    return result


def _create_linker(orig, server_args, params, *, backend, config, components,
                   forward_stream=None, **kwargs):
    """AROUND create_unified_cache_linker: backend `tutti` -> TuttiLinker via `dynamic`."""
    if backend == NAME:
        backend = "dynamic"
        config = {"linker": "TuttiLinker", "linker_module_path": "tutti_hicache.linker",
                  "linker_extra_config": dict(config or {})}
    return orig(server_args, params, backend=backend, config=config, components=components,
                forward_stream=forward_stream, **kwargs)


def _linker_hits_are_storage(result, self, req, *args, **kwargs):
    """AFTER UnifiedCacheLinkerWrapper.load_back: a TuttiLinker hit came from the SSD (`storage`)
    unless every page of it comes from its DRAM tier (then SGLang's `host` stays)."""
    loaded = result[0] if isinstance(result, tuple) and result else 0
    linker = getattr(self, "cache_linker", None)
    if loaded and type(linker).__name__ == "TuttiLinker":
        kv = getattr(linker, "kv", None)
        req.host_hit_is_storage = not (kv is not None and kv.from_dram(getattr(req, "rid", None)))
    return result


def hooks(version: str) -> list[tuple[str, object, str]]:
    """(target, hook, type) triples for this SGLang version."""
    out = [
        ("sglang.srt.server_args.ServerArgs.add_cli_args", _add_choices, "AFTER"),
        (f"{_FACTORY}.create_backend", _create_backend, "AROUND"),
        (f"{_FACTORY}._create_builtin_backend", _create_builtin, "AROUND"),
        (f"{_CONTROLLER}.attach_storage_backend", _zero_copy, "AFTER"),
    ]
    if _version_tuple(version) >= (0, 5, 23):
        out.append((f"{_LINKER_FACTORY}.create_unified_cache_linker", _create_linker, "AROUND"))
        out.append((f"{_LINKER}.UnifiedCacheLinkerWrapper.load_back", _linker_hits_are_storage, "AFTER"))
    return out


def register() -> None:
    """Entry point run by SGLang's plugin loader."""
    version = check_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks(version):
        HookRegistry.register(target, hook, getattr(HookType, kind))
    logger.info("tutti_hicache plugin registered for SGLang %s", version)
