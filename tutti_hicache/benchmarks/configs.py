"""The end-to-end server benchmark's configurations: the SGLang server each one starts.

At a glance:
    CONFIGS, LINKERS, PERSISTENT, TUTTI, CLUSTER       the configuration names and their kinds
    split_config("tutti-linker+tutti_threads=4") -> ("tutti-linker", {"tutti_threads": "4"})
    MODELS, kv_bytes_per_token(shape, layers, kv_cache_dtype)   model shapes (Llama-3-8B/70B, Qwen3
                                                       MoE, DeepSeek-V2-Lite MLA) and their KV
    write_model(path, layers, weights="dummy", shape)  a config.json of a shape (and with weights
                                                       "seeded", its weights: weights.py)
    graph_flags(max_bs) / tutti_config(args, config)   CUDA graph flags; tutti's settings of a run
    server_cmd(args, config, port) -> (argv, env)      one configuration's server
    lmcache_port(port)                                 the LMCache daemon's port beside it
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from ..layout import align_up
from .e2e import PAGE
from .lmcache_daemon import CONFIGS as LMCACHE
from .lmcache_daemon import write_client_config


CONFIGS = ("recompute", "dram", "file", "nixl", "tutti-host", "tutti-host-readme", "tutti-host-defaults",
           "tutti-linker", "tutti-linker-dynamic", "tutti-tiered", "tutti-mooncake", *LMCACHE)
CLUSTER = "tutti-mooncake"  # two servers: A warms (SSD + its Mooncake segment), B reads remote hits
# tutti-linker(-dynamic): the SSD only (tutti_host_gb 0); tutti-tiered: the linker with its DRAM
# tier of --dram-gb in front (the same host GB as `dram`'s pool)
LINKERS = ("tutti-linker", "tutti-linker-dynamic", "tutti-tiered")
# tutti-host: the harness's HiCache flags (a --host-gb pool like file and nixl); -readme: the
# README's command exactly; -defaults: only the backend named, every other HiCache flag SGLang's
HOSTS = ("tutti-host", "tutti-host-readme", "tutti-host-defaults")
# LMCache's daemon outlives SGLang's restarts (lmcache_daemon.py): what it holds survives them
PERSISTENT = {"file", "nixl", *HOSTS, *LINKERS, *LMCACHE}
TUTTI = {*HOSTS, CLUSTER, *LINKERS}
README_HOST_FLAGS = ["--enable-hierarchical-cache", "--hicache-mem-layout", "layer_first",
                     "--hicache-storage-backend", "tutti", "--hicache-storage-prefetch-policy",
                     "wait_complete", "--hicache-ratio", "2"]


def tutti_settings(parts: list, name: str) -> dict:
    """["tutti_threads=4", "tutti_verify=false"] -> {"tutti_threads": "4", ...}; anything else in
    parts (an empty one too) is an error naming `name`."""
    over = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("tutti_"):
            raise ValueError(f"{name!r}: a variant is +tutti_KEY=VALUE, not {part!r}")
        over[key] = value
    return over


MISPLACE = "misplace"  # a harness variant, not a setting: the output check's negative control


# an LMCache variant, not a setting: its daemon's --supported-transfer-mode engine_driven (SGLang's
# worker moves the KV through shared memory) instead of LMCache's default lmcache_driven (the daemon
# writes SGLang's pool through CUDA IPC)
ENGINE_DRIVEN = "engine_driven"


def split_config(name: str) -> tuple[str, dict]:
    """A configuration name with tutti settings after it, for an A/B inside one run:
    "tutti-linker+tutti_threads=4+tutti_verify=false" -> ("tutti-linker", {...}). The variant keeps
    its whole name in the report, its stats files and its outputs; only tutti configurations
    take settings. "+misplace" (misplaced(name)) is the harness's negative control, no setting:
    a tutti configuration that restarts on its store (tutti-host, the linkers) whose store gets
    one page of a warmed document under another document's key before the restart.
    "+engine_driven" (lmcache_transfer_mode(name)) is an LMCache variant: SGLang's worker moves
    the KV instead of the daemon."""
    base, *parts = name.split("+")
    if base not in CONFIGS:
        raise ValueError(f"unknown configuration {base!r} (one of {', '.join(CONFIGS)})")
    if ENGINE_DRIVEN in parts and base not in LMCACHE:
        raise ValueError(f"{name!r}: +{ENGINE_DRIVEN} is an LMCache variant ({', '.join(LMCACHE)})")
    over = tutti_settings([p for p in parts if p not in (MISPLACE, ENGINE_DRIVEN)], name)
    if over and base not in TUTTI:
        raise ValueError(f"{name!r}: only tutti configurations take tutti settings")
    if MISPLACE in parts and not (base in TUTTI and base in PERSISTENT):
        raise ValueError(f"{name!r}: +{MISPLACE} needs a tutti configuration that restarts on its "
                         f"store ({', '.join((*HOSTS, *LINKERS))})")
    return base, over


def lmcache_transfer_mode(name: str) -> str:
    """The LMCache daemon's --supported-transfer-mode for a configuration name: engine_driven
    with the +engine_driven variant, else LMCache's default lmcache_driven."""
    return ENGINE_DRIVEN if ENGINE_DRIVEN in name.split("+")[1:] else "lmcache_driven"


def misplaced(name: str) -> bool:
    """Whether a configuration name carries the +misplace negative control (split_config)."""
    return MISPLACE in name.split("+")[1:]


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


# The geometries issue-33-style runs use (the public configurations' shapes; weights dummy or,
# for the Llama shapes, seeded): dense GQA, a 70B-class layer, GQA + MoE, MLA + MoE
MODELS = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_key_value_heads=8),
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "norm_topk_prob": False,
        "scoring_func": "softmax", "routed_scaling_factor": 1.0, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}
FP8_KV = ("fp8_e4m3", "fp8_e5m2")


def kv_bytes_per_token(shape: str, layers: int, kv_cache_dtype: str = "auto") -> int:
    """KV bytes per token of a model shape with `layers` layers: K and V of its KV heads (GQA),
    or MLA's one latent (kv_lora_rank + rope dims); fp8 KV: one byte per element."""
    cfg = MODELS[shape]
    elem = 1 if kv_cache_dtype in FP8_KV else 2
    if "kv_lora_rank" in cfg:
        return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem * layers
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * hd * elem * layers


def layer_request_bytes(shape: str, page_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one layer of one page as the linker reads it: one request of that layer's
    objects (K and V, or MLA's one latent), each padded to 4 KiB as the store lays them out."""
    objects = 1 if "kv_lora_rank" in MODELS[shape] else 2
    per_object = kv_bytes_per_token(shape, 1, kv_cache_dtype) // objects * page_size
    return objects * align_up(per_object)


WEIGHTS = ("dummy", "seeded")


def write_model(path: str, layers: int, weights: str = "dummy", seed: int = 0,
                shape: str = "llama3-8b") -> None:
    """The config.json of a model shape (MODELS) with `layers` layers. weights "dummy": nothing
    else (the server draws SGLang's dummy weights, --load-format dummy); "seeded": a safetensors
    checkpoint of seeded HF-style random weights beside it (weights.py: every shape in MODELS,
    experts one by one as HF ships them), which the server loads."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: one of {', '.join(WEIGHTS)}, not {weights!r}")
    if shape not in MODELS:
        raise ValueError(f"model shape: one of {', '.join(MODELS)}, not {shape!r}")
    os.makedirs(path, exist_ok=True)
    cfg = dict(MODELS[shape], num_hidden_layers=layers)
    if weights == "seeded":  # fp32 logits: no bf16 rounding of the logits (1/32 near the top) to
        cfg.update(initializer_range=0.02, enable_lm_head_output_fp32=True)  # hide small changes
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    from .serving import write_tokenizer  # bench_serving draws prompts from its vocabulary
    write_tokenizer(path, cfg["vocab_size"])
    if weights == "seeded":  # drawn in a child process: CUDA stays out of the harness's own
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from .weights import write_weights
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(write_weights, path, cfg, seed, cfg["initializer_range"]).result()


def tutti_config(args, config: str) -> dict:
    """tutti's settings of a run: striped over args.tutti_dirs, a stats file per server process."""
    return {"tutti_dirs": [os.path.join(d, "tutti") for d in args.tutti_dirs.split(",")],
            "tutti_capacity_gb": args.capacity_gb,
            "tutti_stats_file": os.path.join(args.out_dir, f"stats-{config}-{{pid}}.json"),
            "tutti_timeline_file": os.path.join(args.out_dir, f"timeline-{config}-{{pid}}.jsonl")}


def graph_flags(max_bs: int, version: Optional[str] = None, prefill: bool = False) -> list:
    """The server's CUDA graph flags: decode graphs for batches up to max_bs, prefill graphs off
    (a layer-wise load waits inside the prefill's forward) unless `prefill` (SGLang's own
    prefill graphs as it would pick them: 0.5.23's breakable ones, which wait for a load at
    their eager breaks), or none at all (max_bs 0: eager, the harness's default). SGLang 0.5.23
    spells them per phase; 0.5.17 has one max and piecewise prefill graphs."""
    if max_bs <= 0:
        return ["--disable-cuda-graph"]
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as pkg_version
        try:
            version = pkg_version("sglang")
        except PackageNotFoundError:
            version = ""
    parts = tuple(int(x) for x in version.split(".")[:3] if x.isdigit())
    if parts and parts < (0, 5, 23):
        return ["--cuda-graph-max-bs", str(max_bs)] + ([] if prefill else ["--disable-piecewise-cuda-graph"])
    return ([] if prefill else ["--cuda-graph-backend-prefill", "disabled"]) + \
        ["--cuda-graph-max-bs-decode", str(max_bs)]


def server_cmd(args, config: str, port: int, node: str = "", extra: Optional[dict] = None) -> tuple[list, dict]:
    """(argv, environment) of one configuration's server. tutti-mooncake: `node` (a, b) names the
    server's own tutti directories and stats files, `extra` adds its Mooncake keys (the master)
    and cluster settings; both servers share the GPU (a smaller static memory share)."""
    name = config  # a variant's whole name (its stats files); config: the base configuration
    config, over = split_config(name)
    load = ["--load-format", "dummy"] if getattr(args, "weights", "dummy") == "dummy" else []
    # with write_model's tokenizer the server streams text (what bench_serving times); without
    # one it sends ids only
    tok = [] if os.path.exists(os.path.join(args.model, "tokenizer.json")) else ["--skip-tokenizer-init"]
    kv = getattr(args, "kv_cache_dtype", "auto")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
           *load, *tok, "--attention-backend", getattr(args, "attention_backend", "triton"),
           *(["--kv-cache-dtype", kv] if kv != "auto" else []),
           "--sampling-backend", "pytorch", "--page-size", str(getattr(args, "page_size", PAGE)),
           "--mem-fraction-static", "0.5", "--max-total-tokens", str(args.max_total_tokens),
           "--port", str(port), "--enable-metrics", "--enable-cache-report"]
    cmd += graph_flags(getattr(args, "cuda_graph_max_bs", 0), prefill=getattr(args, "prefill_graphs", False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_HICACHE_FILE", "SGLANG_HICACHE_NIXL"))}
    hicache = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
               "--hicache-storage-prefetch-policy", "wait_complete"]
    if config == "recompute":
        cmd.append("--disable-radix-cache")
    elif config == "dram":
        cmd += hicache + ["--hicache-size", str(args.dram_gb), "--hicache-mem-layout", "layer_first"]
    elif config == "file":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "layer_first",
                          "--hicache-storage-backend", "file"]
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = os.path.join(args.one_dir, "file")
    elif config == "nixl":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "page_first_direct",
                          "--hicache-storage-backend", "nixl",
                          "--hicache-storage-backend-extra-config", json.dumps({"use_uring": "true"})]
        dirs = (getattr(args, "nixl_dirs", "") or args.one_dir).split(",")  # nixl spreads over a list
        env.update(SGLANG_HICACHE_NIXL_BACKEND_PLUGIN="POSIX",
                   SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR=",".join(os.path.join(d, "nixl") for d in dirs))
    elif config == "tutti-host":
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "layer_first",
                          "--hicache-storage-backend", "tutti", "--hicache-storage-backend-extra-config",
                          json.dumps({**tutti_config(args, name), **over})]
    elif config == "tutti-host-readme":
        cmd += README_HOST_FLAGS + ["--hicache-storage-backend-extra-config",
                                    json.dumps({**tutti_config(args, name), **over})]
    elif config == "tutti-host-defaults":
        cmd += ["--enable-hierarchical-cache", "--hicache-storage-backend", "tutti",
                "--hicache-storage-backend-extra-config", json.dumps({**tutti_config(args, name), **over})]
    elif config in LINKERS:
        host_gb = getattr(args, "dram_gb", 0) if config == "tutti-tiered" else 0
        cfg = {**tutti_config(args, name), "tutti_host_gb": host_gb, **over}
        backend = "tutti"
        if config == "tutti-linker-dynamic":
            backend, cfg = "dynamic", {"linker": "TuttiLinker", "linker_module_path": "tutti_hicache.linker",
                                       "linker_extra_config": cfg}
        cmd += ["--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend", backend,
                "--unified-cache-external-linker-config", json.dumps(cfg)]
    elif config == CLUSTER:
        node = node or "a"
        cfg = tutti_config(args, f"{name}-{node}")
        cfg["tutti_dirs"] = [os.path.join(d, f"tutti-{node}") for d in args.tutti_dirs.split(",")]
        cfg.update(extra or {})
        cfg.update(over)
        # SGLang's MooncakeStore takes page-first host pools only (MHA layer_first is refused)
        cmd += hicache + ["--hicache-size", str(args.host_gb), "--hicache-mem-layout", "page_first_direct",
                          "--hicache-storage-backend", CLUSTER, "--hicache-storage-backend-extra-config",
                          json.dumps(cfg)]
        cmd[cmd.index("--mem-fraction-static") + 1] = "0.35"  # two servers on one GPU
    elif config in LMCACHE:  # SGLang dials the harness's daemon (lmcache_port); no HiCache flag
        path = os.path.join(args.out_dir, f"lmcache-{name}.yaml")
        cmd += ["--enable-lmcache", "--lmcache-config-file", write_client_config(path, lmcache_port(port))]
        env["LMCACHE_MP_TRANSFER_MODE"] = lmcache_transfer_mode(name)  # the daemon's own mode
    else:
        raise ValueError(f"unknown configuration {config!r} (one of {', '.join(CONFIGS)})")
    return cmd, env


# --identity-restart: the SGLang settings a store's identity covers that one GPU run can change
# (the model and its geometry need another checkpoint; TP/PP another machine)
IDENTITY_FLAGS = {"kv-cache-dtype": ("auto", "bfloat16", *FP8_KV), "page-size": None}


def identity_changes(spec: str) -> dict:
    """--identity-restart "kv-cache-dtype=fp8_e4m3[,page-size=32]" -> {"--kv-cache-dtype": ...};
    a key outside IDENTITY_FLAGS, a value outside its choices or a page size that is not a
    positive integer is a ValueError naming it."""
    out = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        key = key.strip().lstrip("-")
        if not eq or key not in IDENTITY_FLAGS:
            raise ValueError(f"--identity-restart: {part!r} is not FLAG=VALUE with FLAG one of "
                             f"{', '.join(IDENTITY_FLAGS)}")
        choices = IDENTITY_FLAGS[key]
        if choices is not None and value not in choices:
            raise ValueError(f"--identity-restart: {key} must be one of {', '.join(choices)}, not {value!r}")
        if choices is None and not (value.isdigit() and int(value) > 0):
            raise ValueError(f"--identity-restart: {key} must be a positive integer, not {value!r}")
        out["--" + key] = value
    if not out:
        raise ValueError("--identity-restart: no FLAG=VALUE given")
    return out


def with_flags(cmd: list, changes: dict) -> list:
    """cmd with each "--flag": value of changes set: the value after the flag replaced where cmd
    has it, the pair appended where it does not."""
    out = list(cmd)
    for flag, value in changes.items():
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def lmcache_port(server_port: int) -> int:
    """The LMCache daemon's port beside a server on server_port (its HTTP port: this + 1000)."""
    return server_port + 5000
