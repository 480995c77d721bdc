"""Damage to the files of a running store, and to files it reads at attach, that used to cost
writers their rows, re-scans their reach, or the store its capacity (never bytes: every case
here also reads back exactly what it wrote). Real stores on temp directories; two stores in one
process are two writers (each registers its own writers/ file).

- a live writer's writers/ file removed: that writer no longer counted itself nor was counted,
  kept every row, and a second writer got none (every write it made failed);
- a segment file of another process's row replaced by a directory: every re-scan aborted there,
  so the process learned no other process's new pages in any row;
- a row whose files could not be sized after they were locked stayed owned and unscanned (its
  slots lost, no other process could take it);
- a segment file that cannot be opened stopped growth at its row: the rows after it were never
  made;
- the writers/ directory unreadable: every write failed;
- a placement.json whose "check" key lost a bit switched its own check off;
- a wear.json count of 2**63 or more made the attach raise."""

import errno
import json
import os
import time

import numpy as np
import pytest

from tutti_hicache.store import ObjectStore
from tutti_hicache.store.repair import heal
from tutti_hicache.store.wear import read_counters

from test_store import GEOM, IDENT, Pages, cfg_for, keys


def _ns(d):
    (name,) = [n for n in os.listdir(d) if n.startswith("tutti-") and os.path.isdir(os.path.join(d, n))]
    return os.path.join(d, name)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _dump(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f)


def _write(s, ks, seed=1):
    src = Pages(len(ks), seed=seed)
    return s.write_pages(ks, src.addrs, True), src


def test_a_writer_whose_registry_file_was_removed_still_counts_and_shares_rows(tmp_path):
    a = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)  # 64 slots in rows of 28: 3 rows
    b = None
    try:
        ok, _ = _write(a, keys(56, "a"))
        assert ok.all() and len(a.owned_rows()) >= 2
        w = os.path.join(_ns(tmp_path), "writers")
        for f in os.listdir(w):
            os.unlink(os.path.join(w, f))  # the damage: A's entry gone while A runs
        a.rebalance()  # A's next count (the re-scan thread's, at most 1 s old): A registers again
        assert len(os.listdir(w)) == 1
        b = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
        a.rebalance()  # A now counts B and hands rows beyond its share (2 of 3) back
        ok, src = _write(b, keys(8, "b"), seed=2)
        assert ok.all(), "the second writer got no row"  # the row A gave back: its 8 slots
        assert b.owned_rows() and not (b.owned_rows() & a.owned_rows())
        back = Pages(8, seed=None)
        assert b.read_pages(keys(8, "b"), back.addrs, True).all()
        assert all((back.page(i) == src.page(i)).all() for i in range(8))
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_segment_file_turned_directory_does_not_stop_rescans_of_other_rows(tmp_path):
    kw = {"tutti_capacity_gb": 200 * 36864 / 2**30}
    reader = ObjectStore(cfg_for([tmp_path], **kw), GEOM, IDENT, writer=False)
    w = ObjectStore(cfg_for([tmp_path], **kw), GEOM, IDENT)
    try:
        assert _write(w, keys(100, "y"))[0].all()  # rows 0..3
        ns = _ns(tmp_path)
        victim = os.path.join(ns, max(f for f in os.listdir(ns) if f.startswith("seg-")))
        assert victim not in reader.files().values()
        os.unlink(victim)
        os.mkdir(victim)
        reader.rescan()
        seen = int(reader.present(keys(100, "y")).sum())
        assert seen >= 100 - 28, f"the reader learned {seen} of the 100 pages"  # all but that row
    finally:
        w.close()
        reader.close()


def test_a_row_whose_files_cannot_be_sized_is_given_back(tmp_path, monkeypatch):
    from tutti_hicache.store.namespace import Namespace
    real, failed = Namespace.fit_row, []

    def fit(self, row):
        if row == 1 and not failed:
            failed.append(row)
            raise OSError(errno.ENOSPC, "injected")
        return real(self, row)
    monkeypatch.setattr(Namespace, "fit_row", fit)
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    try:
        assert _write(s, keys(20, "a"))[0].all()  # row 0; growing row 1 ahead fails
        end = time.monotonic() + 10
        while not failed and time.monotonic() < end:
            time.sleep(0.01)
        assert failed and 1 not in s.owned_rows()  # given back, not held unscanned
        s._rows._growth_retry_at = 0.0  # the growth retry's 10 s, passed
        assert _write(s, keys(40, "c"), seed=3)[0].all()
        assert 1 in s.owned_rows() and len(s) > 28  # row 1's slots serve (held unscanned: 28 at most)
    finally:
        s.close()


def test_a_segment_file_that_cannot_be_opened_does_not_stop_growth_past_its_row(tmp_path):
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    assert _write(s, keys(30, "a"))[0].all()  # rows 0 and 1
    s.close()
    ns = _ns(tmp_path)
    seg1 = sorted(f for f in os.listdir(ns) if f.startswith("seg-"))[1]
    os.unlink(os.path.join(ns, seg1))
    os.mkdir(os.path.join(ns, seg1))  # row 1 cannot be opened (as a file without permission)
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    try:
        ok, _ = _write(s, keys(30, "b"))
        assert ok.sum() >= 30 - 28 + 8 and 2 in s.owned_rows(), "growth stopped at the row it cannot open"
    finally:
        s.close()


def test_an_unlistable_writer_registry_costs_no_write(tmp_path, monkeypatch):
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    try:
        real = os.listdir
        w = os.path.join(_ns(tmp_path), "writers")
        monkeypatch.setattr(os, "listdir", lambda p=".": (_ for _ in ()).throw(PermissionError(13, "injected"))
                            if str(p) == w else real(p))
        s.rebalance()
        assert _write(s, keys(40, "a"))[0].all()  # growth counts the writers it last saw
    finally:
        monkeypatch.undo()
        s.close()


def test_a_placement_marker_whose_check_key_lost_a_bit_reads_as_damaged(tmp_path):
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    s.close()
    ns = _ns(tmp_path)
    path = os.path.join(ns, "placement.json")
    m = _load(path)
    assert heal._marker(ns)[0] is not None
    m["bheck"] = m.pop("check")
    _dump(m, path)
    assert heal._marker(ns) == (None, "lacks its check")
    for k in ("check", "configured"):  # a marker of before both: the four numbers alone
        m.pop(k, None)
    m.pop("bheck")
    _dump(m, path)
    assert heal._marker(ns)[0] is not None


def test_a_wear_count_beyond_int64_is_damage_not_an_attach_error(tmp_path):
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    assert _write(s, keys(8))[0].all()
    s.close()
    path = os.path.join(_ns(tmp_path), "wear.json")
    w = _load(path)
    w["payload"] = 2 ** 63
    _dump(w, path)
    with pytest.raises(ValueError):
        read_counters(path)
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)  # the attach goes on (the counters restart)
    try:
        back = Pages(8, seed=None)
        assert s.read_pages(keys(8), back.addrs, True).all()
    finally:
        s.close()
