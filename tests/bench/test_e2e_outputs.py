"""The e2e harness's output check (tutti_hicache/benchmarks/{weights,misplace}.py, e2e.outputs_vs):
the seeded checkpoint's file format, the logprob comparison, the misplaced-page control on a real
store, and the report's columns. No server, no GPU: the server run itself is bench/e2e_sglang.py's.
"""

import hashlib
import json
import struct

import numpy as np
import pytest

from tutti_hicache.benchmarks import configs, e2e, e2e_report, misplace, weights

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 200, "num_hidden_layers": 3, "tie_word_embeddings": False}


# ------------------------------------------------------------------ the seeded checkpoint
def _read_safetensors(path):
    """{name: (dtype, shape, raw bytes)} parsed by hand: the format's own definition."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and head.pop("__metadata__") == {"format": "pt"}
    body = raw[8 + n:]
    ends = sorted(v["data_offsets"] for v in head.values())
    assert ends[0][0] == 0 and ends[-1][1] == len(body)  # the whole buffer, no holes
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    return {k: (v["dtype"], tuple(v["shape"]), body[slice(*v["data_offsets"])]) for k, v in head.items()}


def _checkpoint(path):
    index = json.loads((path / weights.INDEX).read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        for name, t in _read_safetensors(path / fname).items():
            assert index["weight_map"][name] == fname
            out[name] = t
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(len(t[2]) for t in out.values())
    return out


def test_seeded_checkpoint_is_valid_sharded_and_deterministic(tmp_path):
    torch = pytest.importorskip("torch")
    layer_bytes = sum(2 * np.prod(s) for n, s, _ in weights.tensors(TINY) if ".layers.0." in n)
    weights.write_weights(str(tmp_path / "a"), TINY, seed=7, device="cpu", max_shard_bytes=2 * layer_bytes)
    weights.write_weights(str(tmp_path / "b"), TINY, seed=7, device="cpu", max_shard_bytes=2 * layer_bytes)
    weights.write_weights(str(tmp_path / "c"), TINY, seed=8, device="cpu", max_shard_bytes=2 * layer_bytes)
    a, b, c = (_checkpoint(tmp_path / x) for x in "abc")
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    hd = 64 // 4
    shapes = {"model.embed_tokens.weight": (200, 64), "lm_head.weight": (200, 64), "model.norm.weight": (64,),
              "model.layers.2.self_attn.q_proj.weight": (4 * hd, 64),
              "model.layers.2.self_attn.k_proj.weight": (2 * hd, 64),
              "model.layers.0.self_attn.o_proj.weight": (64, 4 * hd),
              "model.layers.1.mlp.down_proj.weight": (64, 96), "model.layers.1.mlp.up_proj.weight": (96, 64),
              "model.layers.0.post_attention_layernorm.weight": (64,)}
    for name, shape in shapes.items():
        assert a[name][:2] == ("BF16", shape)
    assert len(a) == 2 + 1 + 3 * 9
    assert a == b  # the same seed: the same bytes
    normal = [n for n, _, kind in weights.tensors(TINY) if kind == "normal"]
    assert all(a[n][2] != c[n][2] for n in normal)  # another seed: other values, tensor by tensor
    as_t = lambda t: torch.frombuffer(bytearray(t[2]), dtype=torch.bfloat16).float()
    assert (as_t(a["model.norm.weight"]) == 1).all() and (as_t(a["model.layers.1.input_layernorm.weight"]) == 1).all()
    q = as_t(a["model.layers.2.mlp.gate_proj.weight"])
    assert abs(q.mean().item()) < 0.004 and 0.018 < q.std().item() < 0.022
    assert a["model.layers.0.mlp.up_proj.weight"][2] != a["model.layers.1.mlp.up_proj.weight"][2]
    st = pytest.importorskip("safetensors.torch")  # the reference reader agrees
    for f in files:
        loaded = st.load_file(str(tmp_path / "a" / f))
        for name, t in loaded.items():
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == a[name][1]
            assert t.contiguous().view(torch.int16).numpy().tobytes() == a[name][2]


def test_a_checkpoint_already_there_is_kept_and_another_replaces_it(tmp_path):
    pytest.importorskip("torch")
    weights.write_weights(str(tmp_path), TINY, seed=1, device="cpu")
    f = next(tmp_path.glob("*.safetensors"))
    stamp = f.stat().st_mtime_ns
    weights.write_weights(str(tmp_path), TINY, seed=1, device="cpu")
    assert f.stat().st_mtime_ns == stamp
    weights.write_weights(str(tmp_path), dict(TINY, num_hidden_layers=1), seed=1, device="cpu")
    index = json.loads((tmp_path / weights.INDEX).read_text())
    assert not any(".layers.2." in n for n in index["weight_map"])
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))


@pytest.mark.slow
def test_write_model_and_the_server_flag(tmp_path, monkeypatch):
    """dummy: a config.json and the tokenizer only, and --load-format dummy; seeded: the checkpoint beside it (drawn
    in a child process), fp32 logits in the config, and the server loads it (no --load-format)."""
    pytest.importorskip("torch")
    configs.write_model(str(tmp_path / "d"), 2)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "tokenizer.json",
                                                                   "tokenizer_config.json"]
    monkeypatch.setitem(configs.MODELS, "llama3-8b", dict(configs.LLAMA3_8B, **{
        k: v for k, v in TINY.items() if k != "num_hidden_layers"}))
    configs.write_model(str(tmp_path / "s"), 2, weights="seeded", seed=3)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["enable_lm_head_output_fp32"] and cfg["num_hidden_layers"] == 2
    assert len(_checkpoint(tmp_path / "s")) == 2 + 1 + 2 * 9
    args = type("A", (), dict(model=str(tmp_path), max_total_tokens=1000, tutti_dirs=str(tmp_path),
                              capacity_gb=1, out_dir=str(tmp_path)))()
    argv, _ = configs.server_cmd(args, "recompute", 30000)
    assert argv[argv.index("--load-format") + 1] == "dummy" and "--skip-tokenizer-init" in argv
    args.weights = "seeded"
    argv, _ = configs.server_cmd(args, "recompute", 30000)
    assert "--load-format" not in argv and "--skip-tokenizer-init" in argv
    with pytest.raises(ValueError):
        configs.write_model(str(tmp_path / "x"), 2, weights="random")


def _moe(shape: str, **small) -> dict:
    return dict(configs.MODELS[shape], vocab_size=200, **small)


def test_seeded_moe_and_mla_checkpoints_name_every_expert_as_hf_ships_them(tmp_path):
    """Qwen3-MoE: per-head q/k norms and every layer routed (gate + experts one by one), none
    shared; DeepSeek-V2(-Lite): MLA without a q LoRA (q_proj, the joint kv_a projection with the
    rope dims, its latent norm, kv_b up to heads x (nope + v)), a dense MLP before
    first_k_dense_replace, then routed experts plus shared ones n_shared_experts wide. The names
    are the ones SGLang's loaders map (experts.E.{gate,up,down}_proj, shared_experts.*)."""
    q = _moe("qwen3-30b-a3b", hidden_size=32, moe_intermediate_size=8, num_experts=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2)
    specs = {n: s for n, s, _ in weights.tensors(q)}
    layer = {n[len("model.layers.1."):]: s for n, s in specs.items() if n.startswith("model.layers.1.")}
    assert layer == {
        "input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,),
        "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
        "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
        "self_attn.q_norm.weight": (8,), "self_attn.k_norm.weight": (8,), "mlp.gate.weight": (3, 32),
        **{f"mlp.experts.{e}.{p}.weight": ((32, 8) if p == "down_proj" else (8, 32))
           for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}}
    assert specs["lm_head.weight"] == (200, 32) and len(specs) == 3 + 2 * len(layer)

    d = _moe("deepseek-v2-lite", hidden_size=32, intermediate_size=24, moe_intermediate_size=8,
             n_routed_experts=3, n_shared_experts=2, num_attention_heads=2, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_hidden_layers=3)
    specs = {n: s for n, s, _ in weights.tensors(d)}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == (2 * (8 + 4), 32)
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 4, 32)
    assert specs["model.layers.0.self_attn.kv_a_layernorm.weight"] == (16,)
    assert specs["model.layers.0.self_attn.kv_b_proj.weight"] == (2 * (8 + 6), 16)
    assert specs["model.layers.0.self_attn.o_proj.weight"] == (32, 2 * 6)
    assert specs["model.layers.0.mlp.gate_proj.weight"] == (24, 32)  # dense before first_k_dense_replace
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in specs)
    for i in (1, 2):
        p = f"model.layers.{i}.mlp."
        assert specs[p + "gate.weight"] == (3, 32) and p + "gate_proj.weight" not in specs
        assert specs[p + "experts.2.down_proj.weight"] == (32, 8) and p + "experts.3.up_proj.weight" not in specs
        assert specs[p + "shared_experts.up_proj.weight"] == (16, 32)
    with pytest.raises(ValueError, match="q_lora_rank"):
        weights.tensors(dict(d, q_lora_rank=64))
    with pytest.raises(ValueError, match="model_type"):
        weights.tensors(dict(d, model_type="gpt2"))

    # the checkpoint itself: every tensor named, drawn and readable, norms 1
    weights.write_weights(str(tmp_path), d, seed=2, device="cpu")
    got = _checkpoint(tmp_path)
    assert {n: shape for n, (_, shape, _) in got.items()} == specs

    def values(name):  # bf16 -> float32: the high half of the word
        return (np.frombuffer(got[name][2], np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert (values("model.layers.2.self_attn.kv_a_layernorm.weight") == 1).all()
    assert 0.01 < values("model.layers.2.mlp.experts.0.gate_proj.weight").std() < 0.04


# ------------------------------------------------------------------ the logprob comparison
def _out(ids, tops):
    return {"output_ids": ids, "top_logprobs": tops}


def test_top_logprob_comparison():
    want = _out([5, 6], [[[-0.5, 5], [-1.2, 9], [-2.0, 3]], [[-0.1, 6], [-3.0, 2], [-3.5, 1]]])
    close = _out([5, 6], [[[-0.503, 5], [-1.2, 9], [-2.0, 3]], [[-0.1, 6], [-3.0, 2], [-3.5, 1]]])
    assert e2e.compare_output(want, want) == (True, 0.0)
    eq, diff = e2e.compare_output(close, want)
    assert eq and diff == pytest.approx(0.003)
    far = _out([5, 6], [[[-0.5, 5], [-1.2, 9], [-2.0, 3]], [[-0.1, 6], [-3.05, 2], [-3.5, 1]]])
    assert e2e.compare_output(far, want, tol=0.01) == (False, pytest.approx(0.05))
    assert e2e.compare_output(far, want, tol=0.06)[0]
    # a near tie at the k-th place: another token by 0.004 counts 0.004; by 0.5, 0.5
    tie = _out([5, 6], [[[-0.5, 5], [-1.2, 9], [-1.996, 7]], [[-0.1, 6], [-3.0, 2], [-3.5, 1]]])
    assert e2e.compare_output(tie, want, tol=0.01) == (True, pytest.approx(0.004))
    swap = _out([5, 6], [[[-0.5, 5], [-1.2, 9], [-1.5, 7]], [[-0.1, 6], [-3.0, 2], [-3.5, 1]]])
    assert e2e.compare_output(swap, want, tol=0.2) == (False, pytest.approx(0.5))
    # the same logprobs, other greedy ids: not equal
    assert not e2e.compare_output(_out([5, 7], want["top_logprobs"]), want)[0]
    # greedy ids that part at a near tie (rounding can swap two top logits): compared up to and
    # including that position, then no further (later positions continue other tokens)
    a = _out([5, 6, 1], [[[-0.5, 5], [-1.2, 9]], [[-0.70, 6], [-0.72, 2]], [[-0.1, 1], [-2.0, 4]]])
    b = _out([5, 2, 3], [[[-0.5, 5], [-1.2, 9]], [[-0.71, 2], [-0.715, 6]], [[-0.3, 3], [-0.9, 8]]])
    assert e2e.compare_output(a, b, tol=0.05) == (True, pytest.approx(0.015))
    assert not e2e.compare_output(a, b, tol=0.01)[0]
    c = _out([5, 2, 3], [[[-0.5, 5], [-1.2, 9]], [[-0.4, 2], [-1.0, 6]], [[-0.3, 3], [-0.9, 8]]])
    assert e2e.compare_output(a, c, tol=0.05)[0] is False  # not a tie: 0.3 apart in a
    d = _out([5, 4, 3], [[[-0.5, 5], [-1.2, 9]], [[-0.70, 4], [-0.71, 6]], [[-0.3, 3], [-0.9, 8]]])
    assert e2e.compare_output(a, d, tol=0.05)[0] is False  # d's token is not in a's top-k
    # missing fields: logprobs on one side only, or fewer positions, are no match; none on
    # either side compares the ids alone
    assert e2e.compare_output({"output_ids": [5, 6]}, want) == (False, None)
    assert e2e.compare_output(want, {"output_ids": [5, 6]}) == (False, None)
    assert e2e.compare_output(_out([5, 6], want["top_logprobs"][:1]), want) == (False, None)
    assert e2e.compare_output(_out([5, 6], [[], []]), want) == (False, None)
    assert e2e.compare_output({"output_ids": [5, 6]}, {"output_ids": [5, 6]}) == (True, None)
    assert e2e.compare_output({"output_ids": [5, 6]}, {"output_ids": [5, 9]}) == (False, None)


def _runs(**linker_extra):
    tops = lambda d: [[[-0.5 - d, 5], [-1.0, 9]], [[-0.2, 6], [-2.0, 4]]]
    rec = lambda rid, d, ids=(5, 6): {"id": rid, "ttft_s": 0.1, "output_ids": list(ids), "top_logprobs": tops(d)}
    ref = {"config": "recompute", "medium": "m", "phases": {
        "first": [rec("first/4096/0", 0)], "sweep": [rec("sweep/4096/0.5", 0), rec("sweep/4096/0.5/l1", 0),
                                                     rec("sweep/8192/0.5", 0)]}}
    linker = {"config": "tutti-linker+misplace", "medium": "m", **linker_extra, "phases": {
        "warm": [rec("warm/4096/0", 0.3)], "first": [rec("first/4096/0", 0.002)],
        "sweep": [rec("sweep/4096/0.5", 0.5), rec("sweep/4096/0.5/l1", 0.03, ids=(5, 7)),
                  rec("sweep/8192/0.5", 0.004)]}}
    return [ref, linker]


def test_outputs_vs_recompute_per_phase():
    eq = e2e.outputs_vs(_runs())["tutti-linker+misplace@m"]
    assert eq["warm"] == {"compared": 0, "equal": 0, "with_logprobs": 0, "max_logprob_diff": None, "mismatches": []}
    assert eq["first"]["equal"] == 1 and eq["first"]["max_logprob_diff"] == pytest.approx(0.002)
    assert eq["sweep"]["compared"] == 3 and eq["sweep"]["equal"] == 1 and eq["sweep"]["with_logprobs"] == 3
    assert eq["sweep"]["mismatches"] == ["sweep/4096/0.5", "sweep/4096/0.5/l1"]
    assert eq["sweep"]["max_logprob_diff"] == pytest.approx(0.5)
    assert e2e.outputs_vs(_runs(), tol=0.6)["tutti-linker+misplace@m"]["sweep"]["mismatches"] == ["sweep/4096/0.5/l1"]


def test_report_columns_and_the_control_verdict():
    affected = ["sweep/4096/0.5", "sweep/4096/0.5/l1", "rate1/0"]  # rate1/0 never ran: not counted
    runs = _runs(misplaced={"context": 4096, "page": 4, "documents": [0, 1], "affected": affected,
                            "namespaces": ["tutti-x"], "swapped": 1, "verified": 1})
    text = e2e_report.report_markdown(runs, 1000)
    assert "| m | tutti-linker+misplace | 100 | - (-) | - |  | 2/4, max logprob diff 0.5 | - |" in text
    assert "| m | tutti-linker+misplace | sweep | 3 | 1 | 3 | 0.5 | sweep/4096/0.5, sweep/4096/0.5/l1 |" in text
    assert "| m | tutti-linker+misplace | page 4 of C=4096 documents 0 and 1 swapped (1/1 verified) | 2 | 2 | 0 " \
        "| caught |" in text
    # the linker's pages loaded / copied over its two server starts (each start's stats file)
    runs[1]["tutti_stats"] = [{"linker": {"load_pages": 300, "load_copied_pages": 0}},
                              {"linker": {"load_pages": 200, "load_copied_pages": 100}}]
    assert "| m | tutti-linker+misplace | 100 | - (-) | 500 / 100 |" in e2e_report.report_markdown(runs, 1000)
    runs[1]["phases"]["sweep"][0]["top_logprobs"] = runs[0]["phases"]["sweep"][0]["top_logprobs"]
    row, = e2e_report.control_rows(runs)
    assert (row["affected"], row["caught"], row["verdict"]) == (2, 1, "NOT caught")
    runs[1]["misplaced"] = {"error": "ValueError('not in the store')"}
    assert e2e_report.control_rows(runs)[0]["verdict"] == "did not run"
    assert "ValueError('not in the store')" in e2e_report.report_markdown(runs, 1000)


def test_report_with_the_reference_of_another_call_and_from_the_json_alone():
    """--reference: recompute ran in an earlier call. The report takes it as refs (never a row of
    its own), and a report rebuilt from the JSON alone shows the check stored in each run."""
    affected = ["sweep/4096/0.5", "sweep/4096/0.5/l1"]
    ref, linker = _runs(misplaced={"context": 4096, "page": 4, "documents": [0, 1], "affected": affected,
                                   "namespaces": ["tutti-x"], "swapped": 1, "verified": 1})
    cell = "| m | tutti-linker+misplace | 100 | - (-) | - |  | 2/4, max logprob diff 0.5 | - |"
    text = e2e_report.report_markdown([linker], 1000, refs=[ref])
    assert cell in text and "| m | recompute |" not in text
    assert "| 2 | 2 | 0 | caught |" in text
    bare = e2e_report.report_markdown([linker], 1000)  # no reference, nothing stored: no check
    assert "| no recompute outputs to compare |" in bare  # not "NOT caught"
    assert "| m | tutti-linker+misplace | 100 | - (-) | - |  | - | - |" in bare
    linker["outputs_vs_recompute"] = e2e.outputs_vs([ref, linker])["tutti-linker+misplace@m"]
    assert cell in e2e_report.report_markdown([linker], 1000)
    assert "| m | tutti-linker+misplace | sweep | 3 | 1 | 3 | 0.5 |" in e2e_report.report_markdown([linker], 1000)


def test_misplace_is_a_variant_of_restarting_tutti_configurations_only():
    assert configs.split_config("tutti-linker+misplace") == ("tutti-linker", {})
    assert configs.split_config("tutti-host+tutti_threads=4+misplace") == ("tutti-host", {"tutti_threads": "4"})
    assert configs.misplaced("tutti-linker+misplace") and not configs.misplaced("tutti-linker")
    for bad in ("dram+misplace", "recompute+misplace", "tutti-mooncake+misplace", "file+misplace"):
        with pytest.raises(ValueError):
            configs.split_config(bad)


# ------------------------------------------------------------------ the misplaced page
def _keys(ids, page_size=e2e.PAGE):
    """A stand-in for SGLang's key chain (its hash module is built on the GPU machine)."""
    out, prior = [], b""
    for i in range(0, len(ids) // page_size * page_size, page_size):
        prior = hashlib.sha256(prior + np.asarray(ids[i:i + page_size], dtype=np.int64).tobytes()).digest()
        out.append(prior.hex())
    return out


def test_misplace_swaps_two_documents_pages_with_valid_checksums(tmp_path):
    """A store written as a server would (pages of two documents under their key chains): after
    misplace, page 4 of document 0's key holds document 1's page 4 and the other way round, both
    read back through a fresh store as valid (checksummed) hits, and every other page is as it
    was. The requests it names are those whose cached prefix holds that page."""
    from tutti_hicache.config import TuttiConfig
    from tutti_hicache.engine import extension
    from tutti_hicache.layout import PageGeometry, strided
    from tutti_hicache.store import ObjectStore

    dirs = [str(tmp_path / "a" / "tutti"), str(tmp_path / "b" / "tutti")]
    geom = PageGeometry("mha", 2, e2e.PAGE, 2 * 32, 2 * 32)
    ident = {"model": "unit", "tp": [0, 1]}
    cfg = TuttiConfig.from_sources({"tutti_dirs": dirs, "tutti_capacity_gb": 0.05, "tutti_segment_gb": 1 / 256},
                                   env={})
    wl = e2e.Workload((1024, 2048), docs=2, q_tokens=32)
    docs = [wl.document(1024, d) for d in (0, 1)]
    keys = [_keys(d) for d in docs]
    n = len(keys[0])
    store = ObjectStore(cfg, geom, ident)
    lay = store.layout
    pages = np.random.default_rng(3).integers(0, 256, (2, n, lay.payload_nbytes), dtype=np.uint8)
    pages[1, :e2e.SYSTEM_TOKENS // e2e.PAGE] = pages[0, :e2e.SYSTEM_TOKENS // e2e.PAGE]  # the shared prompt
    bufs = []
    for d in (0, 1):
        buf = extension().AlignedBuffer(n * lay.payload_nbytes)
        np.frombuffer(buf, dtype=np.uint8)[:] = pages[d].reshape(-1)
        bufs.append(buf)
        addrs = lay.staged_objects(strided(buf.address, n, lay.payload_nbytes))
        assert store.write_pages(keys[d], addrs, aligned=not lay.padded).all()
    store.close()

    reqs = [wl.first(), *e2e.sweep_requests(wl, [0.5, 0.9])]
    out = misplace.misplace(wl, dirs, 0.05, reqs, keys=_keys)
    p = e2e.SYSTEM_TOKENS // e2e.PAGE
    assert out["context"] == 1024 and out["page"] == p and out["keys"] == [keys[0][p], keys[1][p]]
    assert out["swapped"] == out["verified"] == len(out["namespaces"]) == 1
    assert sorted(out["affected"]) == sorted(r.id for r in reqs if r.context == 1024)

    store = ObjectStore(cfg, geom, ident)
    try:
        for d in (0, 1):
            ok, data, _, _ = misplace._read(store, keys[d])
            assert ok.all()  # every page a valid hit, its checksum verified on the read
            got, want = misplace._payload(data, lay), misplace._payload(pages[d], lay)
            other = misplace._payload(pages[1 - d], lay)
            assert (got[p] == other[p]).all() and not (got[p] == want[p]).all()
            rest = [i for i in range(n) if i != p]
            assert (got[rest] == want[rest]).all()
        assert len(store) == 2 * n - e2e.SYSTEM_TOKENS // e2e.PAGE  # the shared system prompt once
    finally:
        store.close()
    with pytest.raises(ValueError):
        misplace.misplace(e2e.Workload((1024,), docs=1), dirs, 0.05, reqs, keys=_keys)


# ------------------------------------------------------------------ the client's request and parsing
@pytest.mark.parametrize("incremental", [False, True])
def test_one_request_asks_for_top_logprobs_and_keeps_them(incremental, generate_stub):
    """one_request against a stand-in /generate streaming as SGLang does (cumulative chunks, or
    incremental ones): the body asks for top-k logprobs of the output positions only, and the
    record keeps [[logprob, token id]] per output position."""
    from tutti_hicache.benchmarks.server import one_request
    tops = [[[-0.1, 5, None], [-2.0, 8, None]], [[-0.3, 6, None], [-1.5, 2, None]]]

    def stream(write):
        for i in (1, 2):
            lo = i - 1 if incremental else 0
            chunk = {"output_ids": [5, 6][lo:i], "meta_info": {"output_top_logprobs": tops[lo:i],
                                                              "cached_tokens": 64}}
            write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        write(b"data: [DONE]\n\n")
    with generate_stub(stream=stream, top_logprobs=2) as (srv, bodies):
        rec = one_request(srv, e2e.Request("r", [1, 2, 3], 3, 0), 2)
        srv.top_logprobs = 0
        plain = one_request(srv, e2e.Request("r", [1, 2, 3], 3, 0), 2)
    assert bodies[0]["return_logprob"] is True and bodies[0]["top_logprobs_num"] == 2
    assert bodies[0]["logprob_start_len"] == -1 and "return_logprob" not in bodies[1]
    assert rec["output_ids"] == [5, 6] and rec["top_logprobs"] == [[[-0.1, 5], [-2.0, 8]], [[-0.3, 6], [-1.5, 2]]]
    assert "top_logprobs" not in plain and plain["output_ids"] == [5, 6]


def test_misplace_swaps_the_first_document_page_at_the_workloads_page_size(monkeypatch):
    """misplace(wl, ...) names the first page after the system prompt in the workload's own pages
    (256 / 16 = page 16 at --page-size 16, page 4 at 64) and keys pages of that size."""
    seen = []
    monkeypatch.setattr(misplace, "misplace_docs",
                        lambda docs, page, dirs, cap, reqs, keys, page_size: seen.append((page, page_size)) or {})
    for size in (16, 64):
        misplace.misplace(e2e.Workload((1024,), docs=2, q_tokens=8, page=size), ["/x"], 1.0, [])
    assert seen == [(16, 16), (4, 64)]


def test_misplace_control_names_the_later_requests_and_survives_a_failure(monkeypatch):
    """e2e_sglang.misplace_control: the store under each tutti directory's `tutti`, the server's
    capacity, every request sent after the restart as candidates; a failure is recorded, not raised."""
    from tutti_hicache.benchmarks import e2e_sglang
    seen = []

    def fake(wl, dirs, capacity_gb, requests):
        seen.append((dirs, capacity_gb, [r.id for r in requests]))
        if len(seen) > 1:
            raise ValueError("no such key")
        return {"swapped": 1}
    monkeypatch.setattr(misplace, "misplace", fake)
    args = type("A", (), dict(tutti_dirs="/x,/y", capacity_gb=7.0, fractions=[0.5], rates=[1.0], rate_requests=2))()
    wl = e2e.Workload((1024,), docs=2, q_tokens=8)
    assert e2e_sglang.misplace_control(args, wl) == {"swapped": 1}
    assert seen[0][:2] == (["/x/tutti", "/y/tutti"], 7.0)
    assert seen[0][2] == ["first/1024/0", "sweep/1024/0.5", "sweep/1024/0.5/l1", "rate1/0", "rate1/1"]
    assert e2e_sglang.misplace_control(args, wl) == {"error": "ValueError('no such key')"}


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_any_write(tmp_path, monkeypatch):
    """A 48-layer MoE checkpoint is ~60 GB: on a disk without room the writer names the sizes and
    --layers instead of filling the disk; the shards a rewrite would replace count as free."""
    import os as _os
    real = _os.statvfs

    class Small:
        f_bavail, f_frsize = 10, 4096  # 40 KiB free
    monkeypatch.setattr(weights.os, "statvfs", lambda p: Small() if str(p).startswith(str(tmp_path)) else real(p))
    with pytest.raises(OSError, match="--layers"):
        weights.write_weights(str(tmp_path / "w"), TINY, device="cpu")
    assert not list((tmp_path / "w").glob("*.safetensors*"))
    need = sum(int(np.prod(s)) * 2 for _, s, _ in weights.tensors(TINY))
    (tmp_path / "w" / "model-00001-of-00001.safetensors").write_bytes(b"\0" * need)  # an old one
    weights.write_weights(str(tmp_path / "w"), TINY, device="cpu")


def test_the_sweeps_extend_sizes_are_compiled_before_it(generate_stub):
    """warm_extend_sizes: per size of the sweep, a prompt of exactly two pages (all of it cached
    after it ran), then the same prompt extended by exactly that many new tokens, one output token
    each (e2e.extend_sizes): the extend the server computes is the sweep's, to the token."""
    from tutti_hicache.benchmarks.server import warm_extend_sizes
    wl = e2e.Workload((1024, 2048), docs=2, q_tokens=8)
    sweep = e2e.sweep_requests(wl, [0.5, 0.9])
    sizes = e2e.extend_sizes(sweep)
    assert sizes == sorted({len(r.ids) - r.cached for r in sweep}) and len(sizes) >= 2
    with generate_stub() as (srv, bodies):
        out = warm_extend_sizes(srv, sizes, 64)
    assert out["ok"] and out["sizes"] == sizes and len(bodies) == 2 * len(sizes)
    for m, (head, ext) in zip(sizes, zip(bodies[::2], bodies[1::2])):
        assert len(head["input_ids"]) == 2 * 64 and ext["input_ids"][:128] == head["input_ids"]
        assert len(ext["input_ids"]) - 128 == m and ext["sampling_params"]["max_new_tokens"] == 1
    heads = [b["input_ids"] for b in bodies[::2]]
    assert len({tuple(h) for h in heads}) == len(heads)  # a new prefix per size: no hit on another's
