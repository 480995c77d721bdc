"""Scatter/gather kernels against their plain-torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, which
tests/conftest.py sets at configuration, before any test module imports triton). With CUDA they run
compiled on "cuda" tensors; run with ``TRITON_INTERPRET=1`` there to
also cover the interpreter ("cpu", and "cuda" through the interpreter's per-layer fallback).
Pools are poisoned with a sentinel byte so that unwritten and over-written bytes both show.
"""

import os
import re

import pytest
import torch

import tutti_kernels as tk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
SENTINEL = 0xA5
TOTAL_PAGES = 40  # pages in each pool; tests touch at most 33 of them
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]  # uint8: fp8 as SGLang stores it
# (pages in the batch, page id dtype, obj_stride padding in bytes)
BATCHES = [(1, torch.int32, 0), (3, torch.int64, 48), (7, torch.int32, 0), (33, torch.int64, 4096 - 256)]


def random_bytes(nbytes, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def pool(layout, dtype, device, page_size=4, heads=2, dim=8):
    """A poisoned pool buffer: NHD ``[rows, H, D]``, HND ``[pages, H, P, D]`` or MLA ``[rows, 1, dim]``."""
    shape = {"NHD": (TOTAL_PAGES * page_size, heads, dim), "HND": (TOTAL_PAGES, heads, page_size, dim),
             "MLA": (TOTAL_PAGES * page_size, 1, dim * 4)}[layout]
    nbytes = int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size()
    return torch.full((nbytes,), SENTINEL, dtype=torch.uint8).view(dtype).view(shape).to(device)


def page_bytes(buf, page_size):
    """``[pages, object_bytes]`` byte view of a pool buffer, on CPU."""
    return buf.cpu().reshape(-1).view(torch.uint8).view(TOTAL_PAGES, -1)


def page_ids(n, dtype, device, seed):
    """n distinct, unsorted, non-contiguous page ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(TOTAL_PAGES, generator=gen)[:n]
    if n > 1 and bool((ids[1:] > ids[:-1]).all()):
        ids = ids.flip(0)
    return ids.to(dtype).to(device)


def staging_for(n_objects, obj_bytes, pad, device, seed):
    return random_bytes((n_objects - 1) * (obj_bytes + pad) + obj_bytes, seed).to(device)


def check_pool(buf, staging, ids, slot, per_page, obj_bytes, stride, page_size):
    """Pages in ``ids`` hold their staged object; every other page still holds the sentinel."""
    pages = page_bytes(buf, page_size)
    flat = staging.cpu()
    for i, page in enumerate(ids.tolist()):
        start = (i * per_page + slot) * stride
        assert torch.equal(pages[page], flat[start:start + obj_bytes]), f"page {page} (staged #{i})"
    untouched = torch.ones(TOTAL_PAGES, dtype=torch.bool)
    untouched[ids.cpu().long()] = False
    assert bool((pages[untouched] == SENTINEL).all()), "a page outside page_ids was written"


def assert_same_bytes(a, b):
    assert torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,id_dtype,pad", BATCHES, ids=lambda v: str(v).replace("torch.", ""))
def test_layer_scatter_gather(device, layout, dtype, n, id_dtype, pad):
    page_size = 4
    bufs = [pool(layout, dtype, device) for _ in range(1 if layout == "MLA" else 2)]
    obj_bytes = page_bytes(bufs[0], page_size).shape[1]
    ids = page_ids(n, id_dtype, device, seed=n)
    staging = staging_for(n * len(bufs), obj_bytes, pad, device, seed=7 * n)
    stride = obj_bytes + pad
    args = (ids, page_size, stride if pad else None)
    k_buf, v_buf = bufs[0], (bufs[1] if len(bufs) == 2 else None)  # MLA: v_buf=None
    ref_bufs = [b.clone() for b in bufs]
    tk.scatter_layer(staging, k_buf, v_buf, *args)
    tk.scatter_layer_ref(staging, ref_bufs[0], ref_bufs[1] if len(bufs) == 2 else None, *args)
    for slot, (buf, ref) in enumerate(zip(bufs, ref_bufs)):
        assert_same_bytes(buf, ref)
        check_pool(buf, staging, ids, slot, len(bufs), obj_bytes, stride, page_size)
    back = torch.full_like(staging, SENTINEL)
    tk.gather_layer(back, k_buf, v_buf, *args)
    ref_back = torch.full_like(staging, SENTINEL)
    tk.gather_layer_ref(ref_back, bufs[0], bufs[1] if len(bufs) == 2 else None, *args)
    assert_same_bytes(back, ref_back)
    objects = torch.zeros(staging.numel(), dtype=torch.bool)
    for j in range(n * len(bufs)):
        objects[j * stride:j * stride + obj_bytes] = True
    assert torch.equal(back.cpu()[objects], staging.cpu()[objects]), "round trip changed an object"
    assert bool((back.cpu()[~objects] == SENTINEL).all()), "gather wrote into the padding"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("n,id_dtype,pad", BATCHES, ids=lambda v: str(v).replace("torch.", ""))
def test_pages_scatter_gather(device, layout, dtype, n, id_dtype, pad, num_layers=3):
    page_size = 4
    per_layer = 1 if layout == "MLA" else 2
    layers = [[pool(layout, dtype, device) for _ in range(per_layer)] for _ in range(num_layers)]
    k_bufs, v_bufs = [b[0] for b in layers], None if layout == "MLA" else [b[1] for b in layers]
    obj_bytes = page_bytes(k_bufs[0], page_size).shape[1]
    ids = page_ids(n, id_dtype, device, seed=n + 1)
    stride = obj_bytes + pad
    staging = staging_for(n * num_layers * per_layer, obj_bytes, pad, device, seed=3 * n)
    args = (ids, page_size, stride if pad else None)
    ref_layers = [[b.clone() for b in bufs] for bufs in layers]
    tk.scatter_pages(staging, k_bufs, v_bufs, *args)  # MLA: v_bufs=None
    tk.scatter_pages_ref(staging, [b[0] for b in ref_layers], v_bufs and [b[1] for b in ref_layers], *args)
    for layer, bufs in enumerate(layers):
        for j, buf in enumerate(bufs):
            assert_same_bytes(buf, ref_layers[layer][j])
            check_pool(buf, staging, ids, layer * per_layer + j, num_layers * per_layer, obj_bytes, stride,
                       page_size)
    back, ref_back = torch.full_like(staging, SENTINEL), torch.full_like(staging, SENTINEL)
    tk.gather_pages(back, k_bufs, v_bufs, *args)
    tk.gather_pages_ref(ref_back, k_bufs, v_bufs, *args)
    assert_same_bytes(back, ref_back)
    if not pad:
        assert_same_bytes(back, staging)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,dim,staging_offset", [
    (torch.uint8, 3, 0), (torch.float16, 3, 0), (torch.float32, 3, 0), (torch.bfloat16, 8, 1),
    (torch.float32, 8, 4)], ids=str)
def test_narrow_words(device, dtype, dim, staging_offset):
    """Objects or staging addresses that only allow 1-, 2- or 4-byte words."""
    buf = pool("NHD", dtype, device, page_size=1, heads=1, dim=dim)
    obj_bytes = page_bytes(buf, 1).shape[1]
    ids = page_ids(5, torch.int64, device, seed=5)
    staging = random_bytes(staging_offset + 5 * obj_bytes, seed=11).to(device)[staging_offset:]
    ref = buf.clone()
    tk.scatter_layer(staging, buf, None, ids, 1)
    tk.scatter_layer_ref(staging, ref, None, ids, 1)
    assert_same_bytes(buf, ref)
    check_pool(buf, staging, ids, 0, 1, obj_bytes, obj_bytes, 1)
    back = torch.zeros_like(staging)
    tk.gather_layer(back, buf, None, ids, 1)
    assert_same_bytes(back, staging)


@pytest.mark.parametrize("obj_words,word_bytes", [(4608, 16), (8192, 16), (100, 16), (9216, 8), (2304, 16),
                                                  (9000, 16), (1, 2), (65537, 16)])
def test_launch_shape_covers_objects(obj_words, word_bytes):
    """Blocks are powers of two of at most 16 KiB, 1-8 warps, and their chunks cover the object exactly once."""
    block, warps, chunks = tk._common._launch_shape(obj_words, word_bytes)
    assert block & (block - 1) == 0 and block * word_bytes <= 16384 and 1 <= warps <= 8
    assert chunks * block >= obj_words > (chunks - 1) * block


@pytest.mark.parametrize("device", DEVICES)
def test_mla_full_size_object_round_trip(device):
    """A real MLA object (page 64 x 576 bf16 = 72 KiB, several chunks per object) scatters and gathers exactly."""
    page_size, dim, n = 64, 576, 3
    buf = torch.full((8 * page_size, 1, dim), 0, dtype=torch.bfloat16).view(torch.uint8)
    buf = buf.fill_(SENTINEL).view(torch.bfloat16).to(device)
    ref = buf.clone()
    obj_bytes = page_size * dim * 2
    ids = torch.tensor([5, 0, 6], dtype=torch.int32, device=device)
    staging = random_bytes(n * obj_bytes, seed=9).to(device)
    tk.scatter_layer(staging, buf, None, ids, page_size)
    tk.scatter_layer_ref(staging, ref, None, ids, page_size)
    assert_same_bytes(buf, ref)
    back = torch.full_like(staging, SENTINEL)
    tk.gather_layer(back, buf, None, ids, page_size)
    assert_same_bytes(back, staging)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_skips_out_of_range_pages(device):
    """Unchecked ids (GPU default) outside [0, num_pages) write nothing and read nothing."""
    k, v = pool("NHD", torch.bfloat16, device), pool("NHD", torch.bfloat16, device)
    good = torch.tensor([2, 5, 9], device=device)
    staging = staging_for(6, page_bytes(k, 4).shape[1], 0, device, seed=1)
    kernel = tk.scatter._scatter_layer_kernel
    plan = tk._common.plan_layer("test", staging, (k, v), good, 4, None, False, kernel)
    bad = torch.tensor([2, TOTAL_PAGES, -1], device=device)
    tk._common.launch_layer(kernel, plan._replace(page_ids=bad))
    pages = page_bytes(k, 4)
    assert torch.equal(pages[2], staging.cpu()[: pages.shape[1]])
    assert bool((pages[torch.arange(TOTAL_PAGES) != 2] == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_page_ids_tensor(device):
    k, v = pool("NHD", torch.float32, device), pool("NHD", torch.float32, device)
    ids = page_ids(6, torch.int32, device, seed=2)[::2]
    obj_bytes = page_bytes(k, 4).shape[1]
    staging = staging_for(6, obj_bytes, 0, device, seed=3)
    tk.scatter_layer(staging, k, v, ids, 4)
    check_pool(k, staging, ids, 0, 2, obj_bytes, obj_bytes, 4)
    check_pool(v, staging, ids, 1, 2, obj_bytes, obj_bytes, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_is_a_no_op(device):
    k, v = pool("NHD", torch.float16, device), pool("NHD", torch.float16, device)
    ids = torch.empty(0, dtype=torch.int32, device=device)
    tk.scatter_layer(torch.empty(0, dtype=torch.uint8, device=device), k, v, ids, 4)
    tk.gather_pages(torch.empty(0, dtype=torch.uint8, device=device), [k], [v], ids, 4)
    # an empty slice of a staging ring at an odd byte offset (it raised: an empty tensor's address
    # reads as 0, so 8-byte words were chosen for a view torch refuses at offset 2)
    ring = torch.zeros(4096, dtype=torch.uint8, device=device)
    tk.scatter_layer(ring[2:2], k, v, ids, 4)
    tk.gather_pages(ring[2:2], [k], [v], ids, 4)
    assert bool((page_bytes(k, 4) == SENTINEL).all())


def _errors():
    k, v = pool("NHD", torch.bfloat16, "cpu"), pool("NHD", torch.bfloat16, "cpu")
    ids = torch.tensor([1, 2])
    staging = torch.zeros(4 * 128, dtype=torch.uint8)
    return [
        ("staging holds 511 B", (staging[:-1], k, v, ids, 4)),
        ("page_ids must be an int32 or int64", (staging, k, v, ids.float(), 4)),
        ("page_ids must be 1-D", (staging, k, v, ids.view(1, 2), 4)),
        ("page_ids must lie in [0, 40)", (staging, k, v, torch.tensor([1, 40]), 4)),
        ("page_ids must lie in [0, 40)", (staging, k, v, torch.tensor([-1, 0]), 4)),
        ("k_buf must be contiguous", (staging, k.transpose(1, 2), v, ids, 4)),
        ("expected torch.bfloat16", (staging, k, v.view(torch.float16), ids, 4)),
        ("expected torch.bfloat16 (160, 2, 8)", (staging, k, v[:-4], ids, 4)),
        ("v_buf is on meta, staging on cpu", (staging, k, torch.empty_like(v, device="meta"), ids, 4)),
        ("page_ids is on meta", (staging, k, v, ids.to("meta"), 4)),
        ("obj_stride must be an int >= the object size 128 B", (staging, k, v, ids, 4, 64)),
        ("must be a multiple of 16", (staging, k, v, ids, 4, 136)),
        ("page_size must be a positive int", (staging, k, v, ids, 0)),
        ("is HND (40, 2, 4, 8) but page_size is 8", (staging, *[pool("HND", torch.float16, "cpu")] * 2, ids, 8)),
        ("NHD [rows, H, D] or HND", (staging, k.view(-1, 16), v.view(-1, 16), ids, 4)),
        ("staging must be a torch.Tensor", (None, k, v, ids, 4)),
        ("staging must be contiguous", (staging.view(2, -1).t(), k, v, ids, 4)),
    ]


@pytest.mark.parametrize("message,args", _errors(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("fn", ["scatter_layer", "gather_layer"])
def test_layer_errors(fn, message, args):
    with pytest.raises(ValueError, match=rf"^{fn}: .*{re.escape(message)}"):
        getattr(tk, fn)(*args)


def test_pages_errors():
    k, v = pool("NHD", torch.bfloat16, "cpu"), pool("NHD", torch.bfloat16, "cpu")
    staging, ids = torch.zeros(8 * 128, dtype=torch.uint8), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="scatter_pages: 2 K buffers but 1 V buffers"):
        tk.scatter_pages(staging, [k, k], [v], ids, 4)
    with pytest.raises(ValueError, match="gather_pages: need at least one layer"):
        tk.gather_pages(staging, [], None, ids, 4)
    with pytest.raises(ValueError, match=r"scatter_pages: k_bufs\[1\] is torch.float16"):
        tk.scatter_pages(staging, [k, k.view(torch.float16)], [v, v], ids, 4)
    with pytest.raises(ValueError, match=r"staging holds 1024 B, needs 1280 B for 10 objects"):
        tk.gather_pages(staging, [k] * 5, None, ids, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bounds_and_device_errors():
    k, v = pool("NHD", torch.bfloat16, "cuda"), pool("NHD", torch.bfloat16, "cuda")
    staging = torch.zeros(4 * 128, dtype=torch.uint8, device="cuda")
    bad = torch.tensor([1, 40], device="cuda")
    with pytest.raises(ValueError, match=r"page_ids must lie in \[0, 40\), got min 1 max 40"):
        tk.scatter_layer(staging, k, v, bad, 4, check_bounds=True)
    with pytest.raises(ValueError, match="v_buf is on cpu, staging on cuda"):
        tk.scatter_layer(staging, k, v.cpu(), bad, 4)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs CPU tensors")
def test_cpu_tensors_need_the_interpreter():
    k = pool("NHD", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tk.scatter_layer(torch.zeros(128, dtype=torch.uint8), k, None, torch.tensor([1]), 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "MLA"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("pad", [0, 48])
def test_scatter_rows_reads_each_page_from_its_row(device, layout, dtype, pad):
    """The DRAM tier's path: page i's objects from row rows[i] of a larger source (a row holds several
    layers; the source starts at one layer's offset), straight into the pool."""
    page_size, n, n_rows, layers, layer = 4, 9, 16, 3, 1
    bufs = [pool(layout, dtype, device) for _ in range(1 if layout == "MLA" else 2)]
    obj_bytes = page_bytes(bufs[0], page_size).shape[1]
    stride = obj_bytes + pad
    per_layer = len(bufs) * stride
    row_stride = layers * per_layer
    arena = random_bytes(n_rows * row_stride, seed=11).to(device)
    src = arena[layer * per_layer:]  # as the loader passes one layer of the tier
    gen = torch.Generator().manual_seed(5)
    rows = torch.randperm(n_rows, generator=gen)[:n].to(device)
    ids = page_ids(n, torch.int64, device, seed=3)
    k_buf, v_buf = bufs[0], (bufs[1] if len(bufs) == 2 else None)
    ref_bufs = [b.clone() for b in bufs]
    args = (ids, page_size, stride if pad else None)
    tk.scatter_rows(src, rows, row_stride, k_buf, v_buf, *args)
    tk.scatter_rows_ref(src, rows, row_stride, ref_bufs[0], ref_bufs[1] if len(bufs) == 2 else None, *args)
    flat = arena.cpu()
    for slot, (buf, ref) in enumerate(zip(bufs, ref_bufs)):
        assert_same_bytes(buf, ref)
        pages = page_bytes(buf, page_size)
        for page, row in zip(ids.tolist(), rows.tolist()):
            start = row * row_stride + layer * per_layer + slot * stride
            assert torch.equal(pages[page], flat[start:start + obj_bytes]), f"page {page} (row {row})"
        untouched = torch.ones(TOTAL_PAGES, dtype=torch.bool)
        untouched[ids.cpu()] = False
        assert bool((pages[untouched] == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_rows_rejects_rows_outside_the_source(device):
    page_size = 4
    k, v = pool("NHD", torch.bfloat16, device), pool("NHD", torch.bfloat16, device)
    obj_bytes = page_bytes(k, page_size).shape[1]
    src = random_bytes(4 * 2 * obj_bytes, seed=1).to(device)  # 4 rows
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
        tk.scatter_rows(src, torch.tensor([0, 4], device=device), 2 * obj_bytes, k, v, ids, page_size,
                        check_bounds=True)
    with pytest.raises(ValueError, match="row_stride"):
        tk.scatter_rows(src, torch.tensor([0, 1], device=device), obj_bytes, k, v, ids, page_size)
    with pytest.raises(ValueError, match="3 rows for 2 page ids"):
        tk.scatter_rows(src, torch.tensor([0, 1, 2], device=device), 2 * obj_bytes, k, v, ids, page_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_copy_pages_copies_pool_pages_onto_others(device, layout, dtype):
    """The linker's in-pool copy (a page two requests of one batch restore is read once): page src[i] onto
    page dst[i] of each buffer, every other page untouched; the kernel and the reference agree."""
    page_size, n = 4, 7
    bufs = [pool(layout, dtype, device) for _ in range(1 if layout == "MLA" else 2)]
    for j, buf in enumerate(bufs):  # random pool contents; sources and destinations are disjoint
        buf.view(-1).view(torch.uint8).copy_(random_bytes(buf.numel() * buf.element_size(), seed=20 + j))
    ids = page_ids(2 * n, torch.int64, device, seed=8)
    src, dst = ids[:n], ids[n:]
    before = [page_bytes(b, page_size).clone() for b in bufs]
    ref_bufs = [b.clone() for b in bufs]
    k_buf, v_buf = bufs[0], (bufs[1] if len(bufs) == 2 else None)
    tk.copy_pages(k_buf, v_buf, src, dst, page_size)
    tk.copy_pages_ref(ref_bufs[0], ref_bufs[1] if len(bufs) == 2 else None, src, dst, page_size)
    for buf, ref, old in zip(bufs, ref_bufs, before):
        assert_same_bytes(buf, ref)
        expect = old.clone()
        expect[dst.cpu()] = old[src.cpu()]
        assert torch.equal(page_bytes(buf, page_size), expect)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_pages_ref_reads_every_source_before_writing(device):
    """A page that is a destination and, for another copy, a source (a slot SGLang freed and handed out
    again) gives the reference its old bytes: the linker's copies from the last batch's slots rely on it."""
    page_size = 4
    k = pool("NHD", torch.bfloat16, device)
    k.view(-1).view(torch.uint8).copy_(random_bytes(k.numel() * k.element_size(), seed=3))
    old = page_bytes(k, page_size).clone()
    tk.copy_pages_ref(k, None, torch.tensor([1, 2], device=device), torch.tensor([2, 3], device=device),
                      page_size)
    pages = page_bytes(k, page_size)
    assert torch.equal(pages[2], old[1]) and torch.equal(pages[3], old[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU page ids are bounds-checked)")
def test_copy_pages_skips_page_minus_one():
    """The loader compiles copy_pages at attach with page id -1 only: nothing in the pool changes."""
    k, v = pool("NHD", torch.bfloat16, "cuda"), pool("NHD", torch.bfloat16, "cuda")
    before = [k.clone(), v.clone()]
    none = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    tk.copy_pages(k, v, none, none, 4)
    assert_same_bytes(k, before[0])
    assert_same_bytes(v, before[1])
