"""SSD wear counters through the real store on temp dirs: exact bytes by kind and device for a
scripted write/evict/clear sequence (expected from the slot layout and where `locate` finds each
page), the bounce path's padding, persistence across re-attach, a damaged counter file, processes
merging into one file, concurrent writers, and inspect / cost / fsck printing the figures."""

import json
import logging
import os
import threading

import numpy as np
import pytest

from tutti_hicache.cli import main
from tutti_hicache.config import TuttiConfig
from tutti_hicache.layout import HEADER_NBYTES, PageGeometry, SlotLayout
from tutti_hicache.store import ObjectStore
from tutti_hicache.store.wear import FILE_NAME, Wear, read_counters

from test_store import GEOM, IDENT, Pages, keys

LAY = SlotLayout(GEOM)  # 8 objects of 4 KiB: a page is 32 KiB, a slot 36 KiB
PAGE = GEOM.page_nbytes


def two_dirs(tmp_path):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for d in dirs:
        d.mkdir()
    return dirs


def cfg_for(dirs, slots, **kw):
    base = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": slots * LAY.slot_nbytes / 2**30,
            "tutti_segment_gb": 1 / 1024, "tutti_rescan_interval_s": 0.0}
    base.update(kw)
    return TuttiConfig.from_sources(base, env={})


def device_of(store, key, dirs) -> int:
    """The store directory whose segment file holds key (from the path, not from the counters)."""
    path = store.locate(key)[0]
    return next(i for i, d in enumerate(dirs) if path.startswith(str(d) + os.sep))


def meta_on_disk(store) -> list[int]:
    """Bytes of identity.json + placement.json in each namespace directory."""
    return [sum(os.path.getsize(os.path.join(ns, f)) for f in ("identity.json", "placement.json"))
            for ns in store.ns_dirs]


def kinds(store) -> np.ndarray:
    """[device, (payload, header, tombstone, meta, logical)] of this session."""
    return np.array([[d[f"{k}_bytes"] for k in ("payload", "header", "tombstone", "meta", "logical")]
                     for d in store.wear()["devices"]])


def run_threads(target, n: int) -> None:
    """target(i) on n threads at once, all joined."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_scripted_write_evict_clear_counts_every_byte(tmp_path):
    dirs = two_dirs(tmp_path)
    s = ObjectStore(cfg_for(dirs, slots=6), GEOM, IDENT)
    want = np.zeros((2, 5), dtype=np.int64)
    want[:, 3] = meta_on_disk(s)  # written at attach
    assert (kinds(s) == want).all()

    src, first = Pages(4, seed=1), keys(4, "a")
    assert s.write_pages(first, src.addrs, True).all()
    for k in first:  # fresh slots: payload, header, no tombstone
        want[device_of(s, k, dirs)] += [PAGE, HEADER_NBYTES, 0, 0, PAGE]
    assert (kinds(s) == want).all()

    assert s.write_pages(first, src.addrs, True).all()  # present: deduplicated, nothing written
    assert (kinds(s) == want).all()

    used = {e.slot for e in s.entries().values()}
    second = keys(4, "b")  # 6 slots: 2 fresh, then 2 evictions reuse slots (tombstone first)
    src = Pages(4, seed=2)
    moved = s.engine.counters()["bytes"]  # the row is held: this batch only writes
    assert s.write_pages(second, src.addrs, True).all()
    moved = s.engine.counters()["bytes"] - moved
    reused = 0
    for k in second:
        tomb = HEADER_NBYTES if s.entries()[k].slot in used else 0
        reused += bool(tomb)
        want[device_of(s, k, dirs)] += [PAGE, HEADER_NBYTES, tomb, 0, PAGE]
    assert reused == 2 and s.stats()["evictions"] == 2
    assert moved == 4 * (PAGE + HEADER_NBYTES) + 2 * HEADER_NBYTES  # what the engine wrote
    assert (kinds(s) == want).all()

    present = list(s.entries())
    for k in present:  # clear tombstones every own page
        want[device_of(s, k, dirs)] += [0, 0, HEADER_NBYTES, 0, 0]
    assert s.clear() == 6
    assert (kinds(s) == want).all()
    w = s.wear()
    assert w["physical_bytes"] == want[:, :4].sum() and w["logical_bytes"] == 8 * PAGE
    assert w["write_amplification"] == pytest.approx(want[:, :4].sum() / (8 * PAGE))
    s.close()


def test_bounce_path_writes_the_padding(tmp_path):
    geo = PageGeometry("mha", 2, 8, 375, 375)  # objects of 3000 bytes, padded to 4 KiB on disk
    lay = SlotLayout(geo)
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path)], "tutti_capacity_gb": 0.001,
                                    "tutti_segment_gb": 1 / 1024}, env={})
    s = ObjectStore(cfg, geo, IDENT)
    src = Pages(3, seed=4, geometry=geo)
    assert s.write_pages(keys(3), src.addrs, False).all()
    dev = s.wear()["devices"][0]
    assert dev["payload_bytes"] == 3 * lay.payload_nbytes == 3 * 4 * 4096
    assert dev["logical_bytes"] == 3 * geo.page_nbytes == 3 * 12000
    assert dev["write_amplification"] == pytest.approx(
        (3 * (lay.payload_nbytes + HEADER_NBYTES) + dev["meta_bytes"]) / 36000)
    s.close()


def test_counters_persist_across_reattach_and_count_their_own_file(tmp_path):
    dirs = two_dirs(tmp_path)
    cfg = cfg_for(dirs, slots=64)
    s = ObjectStore(cfg, GEOM, IDENT)
    src = Pages(5, seed=1)
    assert s.write_pages(keys(5), src.addrs, True).all()
    first = kinds(s)
    s.close()  # flushes
    files = [os.path.join(ns, FILE_NAME) for ns in s.ns_dirs]
    for d, path in enumerate(files):
        c = read_counters(path)
        own = os.path.getsize(path)
        assert [c["payload"], c["header"], c["tombstone"], c["logical"]] == \
            [first[d, 0], first[d, 1], first[d, 2], first[d, 4]]
        assert c["meta"] == first[d, 3] + own  # identity + placement + the counter file itself

    s = ObjectStore(cfg, GEOM, IDENT)
    assert (kinds(s) == 0).all()  # a new session: metadata exists, nothing written yet
    for d, dev in enumerate(s.wear()["devices"]):
        life = dev["lifetime"]
        c = read_counters(files[d])
        assert life["physical_bytes"] == sum(c[k] for k in ("payload", "header", "tombstone", "meta"))
        assert life["logical_bytes"] == c["logical"] and life["since"] == c["since"]
    src = Pages(3, seed=2)
    assert s.write_pages(keys(3, "z"), src.addrs, True).all()
    second = kinds(s)
    before = [read_counters(p) for p in files]
    s.close()
    for d, path in enumerate(files):
        c = read_counters(path)
        assert c["payload"] == before[d]["payload"] + second[d, 0]
        assert c["logical"] == before[d]["logical"] + second[d, 4]
        assert c["meta"] == before[d]["meta"] + os.path.getsize(path)
    assert sum(read_counters(p)["logical"] for p in files) == 8 * PAGE


def test_a_damaged_counter_file_is_reset_with_a_warning(tmp_path, caplog):
    cfg = cfg_for([tmp_path], slots=16)
    s = ObjectStore(cfg, GEOM, IDENT)
    src = Pages(2, seed=1)
    assert s.write_pages(keys(2), src.addrs, True).all()
    s.close()
    path = os.path.join(s.ns_dirs[0], FILE_NAME)
    with open(path, "w") as f:
        f.write('{"format": 1, "payload": -5')
    with caplog.at_level(logging.WARNING, logger="tutti_hicache.store"):
        s = ObjectStore(cfg, GEOM, IDENT)  # attach goes on
    assert "wear counters" in caplog.text and "damaged" in caplog.text
    assert s.prefix_len(keys(2)) == 2
    assert s.wear()["devices"][0]["lifetime"]["physical_bytes"] == 0
    src = Pages(1, seed=3)
    assert s.write_pages(keys(1, "n"), src.addrs, True).all()
    s.close()
    c = read_counters(path)  # valid again, counting from the reset
    assert c["payload"] == PAGE and c["logical"] == PAGE and c["tombstone"] == 0


def test_processes_sharing_a_namespace_add_up_in_one_file(tmp_path):
    """Two counters on the same directories (as two processes' stores): every flush adds its
    delta under the directory flock, none overwrites the other's."""
    ns = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in ns:
        os.mkdir(d)
    dirs_of = lambda files: np.asarray(files) % 2  # noqa: E731 (handle i in directory i % 2)
    one, two = Wear(ns, dirs_of), Wear(ns, dirs_of)
    one.wrote("payload", np.array([0, 1, 0]), np.array([100, 200, 300]))
    two.wrote("header", np.array([1]), np.array([4096]))
    two.wrote("tombstone", np.array([0, 1]), np.array([4096, -5]))  # a failed request counts 0
    size = lambda d: os.path.getsize(os.path.join(ns[d], FILE_NAME))  # noqa: E731
    assert one.flush()
    written = [size(0), size(1)]
    assert two.flush()
    written = [written[0] + size(0), written[1] + size(1)]
    one.wrote("payload", np.array([1]), np.array([7]))
    assert one.flush()  # only directory b has new bytes
    written[1] += size(1)
    a, b = (read_counters(os.path.join(d, FILE_NAME)) for d in ns)
    assert (a["payload"], a["header"], a["tombstone"], a["meta"]) == (400, 0, 4096, written[0])
    assert (b["payload"], b["header"], b["tombstone"], b["meta"]) == (207, 4096, 0, written[1])


def test_concurrent_writers_count_exactly(tmp_path):
    dirs = two_dirs(tmp_path)
    s = ObjectStore(cfg_for(dirs, slots=256), GEOM, IDENT)
    base = kinds(s)
    n_threads, batches, per = 4, 6, 5
    errors = []

    def writer(t):
        try:
            for b in range(batches):
                src = Pages(per, seed=t * 100 + b)
                assert s.write_pages([f"t{t}b{b}i{i}" for i in range(per)], src.addrs, True).all()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    run_threads(writer, n_threads)
    assert not errors
    want = base.copy()
    for k in s.entries():
        want[device_of(s, k, dirs)] += [PAGE, HEADER_NBYTES, 0, 0, PAGE]
    assert len(s) == n_threads * batches * per
    assert (kinds(s) == want).all()
    s.close()


def test_unit_counter_is_exact_under_threads(tmp_path):
    w = Wear([str(tmp_path)], lambda files: np.zeros(len(files), dtype=np.int64))
    files, res = np.zeros(64, dtype=np.int64), np.full(64 * 3, 4096, dtype=np.int32)

    def hammer(_):
        for _ in range(500):
            w.wrote("payload", files, res)

    run_threads(hammer, 4)
    assert w.snapshot()["devices"][0]["payload_bytes"] == 4 * 500 * 64 * 3 * 4096


def test_a_failed_flush_keeps_its_bytes_for_the_next(tmp_path, caplog):
    ns = tmp_path / "ns"
    w = Wear([str(ns)], lambda files: np.zeros(len(files), dtype=np.int64))
    w.wrote("payload", np.array([0, 0]), np.array([4096, 8192]))
    with caplog.at_level(logging.WARNING, logger="tutti_hicache.store"):
        assert not w.flush()  # the namespace directory is gone: nothing written, nothing lost
    assert "cannot write the wear counters" in caplog.text
    assert w.snapshot()["devices"][0]["lifetime"]["payload_bytes"] == 12288
    ns.mkdir()
    w.wrote("header", np.array([0]), np.array([4096]))
    assert w.flush()
    c = read_counters(str(ns / FILE_NAME))
    assert (c["payload"], c["header"], c["meta"]) == (12288, 4096, os.path.getsize(ns / FILE_NAME))
    assert os.listdir(ns) == [FILE_NAME]  # no temporary file left


def test_a_counting_error_never_fails_the_write(tmp_path, caplog):
    def broken(files):
        raise IndexError("no such handle")

    w = Wear([str(tmp_path)], broken)
    with caplog.at_level(logging.ERROR, logger="tutti_hicache.store"):
        w.wrote("header", np.array([3]), np.array([4096]))  # does not raise
    assert "cannot count" in caplog.text
    assert w.snapshot()["physical_bytes"] == 0


def test_drive_writes_per_day_at_the_measured_rate(tmp_path):
    s = ObjectStore(cfg_for([tmp_path], slots=16, tutti_drive_capacity_gb=0.5), GEOM, IDENT)
    src = Pages(4, seed=1)
    assert s.write_pages(keys(4), src.addrs, True).all()
    dev = s.wear()["devices"][0]
    assert dev["capacity_bytes"] == 500_000_000
    assert dev["drive_writes_per_day"] == pytest.approx(
        dev["physical_bytes"] / 5e8 * 86400 / dev["seconds"], rel=1e-3)
    s.close()
    s = ObjectStore(cfg_for([tmp_path], slots=16), GEOM, IDENT)  # statvfs of the directory
    st = os.statvfs(tmp_path)
    assert s.wear()["devices"][0]["capacity_bytes"] == st.f_blocks * st.f_frsize
    s.close()


def test_inspect_fsck_and_cost_print_the_wear(tmp_path, capsys, monkeypatch):
    from tutti_hicache import cli
    cfg = cfg_for([tmp_path], slots=16)
    s = ObjectStore(cfg, GEOM, IDENT)
    ks = keys(4)
    src = Pages(4, seed=1)
    assert s.write_pages(ks, src.addrs, True).all()
    path, off = s.locate(ks[1])
    stats = s.stats()
    s.close()
    c = read_counters(os.path.join(s.ns_dirs[0], FILE_NAME))
    assert main(["inspect", str(tmp_path)]) == 0  # seconds of counting: no projection
    out = capsys.readouterr().out
    assert "too little history to project drive writes per day" in out
    assert "drive writes per day of" not in out and "years" not in out
    monkeypatch.setattr(cli, "MIN_HISTORY_S", 0)
    assert main(["inspect", str(tmp_path), "--drive-capacity-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert f"payload {4 * PAGE} B, header {4 * HEADER_NBYTES} B, tombstone 0 B, meta {c['meta']} B" in out
    assert "drive writes per day of 1.000 TB" not in out and "drive writes per day of 0.001 TB" in out
    assert f"drive {tmp_path}:" in out

    with open(path, "r+b") as f:  # fsck --repair tombstones the bad slot: counted too
        f.seek(off + HEADER_NBYTES + 3)
        f.write(b"\xff\x00")
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert read_counters(os.path.join(s.ns_dirs[0], FILE_NAME))["tombstone"] == HEADER_NBYTES

    stats_path = tmp_path / "stats.json"
    stats_path.write_text(json.dumps(stats))
    assert main(["cost", "--throughput", "1000", "--stats", str(stats_path)]) == 0
    out = capsys.readouterr().out
    rate = stats["wear"]["physical_bytes"] / stats["wear"]["seconds"]
    gb_per_mtok = rate / 1000 * 1e6 / 1e9
    assert "wear $/1M" in out and "$0.0571 per TB written" in out
    assert f"{gb_per_mtok:.3f}" in out.splitlines()[-1]


def test_cost_from_a_prefill_run_adds_the_wear_term(capsys):
    from tutti_hicache.cost import Endurance, format_write_amplification, prefill_geometry
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results",
                        "prefill_layerwise_array4_h200.json")
    with open(path) as f:
        r = json.load(f)
    assert main(["cost", "--from-json", path, "--ssd-dwpd", "3", "--ssd-drives", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    geo = prefill_geometry(r["shape"])
    x = next(x for m in r["media"].values() for x in m["runs"])
    written = 1e6 * (1 - x["h"]) * geo.page_nbytes / geo.page_size * format_write_amplification(geo)
    wear = written / (3 * 7.68e12 * 365 * 5) * 800
    assert wear == pytest.approx(Endurance(dwpd=3).per_million(written))
    row = next(ln for ln in lines if ln.startswith(x["config"]) and f" {x['C']} " in ln)
    dwpd = written * x["C"] / x["ttft_s"] / 1e6 * 86400 / (4 * 7.68e12)  # sustained, per drive
    assert f"{written / 1e9:.3f}" in row and f"{wear:.4f}" in row and f" {dwpd:.2f} " in row
    assert lines[0].startswith("assumed: $5/h per GPU") and "rated 3 DWPD for 5 years" in lines[1]
    assert all(ln.split()[-2] == "0.0000" for ln in lines if ln.startswith(("recompute", "dram")))
