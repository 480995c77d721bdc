"""The identity rules both SGLang adapters share: who writes, and what a pool's identity holds."""

from types import SimpleNamespace

from tutti_hicache.config import TuttiConfig
from tutti_hicache.identity import identity_for, is_writer, make_identity
from tutti_hicache.layout import PageGeometry


def test_mla_writes_from_rank_0_only_mha_from_every_rank():
    assert [is_writer("mla", r) for r in range(3)] == [True, False, False]
    assert [is_writer("mha", r) for r in range(3)] == [True, True, True]


def test_identity_of_a_pool():
    cfg = TuttiConfig(revision="r1")
    mha = SimpleNamespace(dtype="torch.bfloat16", head_num=8, head_dim=128)  # no v_head_dim
    g = PageGeometry("mha", 2, 16, 2048, 2048)
    ident = identity_for(cfg, mha, g, model="m", pp=(0, 1), cp=(0, 1), tp=(1, 2))
    assert ident["heads"] == [8, 128, 128] and ident["tp"] == [1, 2]
    assert ident["dtype"] == "bfloat16" and ident["revision"] == "r1" and ident["model"] == "m"
    mla = SimpleNamespace(dtype="torch.bfloat16")
    ident = identity_for(cfg, mla, PageGeometry("mla", 2, 16, 1152, 0), model="m", pp=(0, 1),
                         cp=(0, 1), tp=(1, 2))
    assert "heads" not in ident and "tp" not in ident  # the same latent KV on every rank


def test_a_byte_pool_is_named_by_the_servers_kv_cache_dtype():
    """SGLang's host pools hold fp8 KV as uint8: fp8_e4m3 and fp8_e5m2 (the same bytes per
    token, other numbers) must not share a namespace, and the host tier names them as the
    linker's device pools do."""
    from tutti_hicache.identity import kv_dtype
    assert kv_dtype("torch.uint8", "fp8_e4m3") == "float8_e4m3fn" == kv_dtype("torch.float8_e4m3fn")
    assert kv_dtype("torch.uint8", "fp8_e5m2") == "float8_e5m2"
    assert kv_dtype("torch.uint8", "fp8_e4m3") != kv_dtype("torch.uint8", "fp8_e5m2")
    assert kv_dtype("torch.bfloat16", "fp8_e4m3") == "bfloat16"  # a pool that says what it holds
    assert kv_dtype("torch.uint8", None) == "uint8"  # unknown: the host tier attaches nothing
    # auto holds bytes only for a checkpoint whose kv_cache_quant_algo is FP8: SGLang's e4m3
    assert kv_dtype("torch.uint8", "auto") == "float8_e4m3fn"
    assert kv_dtype("torch.uint8", "int4") == "uint8:int4"


def test_rocm_fp8_bytes_are_named_as_its_device_pools_name_them(monkeypatch):
    """SGLang on ROCm keeps fp8_e4m3 and fp8_e5m2 KV in the platform's fp8 type: e4m3fnuz on
    MI300 (gfx94x), whose bytes are other numbers than CUDA's e4m3fn, so a ROCm server and a
    CUDA one must not share pages; elsewhere on ROCm both kinds are e4m3fn bytes."""
    import torch

    from tutti_hicache import identity

    monkeypatch.setattr(torch.version, "hip", "6.3.0", raising=False)
    arch = {"name": "gfx942:sramecc+:xnack-"}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(gcnArchName=arch["name"]))
    mi300 = identity.kv_dtype("torch.uint8", "fp8_e4m3")
    assert mi300 == "float8_e4m3fnuz" == identity.kv_dtype("torch.float8_e4m3fnuz")
    assert identity.kv_dtype("torch.uint8", "fp8_e5m2") == mi300  # the same bytes there
    arch["name"] = "gfx950"
    assert identity.kv_dtype("torch.uint8", "fp8_e5m2") == "float8_e4m3fn"

    def no_device(i):
        raise RuntimeError("no ROCm device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device)
    assert identity.kv_dtype("torch.uint8", "fp8_e4m3") == "uint8:rocm:fp8_e4m3"
    arch["name"] = "gfx942"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(gcnArchName=arch["name"]))
    assert identity.kv_dtype("torch.uint8", "auto") == "float8_e4m3fnuz"  # its fp8 there
    monkeypatch.setattr(torch.version, "hip", None)
    assert identity.kv_dtype("torch.uint8", "fp8_e4m3") == "float8_e4m3fn"


def test_a_pipeline_stage_is_named_by_its_first_layer():
    """Stage 1 of 3 holds layers [10, 21) under one partition and [11, 22) under another
    (SGLANG_PP_LAYER_PARTITION): the same rank and layer count, other layers, so other pages. A
    pool starting at layer 0 keeps the identity it always had."""
    cfg = TuttiConfig()
    g = PageGeometry("mha", 11, 16, 2048, 2048)

    def ident(start):
        pool = SimpleNamespace(dtype="torch.bfloat16", head_num=8, head_dim=128, start_layer=start)
        return identity_for(cfg, pool, g, model="m", pp=(1, 3), cp=(0, 1), tp=(0, 1))
    assert ident(10) != ident(11) and ident(10)["first_layer"] == 10
    before = identity_for(cfg, SimpleNamespace(dtype="torch.bfloat16", head_num=8, head_dim=128), g,
                          model="m", pp=(1, 3), cp=(0, 1), tp=(0, 1))
    assert ident(0) == ident(None) == before and "first_layer" not in before


def test_weights_of_names_the_weights_and_only_what_is_set(tmp_path):
    """A plain server's identity is what it was (its model path, which is SGLang's default
    served name, and nothing more); each setting that changes the KV is named when set."""
    from tutti_hicache.identity import weights_of
    plain = SimpleNamespace(model_path="org/m", served_model_name="chat", revision=None,
                            quantization=None, quantization_param_path=None,
                            speculative_draft_model_path=None,
                            speculative_draft_model_revision="main")
    assert weights_of(plain) == ("org/m", {})
    assert weights_of(None) == ("", {})
    scales = tmp_path / "scales.json"
    scales.write_text("{}")
    model, w = weights_of(SimpleNamespace(**{**vars(plain), "revision": "v2", "quantization": "fp8",
                                             "quantization_param_path": str(scales),
                                             "speculative_draft_model_path": "org/d"}))
    assert model == "org/m" and w["model_revision"] == "v2" and w["quantization"] == "fp8"
    assert w["kv_scales"].startswith("sha256:") and w["draft"] == "org/d"
    assert w["draft_revision"] == "main"
    cfg = TuttiConfig(dirs=("/tmp",))
    g = PageGeometry("mha", 2, 16, 256, 256)
    base = dict(model="org/m", geometry=g, dtype="bfloat16", pp=(0, 1), cp=(0, 1), tp=(0, 1),
                heads=[2, 64, 64])
    assert make_identity(cfg, **base, weights={}) == make_identity(cfg, **base)
    assert make_identity(cfg, **base, weights=w) != make_identity(cfg, **base)
