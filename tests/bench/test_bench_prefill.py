"""bench/bench_prefill.py --dry-run: tiny shapes on the CPU through the whole pipeline. The dry run
compares every restored prefix with what was written (an AssertionError otherwise); checked here:
each read-ahead arm (a pipeline of its own, on the store the first wrote) runs at every point as
often as --repeats asks, each run carries its load's trace, and the arms' medians come out per
arm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "bench_prefill.py"


@pytest.mark.slow  # run as a user runs it: a child process that imports torch (seconds)
def test_the_dry_run_restores_byte_exact_for_every_arm_and_reports_their_medians(tmp_path):
    out = tmp_path / "out.json"
    argv = [sys.executable, str(SCRIPT), "--dry-run", "--medium", f"m={tmp_path}",
            "--contexts", "256", "--hits", "0.99", "--read-ahead", "1,3",
            "--repeats", "2", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    med = json.loads(out.read_text())["media"]["m"]
    runs = med["runs"]
    assert [(r["read_ahead"], r["repeat"]) for r in runs] == [(1, 0), (1, 1), (3, 0), (3, 1)]
    for r in runs:  # the load's own times, from its trace
        t = r["trace"]
        assert 0 < t["reads_ms"] <= t["handed_ms"] and t["react_ms_p50"] >= 0
        assert t["beyond_reads_ms"] == r["ttft_s"] * 1e3 - t["reads_ms"]
    arms = {a["read_ahead"]: a for a in med["arms"]}
    assert set(arms) == {1, 3} and all(a["n"] == 2 and a["ttft_s"] > 0 for a in arms.values())
    for ra, a in arms.items():
        ttfts = sorted(r["ttft_s"] for r in runs if r["read_ahead"] == ra)
        assert a["ttft_s"] == sum(ttfts) / 2  # the median of two


@pytest.mark.slow
def test_the_dry_run_through_the_dram_tier_restores_byte_exact_from_dram(tmp_path):
    """--host-gb: the prefix, read twice from the store, is copied up; every point then restores
    from DRAM (no engine call), byte-exact (the dry run's own comparison)."""
    out = tmp_path / "out.json"
    argv = [sys.executable, str(SCRIPT), "--dry-run", "--medium", f"m={tmp_path}",
            "--contexts", "256", "--hits", "0.5,0.99", "--host-gb", "0.01", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    med = json.loads(out.read_text())["media"]["m"]
    assert med["tiered_resident_pages"] == 256 // 16
    runs = med["tiered_runs"]
    assert [r["config"] for r in runs] == ["tutti-tiered:m"] * 2
    assert all(r["enter_calls"] == 0 for r in runs)  # nothing read from the store
    st = med["tiered_stats"]
    assert st["host_promoted_pages"] == 16 and st["load_host_pages"] > 0
