"""bench/sim_host_policy.py: the DRAM tier's 2Q driven as the linker drives it, on a Zipf trace."""

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    spec = importlib.util.spec_from_file_location("sim_host_policy", os.path.join(ROOT, "bench", "sim_host_policy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_tier_that_holds_the_working_set_hits_every_page_and_a_third_of_it_fewer(tmp_path, monkeypatch):
    sim = load()
    docs = sim.zipf_docs(12, 1.0, 300, seed=3)
    assert docs.min() >= 0 and docs.max() < 12 and (docs == 0).sum() > (docs == 11).sum()
    assert sim.run_2q(docs, 12, 4, 48)["hit_rate"] == 1.0  # every page fits: all DRAM hits
    assert sim.run_lru(docs, 12, 4, 48)["hit_rate"] == 1.0
    small = sim.run_2q(docs, 12, 4, 16)
    assert 0 < small["hit_rate"] < 1 and small["promoted"] > 0 and small["evicted"] > 0
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["sim", "--alphas", "0.8", "--docs", "12", "--pages", "4",
                                      "--requests", "200", "--json", str(out)])
    sim.main()
    (row,) = json.loads(out.read_text())
    assert row["alpha"] == 0.8 and row["slots"] == 16
    assert 0 < row["2q"]["hit_rate"] <= 1 and 0 < row["static_best"]["hit_rate"] <= 1
