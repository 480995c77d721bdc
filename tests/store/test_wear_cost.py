"""Drive writes per day of store directories that share a drive (the store's snapshot, inspect,
the Prometheus gauge), and `tutti-hicache cost` given the wrong JSON or no write data.

Two store directories under one temp dir sit on one filesystem: one drive. Its drive writes per
day are the bytes of both over its capacity; each directory alone would show about half.
"""

import json
import os

import pytest

from tutti_hicache.cli import main
from tutti_hicache.store import ObjectStore
from tutti_hicache.store.wear import FILE_NAME, read_counters

from test_store import GEOM, IDENT, Pages, keys
from test_wear import cfg_for, two_dirs

DAY = 86400.0


def fs_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def filled(tmp_path, n=8):
    """A store over two directories of one filesystem with n pages written (open)."""
    dirs = two_dirs(tmp_path)
    s = ObjectStore(cfg_for(dirs, slots=32), GEOM, IDENT)
    src = Pages(n, seed=1)
    assert s.write_pages(keys(n), src.addrs, True).all()
    return s, dirs


def test_two_directories_on_one_drive_show_the_drives_writes_per_day(tmp_path):
    s, dirs = filled(tmp_path)
    try:
        snap = s.wear()
    finally:
        s.close()
    cap = fs_bytes(tmp_path)
    total = sum(d["physical_bytes"] for d in snap["devices"])
    assert all(d["physical_bytes"] < total for d in snap["devices"])  # both directories wrote
    for dev in snap["devices"]:
        assert dev["drive_writes_per_day"] == pytest.approx(total / cap * DAY / dev["seconds"])
        assert dev["drive_dirs"] == sorted(map(str, dirs))
    [drive] = snap["drives"]
    assert drive["dirs"] == sorted(map(str, dirs)) and drive["physical_bytes"] == total
    assert drive["drive_writes_per_day"] == pytest.approx(total / cap * DAY / drive["seconds"])


def test_inspect_prints_one_line_per_drive(tmp_path, capsys):
    s, dirs = filled(tmp_path)
    ns_dirs = s.ns_dirs
    s.close()
    total = 0
    for ns in ns_dirs:  # two days of counting: enough history to project
        path = os.path.join(ns, FILE_NAME)
        with open(path) as f:
            w = json.load(f)
        w["since"] -= 2 * DAY
        with open(path, "w") as f:
            json.dump(w, f)
        c = read_counters(path)
        total += sum(c[k] for k in ("payload", "header", "tombstone", "meta"))
    capsys.readouterr()
    assert main(["inspect", *map(str, dirs)]) == 0
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if ln.startswith("drive ")]
    assert line.startswith(f"drive {dirs[0]}, {dirs[1]}: ")
    dwpd = float(line.split(": ")[1].split()[0])
    assert dwpd == pytest.approx(total / fs_bytes(tmp_path) / 2, rel=1e-3)
    assert "rating lasts" in line


def test_the_prometheus_gauge_is_one_per_drive(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY
    from tutti_hicache.wearmetrics import WearMetrics
    s, dirs = filled(tmp_path)
    try:
        snap = s.wear()
    finally:
        s.close()
    assert WearMetrics(min_interval_s=0).update(snap)
    first, second = sorted(map(str, dirs))
    name = "sglang:tutti_ssd_drive_writes_per_day"
    total = sum(d["physical_bytes"] for d in snap["devices"])
    want = total / fs_bytes(tmp_path) * DAY / snap["seconds"]
    assert REGISTRY.get_sample_value(name, {"device": first}) == pytest.approx(want)
    assert REGISTRY.get_sample_value(name, {"device": second}) is None


# ---------------------------------------------------------------------------- cost's input
@pytest.mark.parametrize("flag, text, why", [
    ("--stats", '{"pages": 3}', "not a tutti_stats_file"),
    ("--stats", "[1, 2]", "not a tutti_stats_file"),
    ("--stats", '{"wear": {"seconds": "10", "physical_bytes": 5}}', "not a tutti_stats_file"),
    ("--stats", "{not json", "not JSON"),
    ("--from-json", '{"pages": 3}', "not a bench_prefill result (it lacks its \"shape\")"),
    ("--from-json", "[]", "not a bench_prefill result (it lacks a JSON object)"),
    ("--from-json", '{"shape": {"layers": 32}, "results": []}',
     "not a bench_prefill result (it lacks a 'kv_heads' field)"),
    ("--from-json", '{"shape": {"layers": 2, "kv_heads": 8, "head_dim": 128}, "results": '
                    '[{"config": "tutti", "C": 10, "h": 0.5}]}',
     "not a bench_prefill result (it lacks a 'ttft_s' field)"),
])
def test_cost_with_the_wrong_json_is_one_line(tmp_path, capsys, flag, text, why):
    path = tmp_path / "x.json"
    path.write_text(text)
    args = [flag, str(path)] + (["--throughput", "1000"] if flag == "--stats" else [])
    assert main(["cost", *args]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"tutti-hicache cost: {flag} {path}: {why}")


def test_cost_with_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["cost", "--throughput", "1000", "--stats", str(tmp_path / "none.json")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"tutti-hicache cost: --stats {tmp_path / 'none.json'}: "
                                         f"cannot read it (No such file or directory)\n")


def test_cost_without_write_data_says_the_wear_is_not_included(capsys):
    assert main(["cost", "--throughput", "100000", "--ssd-gb", "2000"]) == 0
    out = capsys.readouterr().out
    assert "no write data given" in out and "wear is not included" in out
    assert out.splitlines()[0].startswith("assumed:")
    assert main(["cost", "--throughput", "100000", "--write-gb-per-mtok", "13.1"]) == 0
    assert "no write data given" not in capsys.readouterr().out


def test_cost_refuses_a_write_amplification_it_would_ignore(capsys):
    assert main(["cost", "--throughput", "100000", "--write-gb-per-mtok", "13.1",
                 "--write-amplification", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("tutti-hicache cost: --write-amplification scales the KV a "
                              "--from-json run writes")
