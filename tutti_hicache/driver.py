"""The optional CUDA part of the extension: a few CUDA driver API calls, loaded at first use.

At a glance:
    available() -> (ok, reason)              the driver loads and cuInit succeeds (cached)
    green_stream(device, num_sms) -> (CUstream handle, SMs)   a green context's stream
    HostWords(device, n)                     n zeroed int32 words of pinned, device-mapped host
                                             memory: .address (CPU), .device_address (GPU)
    wait_value32(device, stream, device_address, value)   the stream waits until the word,
                                             compared cyclically, is >= value (GPU side)
    TERMINAL                                 the value a failed or cancelled load releases with

The C++ side (cpp/src/cuda_shim.cpp) dlopen()s libcuda.so.1 on the first call and resolves
every entry point through cuGetProcAddress, so the package builds and imports without CUDA;
importing this module loads nothing. A failing driver call raises RuntimeError naming the call
and its CUresult.
"""

from __future__ import annotations

import functools

from .engine import extension

__all__ = ["available", "green_stream", "HostWords", "wait_value32", "TERMINAL"]


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


def green_stream(device: int, num_sms: int) -> tuple[int, int]:
    """A stream of a new green context of at least num_sms SMs of `device` (never destroyed):
    (CUstream handle for torch.cuda.ExternalStream, SMs it holds). Raises RuntimeError."""
    return tuple(extension().green_stream(device, num_sms))


def HostWords(device: int, n: int):  # noqa: N802 (the C++ class)
    return extension().HostWords(device, n)


def wait_value32(device: int, stream: int, device_address: int, value: int) -> None:
    extension().stream_wait_value32(device, stream, device_address, value)


def __getattr__(name: str):
    if name == "TERMINAL":
        return extension().GATE_TERMINAL
    raise AttributeError(name)
