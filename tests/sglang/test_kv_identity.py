"""What a store holds is never served to a server whose KV differs: fp8 vs bf16 pools, MHA vs
MLA, page sizes, through both seams with real SGLang 0.5.23 classes on CPU. And fp8 pools work
through both: the host tier's TuttiStorage (MHA and MLA host pools, fp8_e4m3) and the linker
(fp8 device pools, SGLang storing them as bytes) restore byte-exact, and MLA's fp8 latent is
still written once per model (rank 0) and read by the others.

A server started with another --kv-cache-dtype, geometry or page size attaches to another
namespace (identity.py: dtype, geometry and page size are part of it), so its lookups miss; the
pages of the first stay on disk and serve it again when it comes back."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from tutti_hicache.testing.linker_rig import Rig  # noqa: E402

pytestmark = pytest.mark.sglang
FP8 = torch.float8_e4m3fn


@pytest.fixture
def sg(sglang):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    return sglang


def _write(rig, toks, seed):
    slots = rig.fill(len(toks), seed=seed)
    want = rig.snapshot(slots)
    rig.insert(toks, slots)
    rig.commit_offloads(1)
    rig.cache.reset()
    return want


def _restores(rig, toks, want) -> bool:
    hit, failed = rig.restore(toks)
    return hit == len(toks) and not failed and all(
        torch.equal(x, y) for x, y in zip(rig.snapshot(rig.loads[-1]), want))


# ------------------------------------------------------------------------------- the linker
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_linker_fp8_pools_restore_byte_exact_and_never_meet_bf16_pages(sg, tmp_path, mla):
    toks = list(range(100, 124))  # 6 pages of 4 tokens
    a = Rig([tmp_path], mla=mla, dtype=FP8)
    assert a.pool.dtype == FP8 and a.buffers(0)[0].dtype == torch.uint8  # SGLang stores bytes
    want8 = _write(a, toks, seed=1)
    assert _restores(a, toks, want8)
    a.close()
    b = Rig([tmp_path], mla=mla)  # --kv-cache-dtype auto (bf16) on the same directories
    assert b.restore(toks)[0] == 0  # a miss, never fp8 bytes read as bf16
    want16 = _write(b, toks, seed=2)
    assert _restores(b, toks, want16)
    b.close()
    c = Rig([tmp_path], mla=mla, dtype=FP8)  # back to fp8: its own pages, still there
    assert _restores(c, toks, want8)
    c.close()


def test_linker_mha_and_mla_and_page_sizes_keep_apart(sg, tmp_path):
    toks = list(range(200, 232))  # 8 pages of 4, 4 of 8
    a = Rig([tmp_path])
    want = _write(a, toks, seed=3)
    a.close()
    for other in (dict(mla=True), dict(page=8), dict(mla=True, dtype=FP8)):
        r = Rig([tmp_path], **other)
        assert r.restore(toks)[0] == 0, other
        r.close()
    a = Rig([tmp_path])
    assert _restores(a, toks, want)
    a.close()


# ----------------------------------------------------------------------------- the host tier
PAGE = 16


def _storage(h, dirs, kind, dtype, page=PAGE, tp_rank=0, tp_size=1, kv=None, args=None,
             mha=(2, 2, 64)):
    """A TuttiStorage on a real host pool of this dtype, attached as in a server started with
    --kv-cache-dtype kv (published in SGLang's runtime context while it attaches); mha: an MHA
    pool's (layers, heads, head_dim)."""
    from sglang.srt.runtime_context import get_context

    from tutti_hicache.storage import TuttiStorage
    if kv is None:
        kv = "fp8_e4m3" if dtype == FP8 else "auto"
    if kind == "mha":
        pool = h.make_mha_host_pool("layer_first", *mha, page, dtype, 24)
    else:
        pool = h.make_mla_host_pool("layer_first", 2, 32, 16, page, dtype, 24)
    cfg = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": 0.1, "tutti_segment_gb": 1 / 64,
           "tutti_rescan_interval_s": 0.0}
    sc = h.make_storage_config(tp_rank=tp_rank, tp_size=tp_size, is_mla=kind == "mla", extra_config=cfg)
    st = TuttiStorage(sc, {})
    override = get_context().override_server_args(**{"model_path": "dummy", "kv_cache_dtype": kv,
                                                      **(args or {})})
    override.install()
    try:
        st.register_mem_pool_host(pool)
    finally:
        override.restore()
    return st, pool


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_host_tier_fp8_pools_roundtrip_and_never_meet_bf16_pages(sglang, tmp_path, kind):
    h = sglang
    keys = h.make_page_keys(8, seed=21)
    st, pool = _storage(h, [tmp_path], kind, FP8)
    assert pool.dtype == torch.uint8  # SGLang's host pools hold fp8 KV as bytes
    assert st.store.identity["dtype"] == "float8_e4m3fn"  # named by --kv-cache-dtype
    src, dst = pool.alloc(8 * PAGE), pool.alloc(8 * PAGE)
    h.fill_random(pool, src, seed=22)
    want = h.page_bytes(pool, src)
    assert all(st.batch_set_v1(keys, src))
    st.close()
    for dtype, kv in ((torch.bfloat16, "auto"), (FP8, "fp8_e5m2")):  # other --kv-cache-dtypes
        st, pool = _storage(h, [tmp_path], kind, dtype, kv=kv)  # e5m2: the same bytes per token
        assert st.batch_exists(keys) == 0, kv
        st.close()
    for kv in ("fp8_e4m3", "auto"):  # a restart with the same one; auto on an FP8 checkpoint
        st, pool = _storage(h, [tmp_path], kind, FP8, kv=kv)  # (its fp8 KV is SGLang's e4m3)
        assert st.batch_exists(keys) == 8, kv
        dst = pool.alloc(8 * PAGE)
        assert all(st.batch_get_v1(keys, dst))
        assert h.page_bytes(pool, dst) == want
        st.close()


def test_host_tier_page_sizes_and_kinds_keep_apart(sglang, tmp_path):
    h = sglang
    keys = h.make_page_keys(4, seed=31)
    st, pool = _storage(h, [tmp_path], "mha", torch.bfloat16, page=32)
    src = pool.alloc(4 * 32)
    h.fill_random(pool, src, seed=32)
    assert all(st.batch_set_v1(keys, src))
    st.close()
    for kind, page in (("mha", 64), ("mla", 32)):
        st, _ = _storage(h, [tmp_path], kind, torch.bfloat16, page=page)
        assert st.batch_exists(keys) == 0, (kind, page)
        st.close()
    st, _ = _storage(h, [tmp_path], "mha", torch.bfloat16, page=32)
    assert st.batch_exists(keys) == 4
    st.close()


def test_host_tier_mla_fp8_is_written_once_and_read_by_every_rank(sglang, tmp_path):
    """MLA's latent is the same on every TP rank, fp8 too: rank 0 writes, rank 1 (same
    directories) finds and reads rank 0's pages and writes none of its own."""
    h = sglang
    keys = h.make_page_keys(6, seed=41)
    st0, pool0 = _storage(h, [tmp_path], "mla", FP8, tp_rank=0, tp_size=2)
    src = pool0.alloc(6 * PAGE)
    h.fill_random(pool0, src, seed=42)
    want = h.page_bytes(pool0, src)
    assert all(st0.batch_set_v1(keys, src))
    st1, pool1 = _storage(h, [tmp_path], "mla", FP8, tp_rank=1, tp_size=2)
    assert st1.batch_exists(keys) == 6
    dst = pool1.alloc(6 * PAGE)
    assert all(st1.batch_get_v1(keys, dst))
    assert h.page_bytes(pool1, dst) == want
    assert st1.batch_set_v1(h.make_page_keys(2, seed=43), dst[:2 * PAGE]) == [False, False]
    st1.close()
    st0.close()


def test_host_tier_pipeline_stages_of_other_layers_keep_apart(sglang, tmp_path):
    """Stage 1 of 3 with 11 layers holds model layers [10, 21) under one partition and [11, 22)
    under another (SGLANG_PP_LAYER_PARTITION). A restart with the other partition on the same
    directories misses instead of restoring every layer's KV one layer off."""
    h = sglang
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from tutti_hicache.storage import TuttiStorage

    def stage(start):
        dev = MHATokenToKVPool(size=PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64,
                               layer_num=11, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False, start_layer=start, end_layer=start + 11)
        pool = h._build_host_pool(MHATokenToKVPoolHost, dev, "layer_first", PAGE, 8)
        sc = h.make_storage_config(model_name="m", pp_rank=1, pp_size=3, extra_config={
            "tutti_dirs": [str(tmp_path)], "tutti_capacity_gb": 0.05, "tutti_segment_gb": 1 / 64})
        st = TuttiStorage(sc, {})
        st.register_mem_pool_host(pool)
        return st, pool
    keys = h.make_page_keys(4, seed=3)
    st, pool = stage(10)
    src = pool.alloc(4 * PAGE)
    h.fill_random(pool, src, seed=4)
    assert all(st.batch_set_v1(keys, src))
    st.close()
    st, _ = stage(11)
    assert st.batch_exists(keys) == 0
    st.close()
    st, pool = stage(10)  # the first partition again: its pages
    assert st.batch_exists(keys) == 4
    st.close()


# ------------------------------------------------------------------ the weights behind the KV
def _scales(tmp_path, name, k):
    """An fp8 KV scales file (--quantization-param-path) giving every layer scale k."""
    import json
    p = tmp_path / name
    p.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(i): k for i in range(2)}}}}))
    return str(p)


def _weights_cases(tmp_path):
    """(server args of the first server, of others whose KV means something else): another
    checkpoint served under the same name, another --revision of the weights, other fp8 KV
    scales (the stored bytes are K / k_scale), another --quantization, another draft model."""
    base = {"model_path": "org/m", "served_model_name": "chat"}
    s1, s2 = _scales(tmp_path, "s1.json", 0.05), _scales(tmp_path, "s2.json", 1.0)
    return {**base, "quantization_param_path": s1}, [
        {**base, "model_path": "org/m-instruct", "quantization_param_path": s1},
        {**base, "revision": "v2", "quantization_param_path": s1},
        {**base, "quantization_param_path": s2},
        {**base},
        {**base, "quantization_param_path": s1, "quantization": "fp8"},
        {**base, "quantization_param_path": s1, "speculative_draft_model_path": "org/m-nextn"},
    ]


def test_host_tier_servers_of_other_weights_or_kv_scales_never_meet(sglang, tmp_path):
    """Two servers may answer to one --served-model-name with other weights, a --revision, other
    fp8 KV scales, quantization or draft: each gets its own namespace (before, the identity
    named the served name alone, and the second server read the first's bytes as its own)."""
    h = sglang
    keys = h.make_page_keys(4, seed=51)
    first, others = _weights_cases(tmp_path)
    st, pool = _storage(h, [tmp_path / "store"], "mha", FP8, args=first)
    src = pool.alloc(4 * PAGE)
    h.fill_random(pool, src, seed=52)
    assert all(st.batch_set_v1(keys, src))
    st.close()
    for args in others:
        st, _ = _storage(h, [tmp_path / "store"], "mha", FP8, args=args)
        assert st.batch_exists(keys) == 0, args
        st.close()
    copy = tmp_path / "copy.json"  # the same scales under another path: the same KV
    copy.write_text(Path(first["quantization_param_path"]).read_text())
    st, _ = _storage(h, [tmp_path / "store"], "mha", FP8,
                     args={**first, "quantization_param_path": str(copy),
                           "served_model_name": "other-name"})
    assert st.batch_exists(keys) == 4
    st.close()


def test_host_tier_byte_pool_without_a_known_kv_dtype_attaches_no_store(sglang, tmp_path):
    """An fp8 host pool holds bytes; with no server args published, e4m3 and e5m2 cannot be
    told apart: attaching refuses with a message rather than naming both uint8."""
    from sglang.srt.runtime_context import get_context

    from tutti_hicache.storage import TuttiStorage
    h = sglang
    pool = h.make_mha_host_pool("layer_first", 2, 2, 64, PAGE, FP8, 24)
    cfg = {"tutti_dirs": [str(tmp_path)], "tutti_capacity_gb": 0.1, "tutti_segment_gb": 1 / 64}
    st = TuttiStorage(h.make_storage_config(extra_config=cfg), {})
    override = get_context().override_server_args(model_path="dummy", kv_cache_dtype=None)
    override.install()
    try:
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            st.register_mem_pool_host(pool)
    finally:
        override.restore()
    assert st.store is None


def test_linker_servers_of_other_weights_or_kv_scales_never_meet(sg, tmp_path):
    toks = list(range(200, 216))
    first, others = _weights_cases(tmp_path)
    a = Rig([tmp_path / "store"], dtype=FP8, args=first)
    want = _write(a, toks, seed=3)
    a.close()
    for args in others:
        b = Rig([tmp_path / "store"], dtype=FP8, args=args)
        assert b.restore(toks)[0] == 0, args
        b.close()
    c = Rig([tmp_path / "store"], dtype=FP8, args={**first, "served_model_name": "renamed"})
    assert _restores(c, toks, want)  # the same weights under another name: its pages
    c.close()


# ------------------------------------------------------------------------------- both seams
@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "auto"), (FP8, "fp8_e4m3"), (FP8, "auto")],
                         ids=["bf16", "fp8_e4m3", "fp8-auto"])
def test_both_seams_name_one_kv_alike(sg, tmp_path, dtype, kv):
    """The host tier (a byte host pool named by --kv-cache-dtype) and the linker (a device pool
    that names its dtype) give one server's KV one identity, so their pages are one namespace;
    auto on an FP8 checkpoint is SGLang's e4m3 on both (it was "uint8" on the host tier)."""
    from tutti_hicache.testing.linker_rig import LAYERS, P
    r = Rig([tmp_path / "l"], dtype=dtype, args={"kv_cache_dtype": kv})
    try:
        linker = dict(r.linker.store.identity)
    finally:
        r.close()
    st, _ = _storage(sg, [tmp_path / "h"], "mha", dtype, page=P, kv=kv, mha=(LAYERS, 2, 8))
    try:
        assert st.store.identity == linker
        assert linker["dtype"] == str(dtype).replace("torch.", "")
    finally:
        st.close()
