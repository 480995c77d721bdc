# Source on the GPU machine from the repository root. Carried in the device run (ignored folders):
#   .sgl/site.tar.xz   the SGLang site-packages overlay (0.5.23 by default; a 0.5.17 one also works)
#   .nixl/nixl.tar.xz  optional: NIXL's trimmed wheels, for SGLang's `nixl` backend
#   .mooncake/mooncake.tar.xz  optional: the trimmed Mooncake client and master (bench/build_mooncake_payload.sh)
#   .client/*.whl      optional: what SGLang's bench_serving needs there (bench/build_client_payload.sh;
#                      e2e --client bench-serving)
#   .lmc/lmcache.tar.xz  optional: LMCache and what its daemon needs, for e2e's lmcache-* configurations
#                      (bench/build_lmcache_payload.sh)
# Unpacks them into /tmp/site (first on PYTHONPATH), builds and installs tutti_hicache for the
# machine's Python, and sets what SGLang 0.5.23 needs on torch 2.11 (see the overlay's notes).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_CACHE_DIR=/tmp/tvmffi
export OUT=${OUT:-/tmp/tutti-out}; mkdir -p "$OUT"
for t in .sgl/site.tar.xz .nixl/nixl.tar.xz .mooncake/mooncake.tar.xz .lmc/lmcache.tar.xz; do
  stamp=/tmp/site/.unpacked-$(basename "$(dirname "$t")")
  if [ -f "$t" ] && [ ! -f "$stamp" ]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf "$t" && touch "$stamp"
  fi
done
# .client/*.whl (bench/build_client_payload.sh): what SGLang's bench_serving imports beyond both
for w in .client/*.whl; do
  [ -f "$w" ] && [ ! -f "/tmp/site/.unpacked-$(basename "$w")" ] && mkdir -p /tmp/site && \
    python3 -m zipfile -e "$w" /tmp/site && touch "/tmp/site/.unpacked-$(basename "$w")"
done
[ -d /tmp/site/sglang ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -d /tmp/site/mooncake-syslibs ]; then
  # Mooncake's store.so: the carried system libraries the machine lacks, and libcudart.so.13 from
  # torch's CUDA libraries when the loader does not know one.
  mkdir -p /tmp/mooncake-sys
  for f in /tmp/site/mooncake-syslibs/*; do
    ldconfig -p | grep -q "^[[:space:]]*$(basename "$f") " || ln -sf "$f" /tmp/mooncake-sys/
  done
  if ! ldconfig -p | grep -q 'libcudart.so.13 '; then
    cudart=$(python3 -c 'import glob, site; print(next(iter(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/**/libcudart.so.13*", recursive=True))), ""))')
    [ -n "$cudart" ] && ln -sf "$cudart" /tmp/mooncake-sys/libcudart.so.13
  fi
  export LD_LIBRARY_PATH=/tmp/mooncake-sys${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [ -d /tmp/site/cufile ] && ! ldconfig -p | grep -q 'libcufile.so '; then
  # LMCache's GDS L1 (cufile-python) dlopens libcufile.so; the image's nvidia-cufile has .so.0 only
  cufile=$(python3 -c 'import glob, site; print(next(iter(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/**/libcufile.so.0*", recursive=True))), ""))')
  if [ -n "$cufile" ]; then
    mkdir -p /tmp/cufile-lib && ln -sf "$cufile" /tmp/cufile-lib/libcufile.so
    export LD_LIBRARY_PATH=/tmp/cufile-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    echo "gpu_setup: no libcufile.so.0 in site-packages: lmcache-gds will not start" >&2
  fi
fi
# SGLang 0.5.23 on torch 2.11: sglang-kernel 0.4.5 (0.5.23 asks for >= 0.4.9), and the Python tree
# core (the overlay's Rust one is built for torch 2.14.1).
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
# Installed once per source tree: a warm machine keeps the last call's install, so the sources'
# fingerprint decides (and a build from before the CUDA part, without cuda_available, is rebuilt).
src_sha=$(find cpp tutti_hicache triton_kernels CMakeLists.txt pyproject.toml -type f \
  -not -path '*/__pycache__/*' -print0 2>/dev/null | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40)
if [ "$(cat /tmp/tutti-build.sha 2>/dev/null)" != "$src_sha" ] || \
   ! (cd /tmp && python3 -c "import tutti_hicache._engine as e; e.cuda_available") 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps . \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1 2>/dev/null || exit 1; }
  echo "$src_sha" > /tmp/tutti-build.sha
fi
# From here on, Python runs with -P (or a script path) so the checkout's tutti_hicache/ (source
# only) never shadows the installed package: bench scripts import the installed one.
python3 -P -c "import tutti_hicache._engine as e, torch; print('tutti engine: uring' if e.uring_compiled() else 'posix only', '| torch', torch.__version__, torch.cuda.get_device_name(), '| CUDA part:', e.cuda_available() or e.cuda_reason())"
(cd /tmp && python3 -c "import sglang; print('sglang', sglang.__version__)") 2>&1 | tail -1
