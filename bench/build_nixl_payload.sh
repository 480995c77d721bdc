#!/usr/bin/env bash
# NIXL for SGLang's `nixl` backend on the GPU machine (Python 3.12, CUDA 13, no network), as one xz
# tarball of ~7 MiB: the nixl 1.5.2 meta package and nixl-cu13 1.5.1, keeping only the Python code,
# the _bindings/_utils extensions, the POSIX plugin (io_uring) and the shared libraries they need
# (their NEEDED closure inside the wheel; the rest of the 59 MB wheel is other plugins, UCX, nixl_ep).
# Usage (here, where pip reaches the package index): bench/build_nixl_payload.sh OUTDIR
# -> OUTDIR/nixl.tar.xz, unpacked into the overlay by bench/gpu_setup.sh when carried as .nixl/.
set -euo pipefail
OUTDIR=${1:-.nixl}; mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
W=$(mktemp -d /tmp/nixlwh.XXXX); S=$W/site
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$W" nixl==1.5.2 nixl-cu13==1.5.1
mkdir -p "$S" && for w in "$W"/*.whl; do unzip -q -o "$w" -d "$S"; done
cd "$S"
python3 - > "$W/files.txt" <<'PY'
import os, re, subprocess
libdirs = [".nixl_cu13.mesonpy.libs", ".nixl_cu13.mesonpy.libs/plugins", "nixl_cu13.libs"]
where = {f: os.path.join(d, f) for d in libdirs for f in os.listdir(d)}
todo = [os.path.join("nixl_cu13", f) for f in os.listdir("nixl_cu13") if f.endswith(".so")]
todo.append(".nixl_cu13.mesonpy.libs/plugins/libplugin_POSIX.so")
seen = set()
while todo:
    p = todo.pop()
    if p in seen:
        continue
    seen.add(p)
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True, check=True).stdout
    todo += [where[n] for n in re.findall(r"\(NEEDED\).*\[(.*)\]", out) if n in where]
keep = sorted(seen) + ["nixl", "nixl_meta_utils.py", "nixl-1.5.2.dist-info", "nixl_cu13-1.5.1.dist-info"]
keep += [os.path.join("nixl_cu13", f) for f in os.listdir("nixl_cu13") if not f.endswith(".so")]
print("\n".join(keep))
PY
tar -cf - -T "$W/files.txt" | xz -9 -T0 > "$OUTDIR/nixl.tar.xz"
ls -l "$OUTDIR/nixl.tar.xz"; rm -rf "$W"
