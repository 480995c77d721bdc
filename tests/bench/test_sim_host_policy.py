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


def test_a_device_pool_in_front_answers_repeats_and_the_tier_sees_the_rest():
    """--device-docs: a request for a document in the device LRU never reaches the tier; the
    shares of all pages add up (device + tier + SSD = 1); the static best keeps the documents
    ranked after the device pool's."""
    sim = load()
    docs = sim.np.array([0, 0, 1, 0, 2, 2, 3, 0])
    dev = sim.DeviceLRU(1)
    assert [dev.hit(int(d)) for d in docs] == [False, True, False, False, False, True, False, False]
    r = sim.run_2q(docs, 4, 2, 2, device_docs=1)
    assert r["device_share"] == 2 / 8 and 0 <= r["host_share"] <= 6 / 8  # the two repeats
    assert sim.run_2q(docs, 4, 2, 8, device_docs=1)["host_share"] == 6 / 8  # a tier holding all
    best = sim.static_best(docs, 4, 2, 2, device_docs=1)  # counts 4, 2, 1, 1: the tier holds rank 2
    assert best["host_share"] == 2 / 8 and best["hit_rate"] == 2 / 4
