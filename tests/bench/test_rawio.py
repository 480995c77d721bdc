"""The raw medium's reference reads (benchmarks/rawio.py) and the request size the e2e harness
reads it at: the linker's own request (one layer of one page), as the store really issues it."""

import os

import numpy as np
import pytest

from tutti_hicache.benchmarks import configs
from tutti_hicache.benchmarks.rawio import raw_read_dirs, raw_read_uring_GBps, write_raw_file
from tutti_hicache.layout import PageGeometry, SlotLayout
from tutti_hicache.store.layer_reads import LayerReads, PagePlan


def _geometry(shape: str, page: int, dtype: str) -> PageGeometry:
    cfg = configs.MODELS[shape]
    elem = 1 if dtype in configs.FP8_KV else 2
    if "kv_lora_rank" in cfg:
        return PageGeometry("mla", 2, page, (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem, 0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per = cfg["num_key_value_heads"] * hd * elem
    return PageGeometry("mha", 2, page, per, per)


@pytest.mark.parametrize("shape", sorted(configs.MODELS))
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["auto", "fp8_e4m3"])
def test_the_harness_request_size_is_the_stores_layer_read(shape, page, dtype):
    """layer_request_bytes is what the store's layer stream asks of the engine per page and
    layer (its objects, each padded to 4 KiB), for every shape, page size and KV dtype."""
    reads = LayerReads(None, None, SlotLayout(_geometry(shape, page, dtype)), None, None, False)
    plan = PagePlan(entries=[None, None], slots=np.arange(2), files=np.zeros(2, np.int64),
                    offsets=np.zeros(2, np.int64), must=np.zeros(2, bool), units=np.zeros((2, 2), np.uint64))
    req = reads._requests(plan, [(1, slice(0, 2))], [np.zeros(2, np.uint64)])
    assert req.nbytes.tolist() == [configs.layer_request_bytes(shape, page, dtype)] * 2


def test_raw_read_also_through_the_engine_over_every_directory_leaves_nothing(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    out = raw_read_dirs([str(d) for d in dirs], 8 << 20, reqs=(256 << 10,), engine_req=72 << 10)
    assert out["raw_engine_GBps"] > 0 and out["raw_read_GBps"] == out["raw_256KiB_GBps"] > 0
    assert not any(os.listdir(d) for d in dirs)


def test_every_files_requests_are_read(tmp_path):
    """Requests interleave over the files: a second file shorter than the span fails the read
    (a short request), so its requests were really issued, to its end."""
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    write_raw_file(a, 4 << 20)
    write_raw_file(b, 4 << 20)
    assert raw_read_uring_GBps([a, b], 4 << 20, 64 << 10, 1 << 20, [str(tmp_path)]) > 0
    write_raw_file(b, 2 << 20)
    with pytest.raises(OSError):
        raw_read_uring_GBps([a, b], 4 << 20, 64 << 10, 1 << 20, [str(tmp_path)])
