"""SGLang's page-hash module is built at attach (tutti_hicache.hashwarm), not inside the first request."""

from __future__ import annotations

import logging

import pytest

from tutti_hicache import hashwarm


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(hashwarm, "_thread", None)


def test_a_failed_build_is_one_warning_and_no_exception(fresh, monkeypatch, caplog):
    def broken():
        raise RuntimeError("no compiler")
    monkeypatch.setattr(hashwarm, "_loader", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="tutti_hicache.storage"):
        t = hashwarm.start()
        t.join(10)
    assert not t.is_alive()
    assert [r.message for r in caplog.records if "page-hash module" in r.message and "no compiler" in r.message]


def test_no_native_hash_module_starts_nothing(fresh, monkeypatch):
    monkeypatch.setattr(hashwarm, "_MODULE", "sglang_without_native_hash_here")
    assert hashwarm.start() is None


def test_one_build_per_process(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(hashwarm, "_loader", lambda: (lambda: calls.append(1)))
    first = hashwarm.start()
    assert hashwarm.start() is first
    first.join(10)
    assert calls == [1]


@pytest.mark.slow
@pytest.mark.sglang
def test_attach_builds_sglangs_hash_module(sglang, fresh, tmp_path):
    """The host tier's attach leaves SGLang's own loader cached: the first request's hash finds it."""
    from tutti_hicache.testing import sglang as H
    load = hashwarm._loader()
    if load is None:
        pytest.skip(f"SGLang {sglang} hashes pages in Python (no native module to build)")
    load.cache_clear()
    import torch
    from tutti_hicache.storage import TuttiStorage
    pool = H.make_mha_host_pool("layer_first", 2, 2, 64, 64, torch.bfloat16, 4)
    st = TuttiStorage(H.make_storage_config(extra_config={"tutti_dirs": [str(tmp_path)],
                                                          "tutti_capacity_gb": 0.01}), {})
    st.register_mem_pool_host(pool)  # the attach SGLang makes
    try:
        hashwarm._thread.join(300)
        assert load.cache_info().currsize == 1
        from sglang.srt.mem_cache.utils import get_hash_str
        assert get_hash_str([1, 2, 3]) == get_hash_str([1, 2, 3])
    finally:
        st.close()
