"""tutti-hicache demo / bench store / inspect / fsck on a temp dir."""

import json

import pytest

from tutti_hicache.cli import main

pytestmark = pytest.mark.sglang


def test_demo_verifies_every_byte(sglang, tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path), "--pages", "12"]) == 0
    out = capsys.readouterr().out
    assert "all restored bytes verified" in out and "SGLang file restore" in out


@pytest.mark.slow  # a benchmark run (three backends, read and write)
def test_bench_store_json_keys(sglang, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "store", "--medium", str(tmp_path), "--geometry", "small",
                 "--pages", "10", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for k in ("raw_read_GBps", "tutti_read_GBps", "file_read_GBps", "tutti_write_GBps",
              "file_write_GBps", "tutti_cpu_s_per_GB", "enter_calls_per_batch",
              "tutti_read_noverify_GBps"):
        assert isinstance(r[k], float) and r[k] > 0, k
    assert r["tutti_verified_bytes_equal"] and r["file_verified_bytes_equal"]


def test_bench_store_pin_without_cuda_is_a_clear_refusal(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: --pin works here")
    assert main(["bench", "store", "--medium", str(tmp_path), "--pages", "2", "--pin"]) == 2
    assert "--pin" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("options, why", [
    ("size=64m,ro", "cannot write there (Read-only file system)"),
    ("size=1m", "MiB free, and this run writes about 64 MiB (8 pages, 3 copies); free space "
                "there or lower --pages"),
], ids=["read_only", "full"])
def test_bench_store_on_a_read_only_or_full_medium_is_one_line(sglang, tmpfs, capsys, options,
                                                               why):
    medium = tmpfs(options)
    assert main(["bench", "store", "--medium", str(medium), "--geometry", "small",
                 "--pages", "8"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"tutti-hicache bench store: --medium {medium}: ") and why in out.err


def test_inspect_and_fsck_find_and_drop_a_bad_page(sglang, tmp_path, capsys):
    import torch
    from tutti_hicache.storage import TuttiStorage
    h = sglang
    pool = h.make_mha_host_pool("layer_first", 2, 2, 64, 16, torch.bfloat16, 8)
    sc = h.make_storage_config(extra_config={"tutti_dirs": [str(tmp_path)], "tutti_capacity_gb": 0.01})
    st = TuttiStorage(sc, {})
    st.register_mem_pool_host(pool)
    idx = pool.alloc(4 * 16)
    h.fill_random(pool, idx, 1)
    keys = h.make_page_keys(4)
    assert all(st.batch_set_v1(keys, idx))
    store = st.store
    path, off = store.locate(keys[2])
    st.close()
    with open(path, "r+b") as f:
        f.seek(off + 4096 + 7)
        f.write(b"\x00\x01")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pages: 4" in out and keys[0] in out
    assert main(["fsck", str(tmp_path)]) == 1
    assert "1 bad payloads" in capsys.readouterr().out
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert main(["fsck", str(tmp_path)]) == 0
    assert "3 pages checked, 0 bad" in capsys.readouterr().out
