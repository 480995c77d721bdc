"""An import-only stand-in for torchvision, so SGLang imports beside a CPU build of torch.

PyPI's torchvision wheels need a CUDA torch ("operator torchvision::nms does not exist" beside a CPU
build), and SGLang's model and multimodal modules import it at module level. The stub answers those
imports with placeholder modules; nothing in the storage or linker path calls into them.

    install_torchvision_stub() -> bool   installed (False: a working torchvision is there already)
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

class InterpolationMode(enum.Enum):
    """Same members as torchvision.transforms.InterpolationMode (transformers reads several)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Placeholder:
    """Stands in for any torchvision class or function: constructible, callable, subclassable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Placeholder":
        return _Placeholder()

    def __getattr__(self, name: str) -> "_Placeholder":
        return _Placeholder()


class _StubModule(types.ModuleType):
    """`torchvision` or any submodule; every public attribute is a placeholder."""

    __path__: list = []
    __version__ = "0.28.0+stub"  # transformers compares torchvision versions

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return InterpolationMode if name == "InterpolationMode" else _Placeholder


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder that serves `torchvision` and `torchvision.*` from _StubModule."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _real_torchvision_works() -> bool:
    """True when a real torchvision imports (PyPI's CUDA wheel fails next to a CPU torch)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # e.g. RuntimeError: operator torchvision::nms does not exist
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def _transformers_caches_torchvision_probe() -> bool:
    """transformers >= 5.19 lru-caches is_torchvision_available() (5.19.0 does, 5.12.1 does not)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("transformers")) >= Version("5.19")
    except PackageNotFoundError:
        return False


def install_torchvision_stub() -> bool:
    """Make `import torchvision` work when the real one cannot be imported; True if stubbed.

    With transformers >= 5.19 (SGLang 0.5.23) transformers is asked first, so it caches "no
    torchvision" and never touches the stub. Older transformers (5.12.1, SGLang 0.5.17) does
    not cache the answer, and importing it before the stub makes AutoImageProcessor a
    torchvision-gated dummy that SGLang 0.5.17 calls at import: there the stub goes in before
    transformers is imported, which must therefore not have happened yet. Idempotent.
    """
    if any(isinstance(f, _TorchvisionStubFinder) for f in sys.meta_path):
        return True
    if _real_torchvision_works():
        return False
    if _transformers_caches_torchvision_probe():
        from transformers.utils.import_utils import is_torchvision_available

        is_torchvision_available()
    sys.meta_path.insert(0, _TorchvisionStubFinder())
    return True
