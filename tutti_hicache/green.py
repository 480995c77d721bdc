"""An SM partition for I/O kernels: a CUDA stream whose kernels run on a few SMs only (green contexts, Hopper).

Primitives at a glance:

* ``io_stream(num_sms=8, device=None) -> IOStream``: the I/O stream of a device, created once and cached per
  (device, num_sms); thread-safe. ``num_sms=0`` asks for no partition: an ordinary high-priority stream.
* ``IOStream``: ``.stream`` (a ``torch.cuda.Stream`` for ``with torch.cuda.stream(...)``, or None),
  ``.kind`` ("green", "priority" or "none"), ``.num_sms``, ``.reason``, ``.device``.

"green": kernels on ``.stream`` are confined to ``.num_sms`` SMs of a green context, made by the extension's CUDA
part (driver API, ``driver.green_stream``; ``torch.cuda.green_contexts`` when that fails), so restore/offload
kernels leave the other SMs to the forward pass. The forward's kernels may still use every SM: the partition bounds the I/O, not the compute.
The driver API's stream has the greatest priority, so the I/O kernels' blocks start before the forward's queued ones
on the partition's SMs (torch's fallback takes its GreenContext's own stream).
"priority": no partition was asked for (``num_sms=0``), or green contexts are unavailable (pre-sm_90 GPU, old
driver); ``.stream`` is an ordinary stream of the highest priority and may use every SM. "none": no CUDA; ``.stream`` is None.
Every outcome is logged once, with its reason, on the logger ``tutti_hicache.green``.

Importing this module touches neither CUDA nor the driver; both load on the first ``io_stream`` call.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (9, 0)
_lock = threading.Lock()
_cache: dict = {}


@dataclass(frozen=True)
class IOStream:
    """A stream for I/O kernels. ``num_sms``: SMs its kernels may occupy (all of the device's for "priority",
    0 for "none"). ``reason``: why this kind was chosen. ``device``: CUDA device index, None for "none"."""

    stream: Optional[Any]
    kind: str
    num_sms: int
    reason: str
    device: Optional[int] = None
    _owner: Any = field(default=None, repr=False, compare=False)  # keeps the green context alive


def io_stream(num_sms: int = 8, device=None) -> IOStream:
    """Return the cached I/O stream of ``device`` (index, ``torch.device`` or None for the current device)
    with kernels confined to at least ``num_sms`` SMs (the driver rounds up to its granularity, 8 on sm_90);
    0: a high-priority stream on every SM (tutti_io_sms=0). Never raises for a missing capability: it
    falls back to "priority" or "none" and logs why, once."""
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 0:
        raise ValueError(f"num_sms must be a non-negative int, got {num_sms!r}")
    index = _device_index(device)
    with _lock:
        key = (index, num_sms)
        if key not in _cache:
            _cache[key] = _create(index, num_sms)
            result = _cache[key]
            logger.info("I/O stream on device %s: %s, %d SMs (%s)", index, result.kind, result.num_sms,
                        result.reason)
        return _cache[key]


def _device_index(device) -> Optional[int]:
    """CUDA device index of ``device``; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if isinstance(device, int):
        return device
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"io_stream needs a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def _create(index: Optional[int], num_sms: int) -> IOStream:
    if index is None:
        return IOStream(None, "none", 0, "CUDA is not available")
    capability, total = _device_facts(index)
    if num_sms == 0:
        return _priority(index, total, "no SM partition asked for (num_sms=0)")
    if capability < MIN_CAPABILITY:
        return _priority(index, total, f"green contexts need sm_90+, device is sm_{capability[0]}{capability[1]}")
    if num_sms >= total:
        return _priority(index, total, f"{num_sms} SMs asked, the device has {total}")
    errors = []
    for label, make in (("driver API", _driver_green), ("torch.cuda.green_contexts", _torch_green)):
        try:
            return make(index, num_sms)
        except Exception as exc:  # any failure means: this way is unavailable here
            errors.append(f"{label}: {exc}")
    return _priority(index, total, "green contexts unavailable: " + "; ".join(errors))


def _device_facts(index: int) -> tuple:
    """((major, minor) compute capability, SM count) of a device."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def _priority(index: int, total_sms: int, reason: str) -> IOStream:
    stream = torch.cuda.Stream(device=index, priority=-1)
    return IOStream(stream, "priority", total_sms, reason + "; using a high-priority stream", index)


def _init_primary_context(index: int) -> None:
    """Green contexts are created beside the device's primary context, which torch creates lazily."""
    torch.zeros(1, device=torch.device("cuda", index))


def _torch_green(index: int, num_sms: int) -> IOStream:
    """``torch.cuda.green_contexts`` (torch builds whose GreenContext has ``Stream()``)."""
    from torch.cuda import green_contexts

    if not getattr(green_contexts, "SUPPORTED", False):
        raise RuntimeError("torch was built without green contexts")
    if not hasattr(green_contexts.GreenContext, "Stream"):
        raise RuntimeError("this torch's GreenContext has no Stream()")
    _init_primary_context(index)
    ctx = green_contexts.GreenContext.create(num_sms=num_sms, device_id=index)
    _keep_for_process_lifetime(ctx)
    return IOStream(ctx.Stream(), "green", num_sms, "torch.cuda.green_contexts", index, _owner=ctx)


def _keep_for_process_lifetime(obj) -> None:
    """Never destroy a green context: at interpreter exit tensors allocated on its stream may be
    freed after module teardown, and destroying the context first aborts the process
    ("context is destroyed"). One extra reference keeps it until the OS reclaims it."""
    import ctypes
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _driver_green(index: int, num_sms: int) -> IOStream:
    """The extension's CUDA part: split the SMs, create a green context and a stream in it (C++)."""
    from . import driver

    ok, why = driver.available()
    if not ok:
        raise RuntimeError(why)
    _init_primary_context(index)
    handles, sms = driver.green_streams(index, num_sms)
    stream = torch.cuda.ExternalStream(handles[0], device=torch.device("cuda", index))
    return IOStream(stream, "green", sms, "driver API (tutti_hicache._engine)", index)
