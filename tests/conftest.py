"""Shared test setup: Triton's interpreter without CUDA, skips for the `gpu` and `sglang` markers, the
`sglang` fixture, the `store_dirs` fixture, and a skip (with SGLang's message) for a test whose
SGLang host pool does not fit in the machine's free memory even beside the harness's small reserve
(tutti_hicache.testing.sglang.HOST_MEMORY_RESERVE_BYTES).

SGLang is never imported at collection: tests that need it take the `sglang` fixture (or call
`require_sglang()`), which imports it on first use (torchvision stub included, see
tutti_hicache.testing.sglang) and skips with the reason when it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def pytest_configure(config):
    """Without CUDA the Triton kernels run in Triton's interpreter. Set here, once, before any test
    module imports triton, so every test sees the same mode whatever the collection order (the
    markers themselves are declared in pyproject.toml).

    SGLang builds its native hash extension with torch's JIT on first use (about 6 s), into one
    directory per user: two checkouts' environments sharing it rebuild it at every run, each
    evicting the other's build. In a virtual environment the tests keep theirs inside it."""
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA and `sglang` tests without SGLang, with the reason. By marker,
    not keyword: a test's keywords also hold its directories' names (tests/gpu/, tests/sglang/)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
            for item in gpu_items:
                item.add_marker(skip)
    if importlib.util.find_spec("sglang") is None:
        skip = pytest.mark.skip(reason="sglang is not installed (scripts/setup_env.sh installs it)")
        for item in items:
            if item.get_closest_marker("sglang"):
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_on_host_memory_short())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_on_host_memory_short())


def _skip_on_host_memory_short():
    """Run the hook's phase; a host pool SGLang refused for want of free memory is a skip: the
    machine cannot run the test, the code under test did nothing wrong."""
    from tutti_hicache.testing.sglang import HostMemoryShort

    try:
        return (yield)
    except HostMemoryShort as exc:
        pytest.skip(str(exc))


def require_sglang() -> str:
    """Import SGLang's HiCache modules (once) and return its version.

    Skips the calling test when SGLang is not installed; an installed SGLang that fails to import
    (a missing dependency) is an error, not a skip.
    """
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (scripts/setup_env.sh installs it)")
    from tutti_hicache.testing import sglang as _sglang_harness

    return _sglang_harness.ensure_sglang()


@pytest.fixture
def sglang():
    """The harness module (tutti_hicache.testing.sglang) with SGLang imported; skips without it."""
    require_sglang()
    from tutti_hicache.testing import sglang as _sglang_harness

    return _sglang_harness


def _shm_dir():
    """A fresh directory under /dev/shm, or a skip when /dev/shm is missing or not writable."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not available")
    return Path(tempfile.mkdtemp(prefix="tutti-test-", dir="/dev/shm"))


@pytest.fixture(params=["disk", "shm"])
def store_dirs(request, tmp_path):
    """A list of one existing, empty store directory: under `tmp_path` (the disk's filesystem,
    ext4 here), then under /dev/shm (tmpfs). The /dev/shm directory is removed after the test.
    """
    if request.param == "disk":
        path = tmp_path / "store"
        path.mkdir()
        yield [path]
        return
    path = _shm_dir()
    try:
        yield [path]
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mount_tmpfs():
    """mount_tmpfs(path, options) mounts a tmpfs there (root only) and returns "" or mount's error;
    every mount is undone after the test."""
    mounted = []

    def mount(path, options):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "none", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            return r.stderr.strip() or f"mount exited {r.returncode}"
        mounted.append(path)
        return ""

    yield mount
    for path in reversed(mounted):
        _umount(path)


@pytest.fixture
def tmpfs(tmp_path, mount_tmpfs):
    """tmpfs(options) -> a new directory under tmp_path with a tmpfs mounted on it ("size=8m",
    "size=64m,ro"); skips the test where it cannot mount (not root, no mount)."""
    def make(options):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = Path(tempfile.mkdtemp(prefix="tmpfs-", dir=tmp_path))
        err = mount_tmpfs(mnt, options)
        if err:
            pytest.skip(f"cannot mount a tmpfs: {err}")
        return mnt
    return make


def _umount(mnt):
    """io_uring drops its file references asynchronously after close: retry, then detach."""
    for _ in range(50):
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", "-l", str(mnt)], check=True)

