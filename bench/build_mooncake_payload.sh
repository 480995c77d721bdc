#!/usr/bin/env bash
# The Mooncake client and master for the GPU machine (Python 3.12, CUDA 13, no network), as one xz
# tarball of ~9.5 MiB: mooncake-transfer-engine-cuda13 0.3.13.post1 keeping only mooncake.store
# (store.so), the mooncake_master binary, the package's two Python files and the bundled shared
# libraries they need (their NEEDED closure inside the wheel, stripped; the wheel's duplicate
# libetcd_wrapper/libasio copies become symlinks). The rest of the 98 MB wheel (the transfer-engine
# module, EP and process-group libraries, benches) is not used by SGLang's MooncakeStore.
# Also carried, under mooncake-syslibs/: this machine's libibverbs, libmlx5 (rdma-core), libnl and
# libnuma, which store.so links; bench/gpu_setup.sh links only those the GPU machine lacks.
# libcurl, libcuda (the driver) and libcudart (torch's CUDA libraries) come from the GPU machine.
# Usage (here, where pip reaches the package index): bench/build_mooncake_payload.sh OUTDIR
# -> OUTDIR/mooncake.tar.xz, unpacked into the overlay by bench/gpu_setup.sh when carried as .mooncake/.
set -euo pipefail
OUTDIR=${1:-.mooncake}; mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
W=$(mktemp -d /tmp/mcwh.XXXX); S=$W/site; T=$W/trim
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$W" mooncake-transfer-engine-cuda13==0.3.13.post1
mkdir -p "$S" && unzip -q -o "$W"/*.whl -d "$S"
L=mooncake_transfer_engine_cuda13.libs
mkdir -p "$T/mooncake" "$T/$L" "$T/mooncake-syslibs"
cp "$S"/mooncake/{__init__.py,buffer_pool.py,store.so,mooncake_master} "$T/mooncake/"
cd "$S"
# NEEDED closure of store.so and mooncake_master inside the wheel (by soname)
python3 - "$L" > "$W/libs.txt" <<'PY'
import os, re, subprocess, sys
libdir = sys.argv[1]
have = set(os.listdir(libdir)) | set(os.listdir("mooncake"))
todo, seen = ["mooncake/store.so", "mooncake/mooncake_master"], set()
while todo:
    p = todo.pop()
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True, check=True).stdout
    for n in re.findall(r"\(NEEDED\).*\[(.*)\]", out):
        if n in have and n not in seen:
            seen.add(n)
            todo.append(os.path.join(libdir if os.path.exists(os.path.join(libdir, n)) else "mooncake", n))
print("\n".join(sorted(seen)))
PY
for n in $(cat "$W/libs.txt"); do
  case "$n" in
    libetcd_wrapper.so) ln -sf "../$L/$(cd $L && ls libetcd_wrapper-*.so)" "$T/mooncake/$n" ;;
    libasio.so) ln -sf "../$L/$(cd $L && ls libasio-*.so)" "$T/mooncake/$n" ;;
    *) [ -f "$L/$n" ] && cp "$L/$n" "$T/$L/" || cp "mooncake/$n" "$T/mooncake/" ;;
  esac
done
for n in libetcd_wrapper libasio; do  # the symlinks' targets, also needed by mooncake_master
  [ -n "$(ls "$T/$L/$n"-* 2>/dev/null)" ] || cp "$L/$n"-*.so "$T/$L/"
done
strip --strip-unneeded "$T/mooncake/store.so" "$T/mooncake/mooncake_master" "$T/$L"/* 2>/dev/null || true
for n in libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1; do
  p=$(ldconfig -p | awk -v n="$n" '$1 == n && !f {print $NF; f = 1}')
  if [ -n "$p" ]; then cp -L "$p" "$T/mooncake-syslibs/"; else echo "note: $n not on this machine, not carried" >&2; fi
done
tar -C "$T" -cf - . | xz -9 -T0 > "$OUTDIR/mooncake.tar.xz"
ls -l "$OUTDIR/mooncake.tar.xz"; rm -rf "$W"
