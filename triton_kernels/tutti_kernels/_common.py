"""Input checks, launch geometry and byte views shared by ``scatter.py`` and ``gather.py``.

Primitives at a glance:

* ``plan_layer`` / ``plan_pages``: check a launcher's inputs (raising ``ValueError``) and return a ``Plan``
  with word-typed views, sizes in words, grid and meta-parameters; ``plan_rows`` likewise for ``scatter_rows``.
* ``launch_layer`` / ``launch_pages``: launch a scatter or gather kernel (both share one signature) from a plan.
* ``staging_objects`` / ``pool_pages``: byte views used by the plain-torch references.

Vocabulary: an *object* is one (page, layer, K|V) region of ``page_size * H * D * itemsize`` bytes; a *word* is
the widest of 8/4/2/1 bytes that divides every size and base address of a launch, so the compiled kernels move
16-byte vectors when the data allows it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MAX_BLOCK_BYTES = 16384  # bytes of one object that one program copies
MAX_PROGRAMS = 2**31 - 1  # grid axis 0 limit
PAGE_ID_DTYPES = (torch.int32, torch.int64)


class Plan(NamedTuple):
    """A checked launch. Sizes are in words of ``word_bytes``; ``bufs`` are word views of the pool buffers
    (per layer: (k, v) or (kv,)); ``table`` is the int64 pointer table of the all-layers kernel, else None."""

    staging: torch.Tensor
    bufs: tuple
    page_ids: torch.Tensor
    num_pages: int
    obj_words: int
    stride_words: int
    word_bytes: int
    chunks: int
    block: int
    num_warps: int
    table: Optional[torch.Tensor] = None
    aligned16: bool = False


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(kernel, JITFunction)


def _fail(where: str, msg: str):
    raise ValueError(f"{where}: {msg}")


def pool_geometry(where: str, name: str, buf, page_size: int) -> tuple:
    """Return ``(object_bytes, num_pages)`` of one contiguous pool buffer.

    NHD ``[rows, H, D]``: page p is rows ``[p*page_size, (p+1)*page_size)``, ``num_pages = rows // page_size``.
    HND ``[num_pages, H, page_size, D]``: page p is ``buf[p]``. Either way page p's object starts at byte
    ``p * object_bytes``.
    """
    if not isinstance(buf, torch.Tensor):
        _fail(where, f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if not buf.is_contiguous():
        _fail(where, f"{name} must be contiguous, got shape {tuple(buf.shape)} strides {buf.stride()}")
    if buf.dim() == 3:
        rows, heads, dim = buf.shape
        return page_size * heads * dim * buf.element_size(), rows // page_size
    if buf.dim() == 4:
        pages, heads, page_rows, dim = buf.shape
        if page_rows != page_size:
            _fail(where, f"{name} is HND {tuple(buf.shape)} but page_size is {page_size}")
        return heads * page_rows * dim * buf.element_size(), pages
    _fail(where, f"{name} must be NHD [rows, H, D] or HND [pages, H, page_size, D], got {tuple(buf.shape)}")


def _check_pool(where: str, layers: Sequence[Sequence[torch.Tensor]], page_size: int, device) -> tuple:
    """Check every buffer (same device, dtype, shape); return ``(object_bytes, num_pages)``."""
    if not isinstance(page_size, int) or page_size < 1:
        _fail(where, f"page_size must be a positive int, got {page_size!r}")
    first = layers[0][0]
    for layer, bufs in enumerate(layers):
        for j, buf in enumerate(bufs):
            name = "kv_buf" if len(bufs) == 1 else ("k_buf", "v_buf")[j]
            name = f"{name}s[{layer}]" if len(layers) > 1 else name
            geometry = pool_geometry(where, name, buf, page_size)
            if buf.device != device:
                _fail(where, f"{name} is on {buf.device}, staging on {device}")
            if buf.dtype != first.dtype or buf.shape != first.shape:
                _fail(where, f"{name} is {buf.dtype} {tuple(buf.shape)}, expected {first.dtype} "
                      f"{tuple(first.shape)} like the first buffer")
    return geometry


def _check_page_ids(where: str, page_ids, device, num_pages: int, check_bounds: bool) -> torch.Tensor:
    """Check page ids; bounds are checked on CPU tensors always, on GPU tensors only when ``check_bounds``
    (that check synchronizes). Unchecked out-of-range ids are skipped by the kernels' masks."""
    if not isinstance(page_ids, torch.Tensor) or page_ids.dtype not in PAGE_ID_DTYPES:
        _fail(where, f"page_ids must be an int32 or int64 tensor, got {getattr(page_ids, 'dtype', page_ids)!r}")
    if page_ids.dim() != 1:
        _fail(where, f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_ids.device != device:
        _fail(where, f"page_ids is on {page_ids.device}, staging on {device}")
    if page_ids.numel() and (check_bounds or page_ids.device.type == "cpu"):
        low, high = int(page_ids.min()), int(page_ids.max())
        if low < 0 or high >= num_pages:
            _fail(where, f"page_ids must lie in [0, {num_pages}), got min {low} max {high}")
    return page_ids.contiguous()


def _check_staging(where: str, staging, n_objects: int, obj_bytes: int, obj_stride) -> int:
    """Check staging and return the object stride in bytes."""
    if not staging.is_contiguous():
        _fail(where, f"staging must be contiguous, got strides {staging.stride()}")
    stride = obj_bytes if obj_stride is None else obj_stride
    if not isinstance(stride, int) or stride < obj_bytes:
        _fail(where, f"obj_stride must be an int >= the object size {obj_bytes} B, got {obj_stride!r}")
    if stride != obj_bytes and stride % 16:
        _fail(where, f"obj_stride {stride} B must be a multiple of 16 when it differs from the object size")
    need = (n_objects - 1) * stride + obj_bytes if n_objects else 0
    nbytes = staging.numel() * staging.element_size()
    if nbytes < need:
        _fail(where, f"staging holds {nbytes} B, needs {need} B for {n_objects} objects "
              f"of {obj_bytes} B at a stride of {stride} B")
    return stride


def word_bytes(sizes: Sequence[int], ptrs: Sequence[int]) -> int:
    """Widest word (8, 4, 2 or 1 bytes) dividing every size and address."""
    return next(w for w in (8, 4, 2, 1) if all(v % w == 0 for v in (*sizes, *ptrs)))


def as_words(t: torch.Tensor, nbytes: int, word_bytes: int) -> torch.Tensor:
    """1-D view of the first ``nbytes`` bytes of contiguous ``t`` as words of ``word_bytes`` bytes
    (nothing to view for 0: an empty tensor reports address 0, so the word chosen may not divide
    its real offset, and torch refuses that view)."""
    if nbytes == 0:
        return torch.empty(0, dtype=WORD_DTYPES[word_bytes], device=t.device)
    return t.reshape(-1).view(torch.uint8)[:nbytes].view(WORD_DTYPES[word_bytes])


def _launch_shape(obj_words: int, word_bytes: int) -> tuple:
    """``(BLOCK words, num_warps, chunks per object)``: at most 16 KiB per program, a 16-byte vector per
    thread per access."""
    block = min(triton.next_power_of_2(obj_words), MAX_BLOCK_BYTES // word_bytes)
    num_warps = max(1, min(8, block * word_bytes // 2048))
    return block, num_warps, triton.cdiv(obj_words, block)


def _plan(where, staging, layers, page_ids, page_size, obj_stride, check_bounds, kernel) -> Plan:
    """Check every input of a launch over ``layers`` (each a tuple of 1 or 2 pool buffers) and plan it."""
    if not isinstance(staging, torch.Tensor):
        _fail(where, f"staging must be a torch.Tensor, got {type(staging).__name__}")
    obj_bytes, num_pages = _check_pool(where, layers, page_size, staging.device)
    page_ids = _check_page_ids(where, page_ids, staging.device, num_pages, check_bounds)
    n_objects = page_ids.numel() * len(layers) * len(layers[0])
    stride = _check_staging(where, staging, n_objects, obj_bytes, obj_stride)
    ptrs = [staging.data_ptr()] + [b.data_ptr() for bufs in layers for b in bufs]
    word = word_bytes((obj_bytes, stride), ptrs)
    obj_words = obj_bytes // word
    block, num_warps, chunks = _launch_shape(obj_words, word)
    if page_ids.numel() * len(layers) * chunks > MAX_PROGRAMS:
        _fail(where, f"{page_ids.numel()} pages x {len(layers)} layers is too many for one launch")
    if staging.device.type == "cpu" and not is_interpreted(kernel):
        _fail(where, "CPU tensors need Triton's interpreter (set TRITON_INTERPRET=1 before importing triton)")
    need = (n_objects - 1) * stride + obj_bytes if n_objects else 0
    staging_words = as_words(staging, need, word)
    bufs = tuple(tuple(as_words(b, num_pages * obj_bytes, word) for b in bufs) for bufs in layers)
    aligned16 = all(v % 16 == 0 for v in (obj_bytes, stride, *ptrs))
    return Plan(staging_words, bufs, page_ids, num_pages, obj_words, stride // word, word, chunks, block,
                num_warps, aligned16=aligned16)


def plan_layer(where: str, staging, bufs: Sequence, page_ids, page_size, obj_stride, check_bounds, kernel):
    """Check one layer's launch (``bufs`` = (k, v) or (kv,)); return a Plan or raise ValueError."""
    return _plan(where, staging, [tuple(bufs)], page_ids, page_size, obj_stride, check_bounds, kernel)


def plan_pages(where: str, staging, layers: Sequence, page_ids, page_size, obj_stride, check_bounds, kernel):
    """Check an all-layers launch (``layers[l]`` = (k_l, v_l) or (kv_l,)); return a Plan holding the device
    pointer table (built once per buffer set and cached), or raise ValueError."""
    if not layers:
        _fail(where, "need at least one layer")
    if len({len(bufs) for bufs in layers}) != 1:
        _fail(where, "every layer needs the same number of buffers")
    plan = _plan(where, staging, [tuple(b) for b in layers], page_ids, page_size, obj_stride, check_bounds,
                 kernel)
    if not is_interpreted(kernel) or staging.device.type == "cpu":
        plan = plan._replace(table=_TABLES.get(plan.bufs))
    return plan


class RowsPlan(NamedTuple):
    """A checked ``scatter_rows`` launch: ``staging`` is the word view of the whole source, ``rows`` the row
    index per page (on the device), sizes in words."""

    staging: torch.Tensor
    rows: torch.Tensor
    num_rows: int
    row_stride_words: int
    bufs: tuple
    page_ids: torch.Tensor
    num_pages: int
    obj_words: int
    stride_words: int
    chunks: int
    block: int
    num_warps: int


def plan_rows(where: str, src, rows, row_stride, bufs: Sequence, page_ids, page_size, obj_stride, check_bounds,
              kernel) -> RowsPlan:
    """Check a rows launch (page i's objects at byte ``rows[i] * row_stride`` of ``src``); return a RowsPlan or
    raise ValueError."""
    if not isinstance(src, torch.Tensor):
        _fail(where, f"src must be a torch.Tensor, got {type(src).__name__}")
    if not src.is_contiguous():
        _fail(where, f"src must be contiguous, got strides {src.stride()}")
    bufs = tuple(bufs)
    obj_bytes, num_pages = _check_pool(where, [bufs], page_size, src.device)
    page_ids = _check_page_ids(where, page_ids, src.device, num_pages, check_bounds)
    stride = _check_staging(where, src, len(bufs), obj_bytes, obj_stride) if page_ids.numel() else \
        (obj_stride or obj_bytes)
    need = (len(bufs) - 1) * stride + obj_bytes
    if not isinstance(row_stride, int) or row_stride < need:
        _fail(where, f"row_stride must be an int >= a row's {need} B, got {row_stride!r}")
    if not isinstance(rows, torch.Tensor) or rows.dtype not in PAGE_ID_DTYPES or rows.dim() != 1:
        _fail(where, f"rows must be a 1-D int32 or int64 tensor, got {getattr(rows, 'dtype', rows)!r}")
    if rows.device != src.device:
        _fail(where, f"rows is on {rows.device}, src on {src.device}")
    if rows.numel() != page_ids.numel():
        _fail(where, f"{rows.numel()} rows for {page_ids.numel()} page ids")
    nbytes = src.numel() * src.element_size()
    num_rows = (nbytes - need) // row_stride + 1 if nbytes >= need else 0
    if rows.numel() and (check_bounds or rows.device.type == "cpu"):
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= num_rows:
            _fail(where, f"rows must lie in [0, {num_rows}), got min {low} max {high}")
    if src.device.type == "cpu" and not is_interpreted(kernel):
        _fail(where, "CPU tensors need Triton's interpreter (set TRITON_INTERPRET=1 before importing triton)")
    ptrs = [src.data_ptr()] + [b.data_ptr() for b in bufs]
    word = word_bytes((obj_bytes, stride, row_stride), ptrs)
    block, num_warps, chunks = _launch_shape(obj_bytes // word, word)
    if page_ids.numel() * chunks > MAX_PROGRAMS:
        _fail(where, f"{page_ids.numel()} pages is too many for one launch")
    words = as_words(src, nbytes // word * word, word)
    return RowsPlan(words, rows.contiguous(), num_rows, row_stride // word,
                    (tuple(as_words(b, num_pages * obj_bytes, word) for b in bufs),), page_ids, num_pages,
                    obj_bytes // word, stride // word, chunks, block, num_warps)


class _TableCache:
    """Device int64 tables of ``data_ptr()``s, shape ``[layers, buffers per layer]``, keyed by the addresses
    and built with one non-blocking copy from pinned memory; each use makes the current stream wait for that
    copy (an event, no host sync) until it is known complete. At most 64 tables are kept (LRU)."""

    def __init__(self, capacity: int = 64):
        self._lock = threading.Lock()
        self._tables: OrderedDict = OrderedDict()
        self._capacity = capacity

    def get(self, layers: tuple) -> torch.Tensor:
        device = layers[0][0].device
        key = (device, tuple(tuple(b.data_ptr() for b in bufs) for bufs in layers))
        with self._lock:
            entry = self._tables.get(key)
            if entry is None:
                entry = self._tables[key] = self._build(device, key[1])
                if len(self._tables) > self._capacity:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(key)
            if device.type == "cuda":
                self._order_use(entry, torch.cuda.current_stream(device))
        return entry[0]

    @staticmethod
    def _order_use(entry: list, stream) -> None:
        """Make ``stream`` wait for the table's copy, and keep the table's memory from being reused while
        ``stream`` may still read it (after an LRU eviction)."""
        if entry[2] is not None:
            if entry[2].query():
                entry[2] = None
            else:
                stream.wait_event(entry[2])
        entry[0].record_stream(stream)

    @staticmethod
    def _build(device, ptrs: tuple) -> list:
        host = torch.tensor(ptrs, dtype=torch.int64)
        if device.type != "cuda":
            return [host, host, None]
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return [table, host, event]


_TABLES = _TableCache()


@triton.jit
def table_pointer(entry_ptr, like_ptr, ALIGNED16: tl.constexpr):
    """Load one int64 address from a pointer table and cast it to ``like_ptr``'s pointer type. With
    ``ALIGNED16`` (the launcher checked every address) tell the compiler, so it can emit 16-byte accesses."""
    ptr = tl.load(entry_ptr).to(like_ptr.dtype)
    if ALIGNED16:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


def launch_layer(kernel, plan: Plan, layer: int = 0, num_layers: int = 1) -> None:
    """Launch a per-layer kernel for ``plan.bufs[layer]``. With ``num_layers > 1`` the staging is the
    all-layers order (page-major, then layer) and only layer ``layer`` is copied."""
    bufs = plan.bufs[layer]
    per_page = len(bufs)
    n = plan.page_ids.numel()
    if n == 0:
        return
    staging = plan.staging[layer * per_page * plan.stride_words:]
    kernel[(n * plan.chunks,)](
        staging, bufs[0], bufs[-1], plan.page_ids, plan.num_pages, plan.obj_words, plan.stride_words,
        num_layers * per_page * plan.stride_words, plan.chunks,
        OBJS=per_page, BLOCK=plan.block, num_warps=plan.num_warps)


def launch_pages(pages_kernel, layer_kernel, plan: Plan) -> None:
    """Launch the all-layers kernel once, or (interpreter on CUDA tensors, which cannot dereference raw
    device addresses from a pointer table) the per-layer kernel once per layer."""
    n, num_layers = plan.page_ids.numel(), len(plan.bufs)
    if n == 0:
        return
    if plan.table is None:
        for layer in range(num_layers):
            launch_layer(layer_kernel, plan, layer, num_layers)
        return
    pages_kernel[(n * num_layers * plan.chunks,)](
        plan.staging, plan.table, plan.page_ids, plan.num_pages, num_layers, plan.obj_words,
        plan.stride_words, plan.chunks,
        OBJS=len(plan.bufs[0]), ALIGNED16=plan.aligned16, BLOCK=plan.block, num_warps=plan.num_warps)


def staging_objects(staging: torch.Tensor, n_pages: int, per_page: int, obj_bytes: int, stride: int):
    """Byte view ``[n_pages, per_page, obj_bytes]`` of the staging objects (for the references)."""
    flat = staging.reshape(-1).view(torch.uint8)
    return flat.as_strided((n_pages, per_page, obj_bytes), (per_page * stride, stride, 1), flat.storage_offset())


def pool_pages(buf: torch.Tensor, page_size: int):
    """Byte view ``[num_pages, object_bytes]`` of one pool buffer (for the references)."""
    obj_bytes, num_pages = pool_geometry("pool_pages", "buf", buf, page_size)
    return buf.reshape(-1).view(torch.uint8)[: num_pages * obj_bytes].view(num_pages, obj_bytes)


def layer_tuples(where: str, k_bufs, v_bufs) -> list:
    """Per-layer buffer tuples ``(k, v)`` (or ``(kv,)`` when ``v_bufs`` is None) from parallel lists."""
    if v_bufs is not None and len(v_bufs) != len(k_bufs):
        _fail(where, f"{len(k_bufs)} K buffers but {len(v_bufs)} V buffers")
    return [(k,) if v_bufs is None else (k, v) for k, v in zip(k_bufs, v_bufs or k_bufs)]
