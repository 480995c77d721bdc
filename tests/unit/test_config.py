"""Config: precedence, validation errors that name the key (every setting, generated from
SETTINGS: wrong types through the SGLang adapter, below the minimum, bad environment values,
non-finite numbers), directory checks."""

import math
import os
import re

import pytest

from tutti_hicache.config import SETTINGS, TuttiConfig, settings_markdown
from tutti_hicache.store.namespace import check_dirs


def test_defaults_env_and_extra_precedence():
    env = {"TUTTI_HICACHE_CAPACITY_GB": "5", "TUTTI_HICACHE_VERIFY": "false",
           "TUTTI_HICACHE_DIRS": "/a,/b"}
    cfg = TuttiConfig.from_sources({"tutti_capacity_gb": 7}, env=env)
    assert cfg.capacity_gb == 7.0  # extra_config beats env
    assert cfg.verify is False  # env beats default
    assert cfg.dirs == ("/a", "/b")
    assert cfg.engine == "auto" and cfg.queue_depth == 0  # 0: derived from the devices
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


# ------------------------------------------------ every setting, generated from SETTINGS
def _wrong_values(s):
    return {
        "str": [5, 1.5, None, ["x"]],
        "choice": [5, None, "no-such-choice", ["auto"]],
        "int": ["many", 1.5, True, None, [1], "1e3"],
        "float": ["lots", True, None, [1.0], {}],
        "bool": ["maybe", 2, None, [True], 0.5],
        "dirs": [3, [3], [""], {"a": 1}, True],
    }[s.kind]


WRONG = [(s.name, v) for s in SETTINGS for v in _wrong_values(s)]


@pytest.mark.sglang
@pytest.mark.parametrize("name,value", WRONG, ids=[f"{n}-{i}" for i, (n, _) in enumerate(WRONG)])
def test_wrong_type_is_a_value_error_naming_the_key(sglang, tmp_path, name, value):
    from tutti_hicache.storage import TuttiStorage
    extra = {"tutti_dirs": [str(tmp_path)], f"tutti_{name}": value}
    with pytest.raises(ValueError, match=f"tutti_{name}"):
        TuttiStorage(sglang.make_storage_config(extra_config=extra), {})


BELOW = [(s.name, s.minimum - (1 if s.kind == "int" else 1e-3))
         for s in SETTINGS if s.minimum is not None]


@pytest.mark.parametrize("name,value", BELOW, ids=[n for n, _ in BELOW])
def test_out_of_range_is_a_value_error_naming_the_key(name, value):
    with pytest.raises(ValueError, match=f"tutti_{name}"):
        TuttiConfig.from_sources({"tutti_dirs": ["/x"], f"tutti_{name}": value}, env={})


ENV_BAD = [(s.name, {"int": "many", "float": "lots", "bool": "maybe", "choice": "bogus"}[s.kind])
           for s in SETTINGS if s.kind in ("int", "float", "bool", "choice")]


@pytest.mark.parametrize("name,value", ENV_BAD, ids=[n for n, _ in ENV_BAD])
def test_bad_environment_value_names_the_variable(name, value):
    var = f"TUTTI_HICACHE_{name.upper()}"
    with pytest.raises(ValueError, match=var):
        TuttiConfig.from_sources({"tutti_dirs": ["/x"]}, env={var: value})


NON_FINITE = [(s.name, v) for s in SETTINGS if s.kind == "float"
              for v in (math.inf, math.nan, "inf", "nan")]


@pytest.mark.parametrize("name,value", NON_FINITE,
                         ids=[f"{n}-{v}" for n, v in NON_FINITE])
def test_non_finite_numbers_are_refused(name, value):
    with pytest.raises(ValueError, match=f"tutti_{name}"):
        TuttiConfig.from_sources({"tutti_dirs": ["/x"], f"tutti_{name}": value}, env={})


@pytest.mark.sglang
def test_missing_and_unusable_directories(sglang, tmp_path):
    from tutti_hicache.storage import TuttiStorage
    h = sglang
    new = tmp_path / "not" / "yet" / "there"
    st = TuttiStorage(h.make_storage_config(extra_config={"tutti_dirs": [str(new)]}), {})
    assert new.is_dir() and new.stat().st_mode & 0o777 == 0o700
    st.close()
    afile = tmp_path / "afile"
    afile.write_text("x")
    for d in (afile, afile / "below"):
        with pytest.raises(ValueError, match="tutti_dirs"):
            TuttiStorage(h.make_storage_config(extra_config={"tutti_dirs": [str(d)]}), {})
    with pytest.raises(ValueError, match="tutti_dirs"):
        TuttiStorage(h.make_storage_config(extra_config={}), {})


@pytest.mark.sglang
def test_unwritable_directory(sglang, tmp_path, mount_tmpfs):
    from tutti_hicache.storage import TuttiStorage
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:  # root writes through modes: a read-only filesystem it is
        err = mount_tmpfs(ro, "ro,size=1m")  # unmounted after the test
        if err:
            pytest.skip(f"cannot mount a read-only tmpfs: {err}")
        mounted = True
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="tutti_dirs.*not writable"):
            TuttiStorage(sglang.make_storage_config(extra_config={"tutti_dirs": [str(ro)]}), {})
    finally:
        if not mounted:
            ro.chmod(0o700)


@pytest.mark.parametrize("extra, env, why", [
    ('{"tutti_threads": Infinity}', {}, "tutti_threads: expected a number"),  # OverflowError before
    ('{"tutti_dirs": ["/kv", " "]}', {}, "tutti_dirs: expected a list of directory paths"),  # the cwd
    ('{"tutti-capacity-gb": 2000}', {}, "did you mean tutti_capacity_gb?"),  # silently the default
    ('{"Tutti_capacity_gb": 2000}', {}, "did you mean tutti_capacity_gb?"),
    ("{}", {"TUTTI_HICACHE_CAPACITY_G": "2000"}, "did you mean TUTTI_HICACHE_CAPACITY_GB?"),
    ('{"tutti_queue_depth": 65536}', {}, "to 32768"),  # io_uring refused it: the posix engine
    ('{"tutti_host_gb": -0.5}', {}, "-1 (auto), 0 (off) or a size"),  # silently auto
])
def test_settings_that_were_accepted_or_crashed(extra, env, why):
    """Each of these was taken silently (a misspelt key left its setting at the default, a blank
    directory became the working directory, -0.5 GiB meant auto, a queue depth io_uring refuses
    fell back to the posix engine with a message blaming the kernel) or raised another error
    than the ValueError naming the key (Infinity: OverflowError)."""
    import json as _json
    cfg = _json.loads(extra)
    cfg.setdefault("tutti_dirs", ["/kv"])
    with pytest.raises(ValueError, match=re.escape(why)):
        TuttiConfig.from_sources(cfg, env=env)
