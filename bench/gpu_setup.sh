# Source on the GPU machine from the repo root (with .sgl carried):
# unpacks SGLang 0.5.17 (../shared/tools/sglang-gpu payload) and installs tutti for its Python.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_CACHE_DIR=/tmp/tvmffi
export OUT=${OUT:-/tmp/tutti-out}; mkdir -p "$OUT"
if [ -f .sgl/site.tar.xz ] && [ ! -d /tmp/site/sglang ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .sgl/site.tar.xz
fi
[ -d /tmp/site/sglang ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
if ! (cd /tmp && python3 -c "import tutti_hicache._engine") 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps . \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
# The checkout shadows the installed package when run from here: give it the built extension
# and the kernels at their installed name.
cp "$(cd /tmp && python3 -c 'import tutti_hicache._engine as e; print(e.__file__)')" tutti_hicache/
ln -sfn ../triton_kernels tutti_hicache/triton_kernels
python3 -c "import tutti_hicache._engine as e, torch; print('tutti engine: uring' if e.uring_compiled() else 'posix only', '| torch', torch.__version__, torch.cuda.get_device_name())"
