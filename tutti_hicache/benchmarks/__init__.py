"""Benchmarks shipped with the package (the way kvikio ships its own), importable from the runner
scripts in the repository's bench/ folder, the CLI and the tests alike:

    store       `tutti-hicache bench store` and `demo`: L3 -> host-pool restore beside the raw
                medium and SGLang's `file` backend, through SGLang's real controller methods
    rawio       the raw O_DIRECT reference every figure is set against
    e2e         the pure parts of the end-to-end server benchmark (workload, summaries, reports)
    e2e_sglang  the end-to-end run itself (bench/e2e_sglang.py): configurations, phases, the JSON
    weights     its model's seeded random weights (safetensors), so its output check can fail
    misplace    that check's negative control: a page served under another document's key
    model       the Llama-shaped forward pass the prefill benchmarks restore behind
"""
