"""bench/bench_load_cpu.py on a tiny load: it runs its variants on real I/O and reports each
load's edges (the fill, the tail), with the chunk counts its settings imply."""

import json
import sys


def test_the_edge_chunk_variants_report_their_chunks_and_ordered_edges(tmp_path, monkeypatch, load_bench):
    mod = load_bench("bench_load_cpu")
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["bench_load_cpu.py", "--dir", str(tmp_path / "s"), "--dirs", "2",
                                      "--pages", "8", "--layers", "4", "--repeats", "2", "--json", str(out)])
    mod.main()
    res = json.loads(out.read_text())
    plain, edges = res["variants"]
    assert [v["variant"] for v in res["variants"]] == ["tutti_edge_chunks=1", "tutti_edge_chunks=4"]
    # 8 pages fit one 256 MiB chunk: 4 layers x 1 chunk, and with edges 2-page chunks at both ends
    assert {r["chunks"] for r in plain["loads"]} == {4} and {r["chunks"] for r in edges["loads"]} == {10}
    for var in res["variants"]:
        assert len(var["loads"]) == 2
        for r in var["loads"]:
            assert 0 <= r["opened_ms"] <= r["first_chunk_ms"] <= r["layer0_handed_ms"] <= r["finish_ms"]
            assert r["first_chunk_ms"] <= r["reads_ms"] <= r["finish_ms"] and r["tail_ms"] >= 0
    assert not list((tmp_path / "s").glob("store"))  # the store is removed after each variant
