"""Config: precedence, validation errors that name the key, directory checks."""

import os

import pytest

from tutti_hicache.config import SETTINGS, TuttiConfig, settings_markdown
from tutti_hicache.namespace import check_dirs


def test_defaults_env_and_extra_precedence():
    env = {"TUTTI_HICACHE_CAPACITY_GB": "5", "TUTTI_HICACHE_VERIFY": "false",
           "TUTTI_HICACHE_DIRS": "/a,/b"}
    cfg = TuttiConfig.from_sources({"tutti_capacity_gb": 7}, env=env)
    assert cfg.capacity_gb == 7.0  # extra_config beats env
    assert cfg.verify is False  # env beats default
    assert cfg.dirs == ("/a", "/b")
    assert cfg.engine == "auto" and cfg.queue_depth == 1024
    assert cfg.capacity_bytes == 7 << 30


def test_non_tutti_keys_are_ignored():
    cfg = TuttiConfig.from_sources({"backend_name": "tutti", "interface_v1": 1,
                                    "module_path": "x", "tutti_dirs": ["/x"]}, env={})
    assert cfg.dirs == ("/x",)


@pytest.mark.parametrize("extra, key", [
    ({"tutti_bogus": 1}, "tutti_bogus"),
    ({"tutti_capacity_gb": "lots"}, "tutti_capacity_gb"),
    ({"tutti_capacity_gb": -1}, "tutti_capacity_gb"),
    ({"tutti_queue_depth": 1.5}, "tutti_queue_depth"),
    ({"tutti_queue_depth": True}, "tutti_queue_depth"),
    ({"tutti_engine": "spdk"}, "tutti_engine"),
    ({"tutti_verify": "maybe"}, "tutti_verify"),
    ({"tutti_dirs": 3}, "tutti_dirs"),
    ({"tutti_dirs": ["/a", "/a"]}, "tutti_dirs"),
    ({"tutti_revision": 5}, "tutti_revision"),
])
def test_bad_values_name_the_key(extra, key):
    with pytest.raises(ValueError, match=key):
        TuttiConfig.from_sources(extra, env={})


def test_bad_env_names_the_variable():
    with pytest.raises(ValueError, match="TUTTI_HICACHE_THREADS"):
        TuttiConfig.from_sources({}, env={"TUTTI_HICACHE_THREADS": "many"})


def test_check_dirs(tmp_path):
    with pytest.raises(ValueError, match="tutti_dirs: at least one"):
        check_dirs(TuttiConfig())
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="tutti_dirs"):
        check_dirs(TuttiConfig(dirs=(str(f),)))
    new = tmp_path / "new" / "store"
    check_dirs(TuttiConfig(dirs=(str(new),)))
    assert new.is_dir() and (new.stat().st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        check_dirs(TuttiConfig(dirs=(str(d),)))


def test_settings_doc_is_in_sync():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "settings.md")) as f:
        doc = f.read()
    assert settings_markdown() in doc, "regenerate docs/settings.md from config.settings_markdown()"
    for s in SETTINGS:
        assert f"tutti_{s.name}" in doc


def test_directory_without_o_direct_is_refused(tmp_path, monkeypatch):
    from tutti_hicache import engine
    monkeypatch.setattr(engine, "probe_o_direct", lambda d: False)
    with pytest.raises(ValueError, match="tutti_dirs: the filesystem of .* refuses O_DIRECT"):
        check_dirs(TuttiConfig(dirs=(str(tmp_path),)))
