#!/usr/bin/env bash
# LMCache 0.5.6 on the GPU machine (Python 3.12, torch 2.11 + CUDA 13, no network), for e2e's
# lmcache-* configurations: its standalone daemon
#   python3 -m lmcache.cli.main server --host 127.0.0.1 --port P --http-host 127.0.0.1 --http-port Q \
#     --l1-size-gb 2 --eviction-policy LRU --disable-observability --chunk-size 256 \
#     [--l2-adapter '{"type":"fs_native","base_path":DIR}']
# and SGLang 0.5.23's `lmcache.integration.sglang.unified_lmcache_mp_connector` (imported by
# sglang/srt/mem_cache/storage/lmcache/lmcache_unified_radix_cache.py). One xz tarball of ~5 MiB:
#   lmcache 0.5.6 (cp312 manylinux wheel, ~82 MB unpacked), trimmed:
#     - cuda_ops*.so (45 MB): built for a newer torch (it needs
#       c10::NotImplementedError(SourceLocation, std::string), which torch 2.11 lacks), so it would
#       not load anyway; lmcache/v1/platform/devices/cuda/device_ops.py (CudaDeviceOps.ensure_native)
#       catches the ImportError, logs "lmcache.cuda_ops compiled extension not found; CudaDeviceOps
#       stays on the torch baseline for all ops." and keeps the torch implementations.
#   and one patch (below, checked to apply): the torch fallback's pointer-mode memcpy
#     (lmcache/v1/platform/torch_ops/mem_kernels.py, lmcache_memcpy_async) calls the synchronous
#     cudaMemcpy, which runs on the legacy default stream and does not wait for the daemon's
#     transfer stream (a torch stream, created non-blocking). A store then copies a staging buffer
#     to DRAM before the kernel filling it from SGLang's pool ran, and a retrieve refills a staging
#     buffer while the previous batch's kernel may still read it: the likely cause of the first
#     run's wrong-KV outputs (docs/benchmarks.md §12). The patch synchronizes the current stream first, which gives the
#     order LMCache's compiled path (cudaMemcpyAsync on that stream) has.
#     - lmcache_redis*.so (RESP/Redis L2 only), lmcache_frontend, lmcache/tools (`lmcache tool`
#       only), tests, docs, __pycache__.
#     - kept: lmcache_native (Bitmap, EngineKVFormat, ... imported by the server, the L2 adapters
#       and the torch ops) and lmcache_fs (the C++ client behind the fs_native L2 adapter); both
#       resolve all their torch symbols against torch 2.11, and are shipped with their debug info
#       stripped (9.8 + 8.2 MB -> 0.5 + 0.4 MB).
#   cachetools, cryptography (imported unconditionally by lmcache/v1/distributed/serde), blake3 (the
#   daemon's default token hash): the only imports of the daemon and the connector that neither the
#   machine's image nor the SGLang overlay holds.
#   cufile-python (5 KB, ctypes over libcufile.so): lmcache-gds's GDS L1 imports cufile.bindings;
#   without it the daemon exits with "No module named 'cufile'". The image's nvidia-cufile has
#   libcufile.so.0 only: gpu_setup.sh links libcufile.so to it.
# Assumed present, not carried:
#   image: torch (and cuda-bindings, a dependency of torch 2.11+cu130, for CUDA IPC), numpy, numba,
#     llvmlite, py-cpuinfo, psutil, sortedcontainers, prometheus-client, pyyaml, aiohttp, httpx
#     (anyio, h11), requests, click, typing-extensions, protobuf, grpcio, setuptools, packaging;
#     cupy-cuda13x, nvidia-cufile, msgpack, safetensors, transformers, huggingface-hub, aiofiles.
#   SGLang overlay (.sgl/site.tar.xz): fastapi, starlette, uvicorn, pyzmq, orjson, pydantic
#     (pydantic-core, annotated-types, typing-inspection), msgspec 0.23.0, opentelemetry-api 1.45.2
#     (only the API is imported with --disable-observability; lmcache asks for <= 1.40 but imports
#     and runs with it), cffi 2.1.1 (_cffi_backend, needed by cryptography), pycparser.
# Not carried, needed only elsewhere: redis, awscrt, aiofile (older non-unified SGLang adapters),
# google-cloud-bigtable, nvtx, opentelemetry-sdk/exporters (observability on).
# The daemon sends usage telemetry to stats.lmcache.ai; set LMCACHE_TRACK_USAGE=false there.
# Usage (here, where pip reaches the package index): bench/build_lmcache_payload.sh [OUTDIR]
#   (PYVER=3.11 builds the same tree for a CPython 3.11 check host)
# -> OUTDIR/lmcache.tar.xz (default .lmc/), unpacked into the overlay by bench/gpu_setup.sh when
#    carried as .lmc/.
set -euo pipefail
OUTDIR=${1:-.lmc}; mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
PYVER=${PYVER:-3.12}
W=$(mktemp -d /tmp/lmcwh.XXXX); S=$W/site; trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$W" lmcache==0.5.6 cachetools==8.0.2 cryptography==50.0.2 blake3==1.0.11 \
  cufile-python==0.2.0
mkdir -p "$S" && for w in "$W"/*.whl; do python3 -m zipfile -e "$w" "$S"; done
cd "$S"
rm -rf lmcache/cuda_ops.*.so lmcache/lmcache_redis.*.so lmcache/lmcache_frontend lmcache/tools
find . -depth \( -name __pycache__ -o -name tests -o -name test -o -name '*.md' \) -exec rm -rf {} +
python3 - lmcache/v1/platform/torch_ops/mem_kernels.py <<'PATCH'
import sys
path = sys.argv[1]; src = open(path).read()
old = "            ret = libcudart.cudaMemcpy(\n"
new = ("            # tutti_hicache's benchmark payload: order the legacy-stream copy after the\n"
       "            # caller's (non-blocking) stream, as the compiled cudaMemcpyAsync is ordered\n"
       "            if torch.cuda.is_available():\n"
       "                torch.cuda.current_stream().synchronize()\n" + old)
assert src.count(old) == 1, "lmcache_memcpy_async changed: review the patch"
open(path, "w").write(src.replace(old, new))
PATCH
strip --strip-debug lmcache/lmcache_native.*.so lmcache/lmcache_fs.*.so
find . -name '*.so' -exec chmod 755 {} +
tar -cf - --owner=0 --group=0 --sort=name * | xz -9e -T0 > "$OUTDIR/lmcache.tar.xz"
du -sh -- */ | sort -h | tail -8
ls -l "$OUTDIR/lmcache.tar.xz"
