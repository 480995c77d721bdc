"""The build: the io_uring engine is always compiled in, from the vendored liburing and xxhash.

The extension must never pick up a system liburing.h or xxhash.h (CI machines have them installed
by hand now and then, a user's machine may not): the fast test checks what the installed
extension reports; the slow one configures and builds the repository from scratch in a temporary
directory and reads the compiler's header dependencies.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tutti_hicache.engine import extension

REPO = Path(__file__).resolve().parents[2]
SYSTEM_HEADERS = re.compile(r"^/usr/(local/)?include/(liburing|xxhash\.h|xxh3\.h)")


def _vendored_liburing_version() -> str:
    text = (REPO / "cmake" / "liburing.cmake").read_text()
    return re.search(r'set\(TUTTI_LIBURING_VERSION "([^"]+)"\)', text).group(1)


def test_installed_extension_has_the_vendored_io_uring():
    ext = extension()
    assert ext.uring_compiled()
    assert ext.URING_VENDORED_VERSION == _vendored_liburing_version()
    readelf = shutil.which("readelf")
    if readelf:  # linked statically: no liburing.so needed at run time
        needed = subprocess.run([readelf, "-d", ext.__file__], capture_output=True, text=True,
                                check=True).stdout
        assert "liburing" not in needed


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if not path:
        pytest.skip(f"{name} is not installed (scripts/setup_env.sh installs it)")
    return path


def _configure(build: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        import pybind11
    except ImportError:
        pytest.skip("pybind11 is not installed (scripts/setup_env.sh installs it)")
    cmd = [_tool("cmake"), "-S", str(REPO), "-B", str(build), "-G", "Ninja",
           f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}", f"-DPython_EXECUTABLE={sys.executable}",
           f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_clean_build_uses_only_vendored_headers(tmp_path):
    build = tmp_path / "build"
    conf = _configure(build)
    assert conf.returncode == 0, conf.stdout + conf.stderr
    assert "io_uring engine enabled (vendored liburing" in conf.stdout
    jobs = str(min(2, os.cpu_count() or 1))
    made = subprocess.run([_tool("ninja"), "-C", str(build), "-j", jobs], capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]

    deps = subprocess.run([_tool("ninja"), "-C", str(build), "-t", "deps"], capture_output=True,
                          text=True, check=True).stdout
    headers = {line.strip() for line in deps.splitlines() if line.startswith(" ")}
    assert not sorted(h for h in headers if SYSTEM_HEADERS.match(h))
    assert not sorted(h for h in headers if re.search(r"(^|/)cuda[^/]*\.h$", h))  # the CUDA part: none
    vendored = REPO / "cpp" / "third_party"
    assert str(vendored / "liburing" / "src" / "include" / "liburing.h") in headers
    assert str(vendored / "xxhash" / "xxhash.h") in headers

    probe = ("import _engine; print(_engine.uring_compiled(), _engine.URING_VENDORED_VERSION)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=build, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", _vendored_liburing_version()]


@pytest.mark.slow
def test_a_build_without_io_uring_fails_unless_allowed(tmp_path):
    # TUTTI_HAVE_LINUX_FS_H is the cached result of the kernel-header check: preset to false, the
    # build cannot include io_uring, as on a machine without the kernel headers.
    env = {k: v for k, v in os.environ.items() if k != "TUTTI_ALLOW_POSIX_ONLY"}
    refused = _configure(tmp_path / "refused", "-DTUTTI_HAVE_LINUX_FS_H=0", env=env)
    assert refused.returncode != 0
    assert "cannot build the io_uring engine" in refused.stderr
    assert "TUTTI_ALLOW_POSIX_ONLY=1" in refused.stderr

    allowed = _configure(tmp_path / "allowed", "-DTUTTI_HAVE_LINUX_FS_H=0",
                         env={**env, "TUTTI_ALLOW_POSIX_ONLY": "1"})
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "building the POSIX engine only" in allowed.stderr
