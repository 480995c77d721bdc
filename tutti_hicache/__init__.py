"""tutti_hicache: NVMe SSD as a first-class KV-cache tier for SGLang HiCache.

Importing the package needs nothing optional: SGLang, CUDA, Triton and the C++ extension
load only when the piece that needs them is used, with an ImportError naming what is missing.

    from tutti_hicache import TuttiStorage   # SGLang HiCacheStorage backend (needs sglang)
    from tutti_hicache import TuttiLinker    # SGLang UnifiedCacheLinker (needs sglang 0.5.23)
    from tutti_hicache import ObjectStore, TuttiConfig
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "TuttiStorage": ("storage", "SGLang (pip install 'sglang>=0.5.17,<=0.5.23' --no-deps)"),
    "TuttiLinker": ("linker", "SGLang 0.5.23 (pip install sglang==0.5.23 --no-deps)"),
    "ObjectStore": ("store", "the C++ extension (reinstall tutti-hicache from source)"),
    "TuttiConfig": ("config", ""),
    "PageGeometry": ("layout", ""),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tutti_hicache' has no attribute {name!r}")
    module, needs = _LAZY[name]
    try:
        mod = importlib.import_module(f".{module}", __name__)
    except ImportError as e:
        raise ImportError(f"tutti_hicache.{name} needs {needs}: {e}") from e
    return getattr(mod, name)
