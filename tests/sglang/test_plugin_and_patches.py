"""`--hicache-storage-backend tutti` without patches (plugin) and with them (patch set)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_gate():
    from tutti_hicache.plugin import check_version
    assert check_version("0.5.17") == "0.5.17" and check_version("0.5.23")
    for bad in ("0.5.16", "0.5.24", "0.6.0"):
        with pytest.raises(RuntimeError, match=bad):
            check_version(bad)
    # a pre-release's digits are not the patch number's ("0.5.2rc2" was read as 0.5.22)
    assert check_version("0.5.17rc0") and check_version("0.5.23.post1")
    for bad in ("0.5.2rc2", "0.5.1rc7"):
        with pytest.raises(RuntimeError, match=bad):
            check_version(bad)


def test_hook_targets_exist_in_the_installed_sglang(sglang):
    import pkgutil
    from tutti_hicache.plugin import check_version, hooks
    for target, _, _ in hooks(check_version()):
        module, attr = target.rsplit(".", 1)
        assert hasattr(pkgutil.resolve_name(module), attr), target


PLUGIN_SCRIPT = textwrap.dedent("""
    import argparse, sys, tempfile
    from tutti_hicache.testing import sglang as h
    h.ensure_sglang()
    from importlib.metadata import entry_points
    assert any(ep.value == "tutti_hicache.plugin:register"
               for ep in entry_points(group="sglang.srt.plugins")), "entry point not installed"
    from sglang.srt.plugins import load_plugins
    load_plugins()  # what every SGLang process does first
    from sglang.srt.server_args import ServerArgs
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    a = p.parse_args(["--model-path", "m", "--hicache-storage-backend", "tutti"])
    assert a.hicache_storage_backend == "tutti"
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    import torch
    pool = h.make_mha_host_pool("layer_first", 2, 2, 64, 16, torch.bfloat16, 4)
    sc = h.make_storage_config(extra_config={"tutti_dirs": [tempfile.mkdtemp()]})
    be = StorageBackendFactory.create_backend("tutti", sc, pool)
    print("BACKEND", type(be).__name__, type(getattr(be, "_backend", be)).__name__)
    a = p.parse_args(["--model-path", "m", "--hicache-storage-backend", "tutti-mooncake"])
    tiered = StorageBackendFactory.create_backend("tutti-mooncake", sc, pool)
    assert type(getattr(tiered, "_backend", tiered)).__name__ == "TieredStorage", type(tiered)
    from sglang.srt.managers.cache_controller import HiCacheController
    wrapped = HiCacheController.attach_storage_backend
    assert getattr(wrapped, "__wrapped__", None) is not None, "attach hook not applied"
    from tutti_hicache.plugin import _zero_copy
    class C:
        storage_backend_type, enable_storage = "tutti", True
        _page_get_zero_copy, _page_set_zero_copy = "get_v1", "set_v1"
    c = C()
    _zero_copy(None, c)
    assert (c.page_get_func, c.page_set_func) == ("get_v1", "set_v1")
    print("OK")
""")


@pytest.mark.slow  # a subprocess that imports SGLang with the plugin (about 10 s)
def test_plugin_makes_tutti_a_backend_name(sglang, tmp_path):
    env = dict(os.environ, SGLANG_PLUGINS="tutti")
    r = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "BACKEND TuttiStorage" in r.stdout or "TuttiStorage" in r.stdout


def _patch_set() -> tuple[list, set]:
    """The 0.5.23 patches in order, and the files under python/sglang/ they touch."""
    patches = sorted(os.path.join(ROOT, "patches", "sglang-0.5.23", p)
                     for p in os.listdir(os.path.join(ROOT, "patches", "sglang-0.5.23")))
    touched = set()
    for p in patches:
        with open(p) as f:
            touched.update(line[len("+++ b/python/sglang/"):].strip() for line in f
                           if line.startswith("+++ b/python/sglang/"))
    return patches, touched


def test_patch_set_applies_to_the_installed_sglang(sglang, tmp_path):
    """git apply the upstream-style patches onto a copy of the installed sources, in order."""
    import sglang as sgl
    if sglang.sglang_version() != "0.5.23":
        pytest.skip("the patch set targets SGLang 0.5.23")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    src = os.path.dirname(sgl.__file__)
    patches, touched = _patch_set()
    for rel in touched:
        dst = tmp_path / "python" / "sglang" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(src, rel), dst)
    for p in patches:
        r = subprocess.run(["git", "apply", "--check", p], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, f"{os.path.basename(p)}: {r.stderr}"
        subprocess.run(["git", "apply", p], cwd=tmp_path, check=True)
    factory = (tmp_path / "python/sglang/srt/mem_cache/storage/backend_factory.py").read_text()
    assert '"tutti_hicache.storage"' in factory and 'backend_name == "tutti"' in factory
    for rel in touched:
        compile((tmp_path / "python" / "sglang" / rel).read_text(), rel, "exec")


def test_readme_recipe_patches_an_install_inside_a_git_checkout(sglang, tmp_path):
    """patches/README.md's recipe for an installed SGLang, in a site-packages directory that sits
    inside a git checkout (a virtual environment in a project): plain `git apply -p2` takes paths
    relative to the checkout's root there, skips every file and exits 0; the recipe's
    GIT_CEILING_DIRECTORIES makes it patch, and its `-R --check` line confirms it."""
    import sglang as sgl
    if sglang.sglang_version() != "0.5.23":
        pytest.skip("the patch set targets SGLang 0.5.23")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "site-packages"
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    patches, touched = _patch_set()
    src = os.path.dirname(sgl.__file__)
    for rel in touched:
        dst = site / "sglang" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(src, rel), dst)
    factory = site / "sglang/srt/mem_cache/storage/backend_factory.py"
    plain = subprocess.run(["git", "apply", "-p2", patches[0]], cwd=site, capture_output=True)
    assert plain.returncode == 0 and "tutti" not in factory.read_text()  # the trap
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(site.parent))
    for p in patches:
        subprocess.run(["git", "apply", "-p2", p], cwd=site, env=env, check=True)
    assert 'backend_name == "tutti"' in factory.read_text()
    subprocess.run(["git", "apply", "-R", "--check", "-p2", *patches], cwd=site, env=env, check=True)
