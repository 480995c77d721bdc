"""Scatter: contiguous staging -> SGLang's paged device KV pool (restore).

Primitives at a glance:

* ``scatter_layer(staging, k_buf, v_buf, page_ids, page_size)``: one layer; MHA: K then V object per page;
  MLA: ``v_buf=None`` and ``k_buf`` is the ``[rows, 1, kv_cache_dim]`` buffer (one object per page).
* ``scatter_pages(staging, k_bufs, v_bufs, page_ids, page_size)``: every layer in one launch, staging in the
  on-disk order (page-major, then layer, then K before V); ``v_bufs=None`` for MLA.
* ``scatter_rows(src, rows, row_stride, k_buf, v_buf, page_ids, page_size)``: one layer straight from rows of a
  larger source (the linker's pinned DRAM tier, mapped into the device's address space), no staging.
* ``copy_pages(k_buf, v_buf, src_page_ids, dst_page_ids, page_size)``: pages of one layer's pool onto other pages
  of it, one pass (``scatter_rows`` reading the pool itself); ``copy_pages_ref`` reads every source first.
* ``scatter_layer_ref`` / ``scatter_pages_ref`` / ``scatter_rows_ref``: the same in plain torch, same arguments.

Staging holds object j (0-based, in the order above) at byte ``j * obj_stride``; ``obj_stride`` defaults to the
object size ``page_size * H * D * itemsize`` and may be larger (a multiple of 16, e.g. objects padded to 4 KiB).
Pool buffers are NHD ``[rows, H, D]`` or HND ``[num_pages, H, page_size, D]``, contiguous; page p's object is
bytes ``[p * object_bytes, (p + 1) * object_bytes)``. Copies are byte-exact, for any dtype.

Launchers enqueue on the current CUDA stream and return None without synchronizing the host. Page ids outside
``[0, num_pages)`` raise ValueError when checked (CPU tensors, or ``check_bounds=True``, which synchronizes);
otherwise the kernel skips them (nothing written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (WORD_DTYPES, word_bytes, launch_layer, launch_pages, layer_tuples, plan_layer, plan_pages,
                      plan_rows, pool_geometry, pool_pages, staging_objects, table_pointer)


@triton.jit
def _scatter_layer_kernel(staging_ptr, k_ptr, v_ptr, page_ids_ptr, num_pages, obj_words, obj_stride_words,
                          page_stride_words, chunks, OBJS: tl.constexpr, BLOCK: tl.constexpr):
    """Program = (staged page i, chunk c): copy words [c*BLOCK, (c+1)*BLOCK) of page i's K (and V) object."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid // chunks
    offs = (pid % chunks) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    mask = offs < tl.where((page >= 0) & (page < num_pages), obj_words, 0)  # invalid page: copy nothing
    src = staging_ptr + i * page_stride_words + offs
    dst = page * obj_words + offs
    tl.store(k_ptr + dst, tl.load(src, mask=mask), mask=mask)
    if OBJS == 2:
        tl.store(v_ptr + dst, tl.load(src + obj_stride_words, mask=mask), mask=mask)


@triton.jit
def _scatter_pages_kernel(staging_ptr, table_ptr, page_ids_ptr, num_pages, num_layers, obj_words,
                          obj_stride_words, chunks, OBJS: tl.constexpr, ALIGNED16: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program = (staged page i, layer l, chunk c); layer l's buffers come from row l of the pointer table."""
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid % chunks
    layer = (pid // chunks) % num_layers
    i = pid // chunks // num_layers
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    mask = offs < tl.where((page >= 0) & (page < num_pages), obj_words, 0)  # invalid page: copy nothing
    src = staging_ptr + (i * num_layers + layer) * OBJS * obj_stride_words + offs
    dst = page * obj_words + offs
    k_ptr = table_pointer(table_ptr + layer * OBJS, staging_ptr, ALIGNED16)
    tl.store(k_ptr + dst, tl.load(src, mask=mask), mask=mask)
    if OBJS == 2:
        v_ptr = table_pointer(table_ptr + layer * OBJS + 1, staging_ptr, ALIGNED16)
        tl.store(v_ptr + dst, tl.load(src + obj_stride_words, mask=mask), mask=mask)


def scatter_layer(staging, k_buf, v_buf, page_ids, page_size: int, obj_stride=None, *, check_bounds=False):
    """Write staged page i's K object (byte ``2i * obj_stride``) and V object (``(2i+1) * obj_stride``) into
    page ``page_ids[i]`` of ``k_buf`` / ``v_buf`` for i < N; MLA (``v_buf=None``): staged object i (byte
    ``i * obj_stride``) into page ``page_ids[i]`` of ``k_buf``. ``obj_stride`` in bytes. Returns None."""
    bufs = (k_buf,) if v_buf is None else (k_buf, v_buf)
    plan = plan_layer("scatter_layer", staging, bufs, page_ids, page_size, obj_stride, check_bounds,
                      _scatter_layer_kernel)
    launch_layer(_scatter_layer_kernel, plan)


def scatter_pages(staging, k_bufs, v_bufs, page_ids, page_size: int, obj_stride=None, *, check_bounds=False):
    """Every layer in one launch: staged object ``(i*L + l)*2 + {0: K, 1: V}`` goes to page ``page_ids[i]`` of
    ``k_bufs[l]`` / ``v_bufs[l]``; MLA (``v_bufs=None``): staged object ``i*L + l`` to page ``page_ids[i]`` of
    ``k_bufs[l]``. All L buffers share dtype and shape. Returns None."""
    layers = layer_tuples("scatter_pages", k_bufs, v_bufs)
    plan = plan_pages("scatter_pages", staging, layers, page_ids, page_size, obj_stride, check_bounds,
                      _scatter_pages_kernel)
    launch_pages(_scatter_pages_kernel, _scatter_layer_kernel, plan)


def scatter_pages_ref(staging, k_bufs, v_bufs, page_ids, page_size: int, obj_stride=None) -> None:
    """Plain-torch ``scatter_pages`` (``v_bufs=None``: MLA), via ``index_copy_``."""
    layers = layer_tuples("scatter_pages_ref", k_bufs, v_bufs)
    ids = page_ids.long()
    obj_bytes = pool_pages(layers[0][0], page_size).shape[1]
    per_page = len(layers) * len(layers[0])
    objs = staging_objects(staging, ids.numel(), per_page, obj_bytes, obj_stride or obj_bytes)
    for j, buf in enumerate(b for bufs in layers for b in bufs):
        pool_pages(buf, page_size).index_copy_(0, ids, objs[:, j])


def scatter_layer_ref(staging, k_buf, v_buf, page_ids, page_size: int, obj_stride=None) -> None:
    """Plain-torch ``scatter_layer`` (``v_buf=None``: MLA)."""
    scatter_pages_ref(staging, [k_buf], None if v_buf is None else [v_buf], page_ids, page_size, obj_stride)


@triton.jit
def _scatter_rows_kernel(src_ptr, rows_ptr, k_ptr, v_ptr, page_ids_ptr, num_pages, num_rows, obj_words,
                         obj_stride_words, row_stride_words, chunks, OBJS: tl.constexpr, BLOCK: tl.constexpr):
    """Program = (page i, chunk c): copy words [c*BLOCK, (c+1)*BLOCK) of row ``rows[i]``'s K (and V) object."""
    pid = tl.program_id(0).to(tl.int64)
    i = pid // chunks
    offs = (pid % chunks) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    valid = (page >= 0) & (page < num_pages) & (row >= 0) & (row < num_rows)
    mask = offs < tl.where(valid, obj_words, 0)  # invalid page or row: copy nothing
    src = src_ptr + row * row_stride_words + offs
    dst = page * obj_words + offs
    tl.store(k_ptr + dst, tl.load(src, mask=mask), mask=mask)
    if OBJS == 2:
        tl.store(v_ptr + dst, tl.load(src + obj_stride_words, mask=mask), mask=mask)


def scatter_rows(src, rows, row_stride: int, k_buf, v_buf, page_ids, page_size: int, obj_stride=None, *,
                 check_bounds=False):
    """``scatter_layer`` from rows of a larger source, no staging: page i's K object is at byte
    ``rows[i] * row_stride`` of ``src`` and its V object ``obj_stride`` bytes after (MLA, ``v_buf=None``: one
    object). ``src`` is any contiguous tensor the kernel can read, e.g. pinned host memory mapped into the
    device's address space; its rows lie ``row_stride`` bytes apart (a multiple of 16, or of the word).
    Rows outside ``src`` are skipped like invalid page ids (ValueError when checked). Returns None."""
    bufs = (k_buf,) if v_buf is None else (k_buf, v_buf)
    plan = plan_rows("scatter_rows", src, rows, row_stride, bufs, page_ids, page_size, obj_stride, check_bounds,
                     _scatter_rows_kernel)
    n = plan.page_ids.numel()
    if n == 0:
        return
    _scatter_rows_kernel[(n * plan.chunks,)](
        plan.staging, plan.rows, plan.bufs[0][0], plan.bufs[0][-1], plan.page_ids, plan.num_pages, plan.num_rows,
        plan.obj_words, plan.stride_words, plan.row_stride_words, plan.chunks,
        OBJS=len(bufs), BLOCK=plan.block, num_warps=plan.num_warps)


def scatter_rows_ref(src, rows, row_stride: int, k_buf, v_buf, page_ids, page_size: int, obj_stride=None) -> None:
    """Plain-torch ``scatter_rows``: each object's rows selected from a strided byte view of ``src``."""
    bufs = (k_buf,) if v_buf is None else (k_buf, v_buf)
    obj_bytes = pool_pages(k_buf, page_size).shape[1]
    stride = obj_stride or obj_bytes
    need = (len(bufs) - 1) * stride + obj_bytes  # a row's bytes that the copy reads
    flat = src.reshape(-1).view(torch.uint8)
    n_rows = (flat.numel() - need) // row_stride + 1 if flat.numel() >= need else 0
    rows, ids = rows.long().to(flat.device), page_ids.long()
    for j, buf in enumerate(bufs):
        objs = flat.as_strided((n_rows, obj_bytes), (row_stride, 1), flat.storage_offset() + j * stride)
        pool_pages(buf, page_size).index_copy_(0, ids, objs.index_select(0, rows))


def copy_pages(k_buf, v_buf, src_page_ids, dst_page_ids, page_size: int, *, check_bounds=False):
    """Page ``src_page_ids[i]`` of ``k_buf`` (and ``v_buf``; MLA: ``v_buf=None``) onto page ``dst_page_ids[i]`` of
    the same buffer, byte-exact, one launch per buffer that reads each source once and writes each destination
    once (``scatter_rows`` over the pool itself, 16-byte words where the sizes allow). The two id sets must be
    disjoint: a page that is both a source and a destination may be read before or after it is written
    (``copy_pages_ref`` reads every source first). Returns None."""
    for buf in (k_buf,) if v_buf is None else (k_buf, v_buf):
        obj_bytes, _ = pool_geometry("copy_pages", "buf", buf, page_size)
        scatter_rows(buf, src_page_ids, obj_bytes, buf, None, dst_page_ids, page_size, check_bounds=check_bounds)


def copy_pages_ref(k_buf, v_buf, src_page_ids, dst_page_ids, page_size: int) -> None:
    """Plain-torch ``copy_pages``, defined for overlapping id sets too: every source page is read (into a
    temporary) before any destination is written; pages move as the widest word dividing them."""
    src, dst = src_page_ids.long(), dst_page_ids.long()
    for buf in (k_buf,) if v_buf is None else (k_buf, v_buf):
        pages = pool_pages(buf, page_size)
        words = pages.view(WORD_DTYPES[word_bytes((pages.shape[1],), (buf.data_ptr(),))])
        words.index_copy_(0, dst, words.index_select(0, src))
