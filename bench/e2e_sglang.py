"""End to end on a real SGLang server (0.5.23; a GPU): layer-wise restore vs recompute, the DRAM tier
and the SSD tiers users would pick, with the same server build, model, prompts and medium.

Configurations (one or two server starts each, one after another):
  recompute             no cache tier at all (--disable-radix-cache): every prompt is prefilled
  dram                  HiCache's host tier, no storage backend, a host pool holding every prefix
  file / nixl           HiCache + SGLang's `file` / `nixl` (POSIX plugin, io_uring) backend, one directory
  tutti-host            HiCache + TuttiStorage (plugin name `tutti`), striped over the array's directories
  tutti-linker          TuttiLinker (--unified-cache-external-linker-backend tutti): layer-wise SSD -> GPU
  tutti-linker-dynamic  the same through `dynamic` and the module path (no plugin)
  tutti-mooncake        two servers on one GPU and a mooncake_master on loopback: A warms (tutti-mooncake,
                        publishing into its Mooncake segment), B (empty SSD tier) answers the sweep from
                        A's segment: remote hits over loopback TCP (run_cluster)
  NAME+tutti_KEY=VALUE  a variant of a tutti configuration with settings on top, for an A/B in one run,
                        e.g. tutti-linker,tutti-linker+tutti_threads=4 (with --share-linker-store: one
                        server start each); it keeps its whole name in the report and its stats files
Phases (workload: tutti_hicache/benchmarks/e2e.py): `warm` (each document first seen), then for storage
configurations a **restart and a page-cache drop**; `first` (the first request after the start), `sweep`
(hit fractions: per point the prompt restored from the tier, then one sharing its prefix with new tokens
while the prefix sits in device memory: the compute-only time), `rate<R>` (requests at R/s, concurrent,
after a flush), and last `capwarm` + `capacity` (a working set ~3x the DRAM tier, written, then reused in
random order; last because it evicts the DRAM tier's documents). With --client bench-serving SGLang's own
client, bench_serving (generated-shared-prefix, --tokenize-prompt), sends the phases instead: `warm`, the
restart, `reuse` (the same requests: the first restore after the start, then the later ones), `check` (the
same prompts from the harness's client, with top-k logprobs, for the output check), `rate<R>` (ascending
until the mean TTFT reaches --slo-s: the rate sweep) and `capwarm` + `capacity` (Zipf popularity); each
phase's bench_serving report is kept beside the harness's records (run["serving"]). Storage configurations flush device and host caches
(/flush_cache keeps the storage tier) before every sweep point so hits come from the SSD; `dram` cannot
flush (its host pool would go) and relies on its documents being evicted from the bounded device pool
(every configuration has the same --max-total-tokens) by the interleaved sweep order; SGLang's
cached_tokens_details says per request where the hit came from.

  python bench/e2e_sglang.py --write-model --model /tmp/llama8 --layers 8 \\
      --tutti-dirs /mnt/a0,...,/mnt/a7 --one-dir /mnt/stripe --medium array-8 \\
      --configs tutti-linker,recompute --json out.json
  python bench/plot_e2e.py docs/img out.json [more.json ...]     # tables + PNGs

--share-linker-store: linker configurations after the first one that warmed start on the store it
wrote (a page-cache drop, then one server start: no warm phase), their questions and new tokens
salted (ids "sweep~s1/...") so no prompt past its document is already stored; an A/B of linker
settings then costs one server start each. Salted requests are not compared with recompute's.

The model: `--write-model` writes a Llama-3-8B-shaped config.json with `--layers` layers and, with
`--weights seeded` (bench/gpu.sh passes it), a safetensors checkpoint of seeded HF-style random weights
(normal, std 0.02; norms 1) that the server loads; `--weights dummy` (the default here) leaves the
weights to SGLang's --load-format dummy, whose near-flat logits make outputs barely depend on the KV.
The server never loads a tokenizer (--skip-tokenizer-init); clients send token ids.

The output check: every request asks for its output positions' top-k logprobs (--top-logprobs, 5) and
is compared with the same request id in `recompute`: every top-k logprob within --logprob-tol (0.2) and
the same greedy ids, up to a near tie (e2e.compare_output); the JSON keeps per run and phase "outputs_vs_recompute" (compared, equal, max
logprob difference, mismatching ids). Its negative control is a configuration variant NAME+misplace
(tutti-host, tutti-linker, tutti-linker-dynamic): between the warm phase and the restart, the first
document page of the smallest context's documents 0 and 1 are rewritten under each other's keys
through the store's own write path (valid checksums; tutti_hicache/benchmarks/misplace.py), and the
report's negative-control table must show every request restoring that page as differing, e.g.

  bash bench/gpu.sh e2e recompute,tutti-linker,tutti-linker+misplace 500 --contexts 4096,32768

Every client stops waiting as soon as the server process is gone. Not a test: it needs a GPU
(tests/README.md); its workload and report code is tested on CPU.
"""

from tutti_hicache.benchmarks.e2e_sglang import main

if __name__ == "__main__":
    main(__doc__)
