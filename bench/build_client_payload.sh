#!/usr/bin/env bash
# SGLang's benchmark client (python -m sglang.benchmark.serving) on the GPU machine: its data set
# package imports Hugging Face `datasets` (for the data sets it can download), which the machine's
# image and the SGLang overlay lack. Two pure-Python wheels, ~0.8 MB: datasets and multiprocess
# (its one dependency the image lacks; pyarrow, pandas, dill, xxhash, fsspec are there).
# Usage (here, where pip reaches the package index): bench/build_client_payload.sh OUTDIR
# -> OUTDIR/*.whl, unpacked into the overlay by bench/gpu_setup.sh when carried as .client/.
set -euo pipefail
OUTDIR=${1:-.client}; mkdir -p "$OUTDIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  -d "$OUTDIR" 'datasets>=3,<6' 'multiprocess>=0.70.16'
ls -la "$OUTDIR"
