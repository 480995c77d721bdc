"""The optional CUDA part of the extension: a few CUDA driver API calls, loaded at first use.

At a glance:
    available() -> (ok, reason)              the driver loads and cuInit succeeds (cached)
    green_streams(device, num_sms, n) -> ([CUstream handles], SMs)   n streams of one green context

The C++ side (cpp/src/cuda_shim.cpp) dlopen()s libcuda.so.1 on the first call and resolves
every entry point through cuGetProcAddress, so the package builds and imports without CUDA;
importing this module loads nothing. A failing driver call raises RuntimeError naming the call
and its CUresult.
"""

from __future__ import annotations

import functools

from .engine import extension

__all__ = ["available", "green_streams"]


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") when the CUDA driver loaded; else (False, why). Never raises."""
    try:
        ext = extension()
    except ImportError as e:
        return False, str(e)
    if ext.cuda_available():
        return True, ""
    return False, ext.cuda_reason()


def green_streams(device: int, num_sms: int, n: int = 1) -> tuple[list, int]:
    """n streams of a new green context of at least num_sms SMs of `device` (never destroyed):
    (CUstream handles for torch.cuda.ExternalStream, SMs it holds). Raises RuntimeError."""
    handles, sms = extension().green_streams(device, num_sms, n)
    return list(handles), int(sms)
