"""The e2e output check's margin, on the CPU: how far bf16 rounding moves the top-5 logprobs of a
Llama with the harness's seeded initialisation (tutti_hicache/benchmarks/weights.py: normal, std
0.02; norms 1), and how far one page of another document's KV moves them.

  python bench/output_margin.py --layers 8 --context 4096 [--json out.json]

Two documents of `context` tokens share a 256-token system prompt; a 32-token question follows
document 0. noise: the question's top-5 logprobs from one prefill of document + question (what
`recompute` does) against the same from document 0's cached KV + an extend of the question (what a
restore does). signal: the extend over document 0's KV with page 4 (tokens 256-319, the first after
the system prompt) taken from document 1's KV at every layer (what the +misplace control serves).
Logits in fp32 from the bf16 final hidden state, as configs.write_model asks of SGLang. The
difference is e2e.compare_output's (top-k sets that differ count by the gap above the k-th).

transformers' Llama on the CPU, not SGLang's kernels on a GPU: the rounding differs there, so this
says whether a tolerance can separate the two at all; the GPU run's report gives its own margin.
Needs torch and transformers (SGLang's dependencies); 8 layers at 4K take ~2 minutes on 2 cores.
"""

import argparse
import copy
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from tutti_hicache.benchmarks import configs, e2e

PAGE, SYSTEM, QUESTION = e2e.PAGE, e2e.SYSTEM_TOKENS, 32


def top5(model, out) -> list:
    """[[[logprob, token]] * 5 per position] from fp32 logits of the final hidden states."""
    logits = out.hidden_states[-1][0].float() @ model.lm_head.weight.float().T
    v, i = torch.log_softmax(logits, -1).topk(5, -1)
    return [[[lp, t] for lp, t in zip(vs, ts)] for vs, ts in zip(v.tolist(), i.tolist())]


def largest_diff(a: list, b: list) -> float:
    return max(e2e.position_diff({t: lp for lp, t in x}, {t: lp for lp, t in y}) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings")
    cfg = LlamaConfig(**{k: configs.LLAMA3_8B[k] for k in keys}, num_hidden_layers=args.layers,
                      max_position_embeddings=args.context + QUESTION, initializer_range=0.02)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()  # HF's init: normal(0, 0.02), norms 1
    wl = e2e.Workload((args.context,), docs=2, q_tokens=QUESTION, seed=args.seed)
    docs = [torch.tensor(wl.document(args.context, d)) for d in (0, 1)]
    question = torch.tensor(wl.tokens("question", QUESTION, 0))
    with torch.no_grad():
        full = top5(model, model(torch.cat([docs[0], question])[None], output_hidden_states=True))
        full = full[args.context:]
        caches = []
        for doc in docs:
            cache = DynamicCache()
            model(doc[None], past_key_values=cache, use_cache=True)
            caches.append(cache)

        def extend(cache):
            return top5(model, model(question[None], past_key_values=copy.deepcopy(cache), use_cache=True,
                                     output_hidden_states=True))
        restored = extend(caches[0])
        page = slice(SYSTEM, SYSTEM + PAGE)
        wrong = copy.deepcopy(caches[0])
        for mine, other in zip(wrong.layers, caches[1].layers):
            mine.keys[:, :, page] = other.keys[:, :, page]
            mine.values[:, :, page] = other.values[:, :, page]
        misplaced = extend(wrong)
    out = {"layers": args.layers, "context": args.context, "seed": args.seed, "positions": QUESTION,
           "noise": largest_diff(full, restored), "signal": largest_diff(restored, misplaced),
           "seconds": time.time() - t0, "torch": torch.__version__, "device": "cpu"}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
