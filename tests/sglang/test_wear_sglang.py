"""The wear counters where SGLang sees them: TuttiStorage.get_stats exports them to Prometheus
beside SGLang's storage metrics, the stats file carries them, and the linker's stats file too."""

import json

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.sglang

from test_linker import Rig, sg  # noqa: E402,F401 (the linker rig and its fixture)
from test_storage_sglang import PAGE, make_pool, tutti  # noqa: E402

HEADER = 4096


def test_get_stats_exports_bytes_written_per_device(sglang, tmp_path):
    prom = pytest.importorskip("prometheus_client")
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 8)
    st, _ = tutti(h, [tmp_path / "s"], "mha", "layer_first",
                  tutti_stats_file=str(tmp_path / "stats.json"))
    st.register_mem_pool_host(pool)
    page = st.hostmap.geometry.page_nbytes  # 4 KiB objects: zero copy, no padding
    assert all(st.batch_set_v1(h.make_page_keys(4), pool.alloc(4 * PAGE)))
    st.get_stats()
    dev = str(tmp_path / "s")
    sample = lambda name, **lab: prom.REGISTRY.get_sample_value(name, {"device": dev, **lab})  # noqa: E731
    assert sample("sglang:tutti_ssd_written_bytes_total", kind="payload") == 4 * page
    assert sample("sglang:tutti_ssd_written_bytes_total", kind="header") == 4 * HEADER
    assert sample("sglang:tutti_ssd_written_bytes_total", kind="tombstone") == 0
    assert sample("sglang:tutti_kv_stored_bytes_total") == 4 * page
    assert sample("sglang:tutti_ssd_drive_writes_per_day") > 0
    st.clear()  # 4 tombstones, exported at the next poll (at most once a second)
    st._wear_metrics.min_interval_s = 0.0
    st.get_stats()
    assert sample("sglang:tutti_ssd_written_bytes_total", kind="tombstone") == 4 * HEADER
    st.close()
    wear = json.loads((tmp_path / "stats.json").read_text())["wear"]
    (d,) = wear["devices"]
    assert (d["payload_bytes"], d["header_bytes"], d["tombstone_bytes"], d["logical_bytes"]) == \
        (4 * page, 4 * HEADER, 4 * HEADER, 4 * page)
    assert d["dir"] == dev and wear["logical_bytes"] == 4 * page


def test_linker_stats_file_carries_the_wear(sg, tmp_path):
    a = Rig([tmp_path / "s"], tutti_stats_file=str(tmp_path / "linker.json"))
    toks = list(range(500, 512))
    a.insert(toks, a.fill(len(toks), 5))
    a.commit_offloads(1)
    store = a.linker.store
    pages, page = store.stats()["write_pages"], store.layout.geometry.page_nbytes
    a.close()
    wear = json.loads((tmp_path / "linker.json").read_text())["wear"]
    assert pages == 3 and wear["logical_bytes"] == pages * page
    assert wear["devices"][0]["header_bytes"] == pages * HEADER
    payload = store.layout.payload_nbytes if store.layout.padded else page  # bounce: padded
    assert wear["devices"][0]["payload_bytes"] == pages * payload


def test_a_host_pool_registered_again_exports_the_new_stores_bytes_whole(sglang, tmp_path):
    """SGLang registering a host pool again closes the store and opens another, whose counters
    start at 0. The exported counters went on from the old store's totals: the new store's bytes
    up to them were never added (here 4 pages' worth), and the old store's last ones were lost."""
    prom = pytest.importorskip("prometheus_client")
    h = sglang
    pool = make_pool(h, "mha", "layer_first", 16)
    st, _ = tutti(h, [tmp_path / "s"], "mha", "layer_first")
    st.register_mem_pool_host(pool)
    page = st.hostmap.geometry.page_nbytes
    dev = str(tmp_path / "s")
    sample = lambda: prom.REGISTRY.get_sample_value(  # noqa: E731
        "sglang:tutti_ssd_written_bytes_total", {"device": dev, "kind": "payload"}) or 0
    base = sample()
    assert all(st.batch_set_v1(h.make_page_keys(4), pool.alloc(4 * PAGE)))
    st.get_stats()
    assert all(st.batch_set_v1(h.make_page_keys(8)[4:], pool.alloc(4 * PAGE)))  # not polled yet
    st.register_mem_pool_host(pool)  # a new store: its counters start at 0
    assert sample() - base == 8 * page  # the old store's last 4 pages exported at the switch
    assert all(st.batch_set_v1(h.make_page_keys(16)[8:], pool.alloc(8 * PAGE)))
    st._wear_metrics.min_interval_s = 0.0
    st.get_stats()
    assert sample() - base == 16 * page
    st.close()
