"""bench/bench_verify.py: the loader and the host tier's read with verification on and off, MLA beside MHA."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # four stores on disk, one restore each: ~10-25 s
def test_both_geometries_restore_with_verification_on_and_off(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_verify", os.path.join(ROOT, "bench", "bench_verify.py"))
    bv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bv)
    from tutti_hicache.layerwise import loader
    scatter = loader.Loader._scatter  # what the benchmark replaces (a GPU kernel there)
    out = tmp_path / "bv.json"
    monkeypatch.setattr(sys, "argv", ["bv", "--dir", str(tmp_path / "m"), "--pages", "4", "--reps", "1",
                                      "--threads", "2", "--json", str(out)])
    bv.main()  # each restore asserts that the loader finished it
    assert loader.Loader._scatter is scatter  # given back: later tests restore for real
    r = json.loads(out.read_text())
    assert set(r["on_over_off"]) == {"linker/mla27", "linker/mha3", "host/mla27", "host/mha3"}
    assert all(len(v) == 1 and v[0] > 0 for v in r["GBps"].values()) and len(r["GBps"]) == 8
    assert not (tmp_path / "m").exists()  # its stores are removed
