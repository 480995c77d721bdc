"""Seeded random weights for the end-to-end benchmark's model: a checkpoint whose outputs depend
on the KV it is given, so an output check against recompute can fail.

At a glance:
    tensors(cfg) -> [(name, shape, kind)]        HF parameter names and shapes of a config (Llama,
                                                 Qwen3-MoE, DeepSeek-V2)
    write_weights(path, cfg, seed=0, std=0.02, device=None, max_shard_bytes=4e9) -> index path
        bf16 safetensors shards (one or more layers each, every file under max_shard_bytes) and
        model.safetensors.index.json beside the config.json

SGLang's `--load-format dummy` draws every weight from uniform(-1e-3, 1e-3): the logits are
nearly flat, so greedy tokens barely depend on the KV and a wrong page can pass an output
check. These weights follow HF's Llama initialisation instead: linear layers and embeddings
normal(0, std) with std = initializer_range (0.02), RMSNorm weights 1. Each tensor is drawn from
its own torch.Generator seeded by (seed, name), on `device` (the GPU when there is one: an 8B
geometry takes seconds there), so one tensor never depends on the order or the number of the
others. The values depend on the device that drew them (torch's CPU and CUDA generators
differ); a run uses one checkpoint for every configuration, which is all the comparison needs.

The files are written here, not through the safetensors package: an 8-byte little-endian header
length, a JSON header (dtype, shape, data_offsets of each tensor, padded with spaces to 8 bytes),
then the tensors' bytes back to back. Tensors are streamed to the file one at a time, so memory
holds one tensor, never a shard. A checkpoint already there with the same metadata (seed, std,
device kind, the config's shapes) and file sizes is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Optional

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = 2  # bf16


def tensors(cfg: dict) -> list:
    """[(name, shape, kind)] in file order; kind "normal" (std-scaled normal) or "ones". The names
    and shapes are the HF checkpoints' of the config's model_type: llama (dense GQA), qwen3_moe
    (GQA with per-head q/k norms, every layer routed experts) and deepseek_v2 (MLA without a q
    LoRA, as in V2-Lite; dense MLPs before first_k_dense_replace, then routed plus shared
    experts), which SGLang's loaders read expert by expert."""
    kind = cfg.get("model_type", "llama")
    if kind not in _LAYERS:
        raise ValueError(f"seeded weights: model_type one of {', '.join(_LAYERS)}, not {kind!r}")
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn, mlp = _LAYERS[kind](cfg, i)
        out += [(p + n, s, k) for n, s, k in [("input_layernorm.weight", (h,), "ones"), *attn,
                                              ("post_attention_layernorm.weight", (h,), "ones"), *mlp]]
    out.append(("model.norm.weight", (h,), "ones"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), "normal"))
    return out


def _mlp(prefix: str, h: int, inter: int) -> list:
    return [(prefix + "gate_proj.weight", (inter, h), "normal"),
            (prefix + "up_proj.weight", (inter, h), "normal"),
            (prefix + "down_proj.weight", (h, inter), "normal")]


def _gqa(cfg: dict) -> tuple:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    return [("self_attn.q_proj.weight", (heads * hd, h), "normal"),
            ("self_attn.k_proj.weight", (kv * hd, h), "normal"),
            ("self_attn.v_proj.weight", (kv * hd, h), "normal"),
            ("self_attn.o_proj.weight", (h, heads * hd), "normal")], hd


def _llama_layer(cfg: dict, i: int) -> tuple:
    attn, _ = _gqa(cfg)
    return attn, _mlp("mlp.", cfg["hidden_size"], cfg["intermediate_size"])


def _experts(cfg: dict, n: int) -> list:
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    out = [("mlp.gate.weight", (n, h), "normal")]
    for e in range(n):
        out += _mlp(f"mlp.experts.{e}.", h, inter)
    return out


def _qwen3_moe_layer(cfg: dict, i: int) -> tuple:
    attn, hd = _gqa(cfg)
    attn += [("self_attn.q_norm.weight", (hd,), "ones"), ("self_attn.k_norm.weight", (hd,), "ones")]
    step = cfg.get("decoder_sparse_step", 1)
    if i in cfg.get("mlp_only_layers", []) or cfg["num_experts"] == 0 or (i + 1) % step:
        return attn, _mlp("mlp.", cfg["hidden_size"], cfg["intermediate_size"])
    return attn, _experts(cfg, cfg["num_experts"])


def _deepseek_v2_layer(cfg: dict, i: int) -> tuple:
    if cfg.get("q_lora_rank"):
        raise ValueError("seeded weights: deepseek_v2 with a q LoRA (q_lora_rank) is not written here")
    h, heads, rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    attn = [("self_attn.q_proj.weight", (heads * (nope + rope), h), "normal"),
            ("self_attn.kv_a_proj_with_mqa.weight", (rank + rope, h), "normal"),
            ("self_attn.kv_a_layernorm.weight", (rank,), "ones"),
            ("self_attn.kv_b_proj.weight", (heads * (nope + v), rank), "normal"),
            ("self_attn.o_proj.weight", (h, heads * v), "normal")]
    if i < cfg.get("first_k_dense_replace", 0) or i % cfg.get("moe_layer_freq", 1):
        return attn, _mlp("mlp.", h, cfg["intermediate_size"])
    mlp = _experts(cfg, cfg["n_routed_experts"])
    if cfg.get("n_shared_experts"):
        mlp += _mlp("mlp.shared_experts.", h, cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    return attn, mlp


_LAYERS = {"llama": _llama_layer, "qwen3_moe": _qwen3_moe_layer, "deepseek_v2": _deepseek_v2_layer}


def _nbytes(shape) -> int:
    n = DTYPE_BYTES
    for d in shape:
        n *= d
    return n


def _groups(specs: list) -> list:
    """Units that stay in one file: the embeddings, each layer's tensors, the final norm + head."""
    groups: dict = {}
    for spec in specs:
        parts = spec[0].split(".")
        key = int(parts[2]) if parts[1] == "layers" else (-1 if "embed" in spec[0] else 1 << 30)
        groups.setdefault(key, []).append(spec)
    return [groups[k] for k in sorted(groups)]


def shards(specs: list, max_shard_bytes: float) -> list:
    """Groups packed in order into files of at most max_shard_bytes (a larger group alone)."""
    out, size = [], 0
    for group in _groups(specs):
        g = sum(_nbytes(s) for _, s, _ in group)
        if out and size + g <= max_shard_bytes:
            out[-1] += group
            size += g
        else:
            out.append(list(group))
            size = g
    return out


def header_bytes(specs: list) -> bytes:
    """A safetensors header (length prefix included) for bf16 tensors laid out back to back."""
    head, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        n = _nbytes(shape)
        head[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def draw(name: str, shape, kind: str, seed: int, std: float, device: str):
    """One tensor as bf16 on the CPU (torch): ones, or normal(0, std) from its own generator."""
    import torch
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std)
    return t.to(torch.bfloat16).cpu()


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def write_weights(path: str, cfg: dict, seed: int = 0, std: float = 0.02, device: Optional[str] = None,
                  max_shard_bytes: float = 4e9) -> str:
    """Write the checkpoint (module docstring) into `path`; returns the index file's path."""
    import torch
    device = device or _default_device()
    specs = tensors(cfg)
    need = sum(_nbytes(s) for _, s, _ in specs)
    os.makedirs(path, exist_ok=True)
    st = os.statvfs(path)
    have = st.f_bavail * st.f_frsize + _present_bytes(path)
    if need > have:  # say so before writing GBs into a full disk
        raise OSError(f"seeded weights: {need / 1e9:.1f} GB for {cfg['num_hidden_layers']} layers of "
                      f"{cfg.get('model_type', 'llama')} but {have / 1e9:.1f} GB free in {path}; use "
                      "fewer layers (--layers) or another --model directory")
    files = shards(specs, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    meta = {"seed": str(seed), "std": str(std), "device": device.split(":")[0],
            "shapes": json.dumps([[n, list(s)] for n, s, _ in specs])}
    sizes = [len(header_bytes(f)) + sum(_nbytes(s) for _, s, _ in f) for f in files]
    index = {"metadata": {"total_size": sum(_nbytes(s) for _, s, _ in specs), "tutti_seeded": meta},
             "weight_map": {n: fname for f, fname in zip(files, names) for n, _, _ in f}}
    index_path = os.path.join(path, INDEX)
    if _same(index_path, index, names, sizes, path):
        return index_path
    for old in os.listdir(path):  # another geometry's shards must not be loaded beside these
        if old.endswith(".safetensors") or old == INDEX:
            os.unlink(os.path.join(path, old))
    for f, fname in zip(files, names):
        tmp = os.path.join(path, fname + ".tmp")
        with open(tmp, "wb") as out:
            out.write(header_bytes(f))
            for name, shape, kind in f:
                t = draw(name, shape, kind, seed, std, device)
                out.write(t.view(torch.int16).numpy().tobytes())
        os.replace(tmp, os.path.join(path, fname))
    with open(index_path, "w") as out:
        json.dump(index, out, indent=1)
    return index_path


def _present_bytes(path: str) -> int:
    """Bytes of the checkpoint files already in path (they are replaced, so they count as free)."""
    try:
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                   if n.endswith((".safetensors", ".safetensors.tmp")))
    except OSError:
        return 0


def _same(index_path: str, index: dict, names: list, sizes: list, path: str) -> bool:
    try:
        with open(index_path) as f:
            have = json.load(f)
        return have == index and all(os.path.getsize(os.path.join(path, n)) == s
                                     for n, s in zip(names, sizes))
    except (OSError, ValueError):
        return False
