"""Attach heals the store's own files: random damage to every file, and the healing rules.

test_random_damage_to_every_file: a store of 50 pages over two directories is closed, then random
bytes are flipped in EVERY file the store wrote (identity.json and placement.json of both
directories, every segment file, headers and payloads alike, the attach lock, a writer-registry
entry; an empty file gets random bytes appended; half the JSON flips hit a digit, so the file
stays JSON with another number: another directory count, stripe index or segment size). Attach must succeed; every key is restored and
each page served is compared byte for byte (a miss is fine, a wrong byte fails); new pages must
round-trip. Seeded (TUTTI_HEAL_SEED), TUTTI_HEAL_TRIALS trials; failures print the flips.
The rest pin single rules: markers map reordered directories, a recorded segment size is kept,
quarantines are reclaimed, fsck and inspect show them.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

from test_corruption import GEOM, IDENT, SLOT, assert_new_pages_round_trip, cfg_for, keys_of, \
    read_all, write
from tutti_hicache.cli import main as cli_main
from tutti_hicache.store.repair.heal import quarantines
from tutti_hicache.store import ObjectStore
from tutti_hicache.testing import damage

SEED = int(os.environ.get("TUTTI_HEAL_SEED", "1515"))
TRIALS = int(os.environ.get("TUTTI_HEAL_TRIALS", "12"))


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_damage_to_every_file(tmp_path, trial):
    rng = random.Random(f"{SEED}-{trial}")
    dirs = [tmp_path / "a", tmp_path / "b"]
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    ks = keys_of(50)
    write(s, ks)
    ns0 = s.ns_dirs[0]
    s.close()
    Path(ns0, "writers", "777.1.lock").write_bytes(b"")  # what a killed writer leaves behind
    log = damage.damage_every_file(rng, dirs, SLOT)
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)  # must not raise, whatever was flipped
    try:
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, ks)
        assert not wrong, (SEED, trial, wrong, log)
        assert_new_pages_round_trip(s)
    finally:
        s.close()
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)  # and the healed store attaches again
    try:
        ok2, wrong = read_all(s, keys_of(40, "new"))
        assert ok2.all() and not wrong, (SEED, trial, log)
    finally:
        s.close()


def test_reordered_dirs_keep_their_stripes_and_their_markers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    write(s, keys_of(30))
    before = {k: s.locate(k) for k in keys_of(30)}
    s.close()
    s = ObjectStore(cfg_for([b, a]), GEOM, IDENT)
    try:
        assert {k: s.locate(k) for k in keys_of(30)} == before  # same files, same offsets
        ok, wrong = read_all(s, keys_of(30))
        assert ok.all() and not wrong
    finally:
        s.close()
    with open(os.path.join(before[keys_of(1)[0]][0].rsplit("/", 1)[0], "placement.json")) as f:
        assert json.load(f)["n_dirs"] == 2


def test_recorded_segment_size_wins(tmp_path):
    s = ObjectStore(cfg_for([tmp_path]), GEOM, IDENT)
    write(s, keys_of(40))
    sps = s.placement.slots_per_segment
    s.close()
    s = ObjectStore(cfg_for([tmp_path], tutti_segment_gb=4 / 1024), GEOM, IDENT)
    try:
        assert s.placement.slots_per_segment == sps
        ok, wrong = read_all(s, keys_of(40))
        assert ok.all() and not wrong
    finally:
        s.close()


def test_concurrent_attaches_quarantine_once(tmp_path):
    """MLA ranks attach together: one of them sets the namespace aside, the others see it healed."""
    import threading
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    write(s, keys_of(20))
    s.close()
    stores, errors = [], []

    def attach(writer):
        try:
            stores.append(ObjectStore(cfg_for([a, b, c]), GEOM, IDENT, writer=writer))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=attach, args=(i == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        assert sum(len(st.quarantined) for st in stores) == 2  # once per old directory, not 4x
        write(stores[[st.writer for st in stores].index(True)], keys_of(10, "after"))
    finally:
        for st in stores:
            st.close()


def test_fsck_and_inspect_list_quarantines(tmp_path, capsys, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    write(s, keys_of(20))
    s.close()
    caplog.set_level(logging.WARNING)
    s = ObjectStore(cfg_for([a]), GEOM, IDENT, writer=False)  # a reader does not re-home
    s.close()
    [msg] = [r.getMessage() for r in caplog.records if r.name.startswith("tutti_hicache")]
    assert "written over 2 directories" in msg and "set aside" in msg
    capsys.readouterr()
    assert cli_main(["fsck", str(a)]) == 0
    out = capsys.readouterr().out
    assert out.count("quarantined:") == 1 and "written over 2 directories" in out
    assert cli_main(["inspect", str(a)]) == 0
    assert "quarantined:" in capsys.readouterr().out
    s = ObjectStore(cfg_for([a]), GEOM, IDENT)  # a writer re-homes a's pages, then deletes it
    try:
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, keys_of(20))
        assert not wrong and ok.sum() == 10 and not quarantines([a])  # a held slots 0, 2, ...
    finally:
        s.close()


def test_fsck_reports_damaged_metadata_that_attach_then_heals(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    write(s, keys_of(20))
    ns = s.ns_dirs
    s.close()
    damage.flip(os.path.join(ns[0], "placement.json"), 0)  # no longer JSON
    capsys.readouterr()
    assert cli_main(["fsck", str(a), str(b)]) == 1  # reported, without a traceback
    out = capsys.readouterr().out  # the pages are checked where attach finds them (headers)
    assert "20 pages checked, 0 bad payloads" in out
    assert f"metadata: {ns[0]}/placement.json damaged" in out and "attach rebuilds it" in out
    ObjectStore(cfg_for([a, b]), GEOM, IDENT).close()  # attach rebuilds it
    assert cli_main(["fsck", str(a), str(b)]) == 0
    assert "20 pages checked, 0 bad payloads, 0 unreadable headers" in capsys.readouterr().out


def test_rehoming_never_launders_a_damaged_page(tmp_path):
    """A set-aside page is re-written only when its payload matches its header's checksum:
    re-writing computes a new checksum, so a damaged page re-homed would be served as good."""
    rng = random.Random(f"{SEED}-launder")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    ks = keys_of(30)
    write(s, ks)
    bad = rng.sample(ks, 8)
    for k in bad:
        path, off = s.locate(k)
        damage.flip(path, off + int(s.layout.object_offsets[rng.randrange(8)]) + rng.randrange(4096),
                    rng.randrange(8))
    s.close()
    s = ObjectStore(cfg_for([a, b, c], tutti_verify=False), GEOM, IDENT)  # a dir appended
    try:
        assert s.quarantined and s.rehome_wait(60)
        assert s.stats()["rehomed_pages"] == 22
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.tolist() == [k not in bad for k in ks]
    finally:
        s.close()


def test_reclaim_deletes_quarantined_segments_newest_first(tmp_path):
    """With nobody re-homing it (a reader set it aside), a quarantine yields to the capacity."""
    from tutti_hicache.store.repair.heal import reclaim
    a, b = tmp_path / "a", tmp_path / "b"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    write(s, keys_of(60))  # rows 0, 1 and 2 in both directories
    s.close()
    s = ObjectStore(cfg_for([a]), GEOM, IDENT, writer=False)
    ns = s.ns_dirs
    s.close()
    [qa] = [q for q, _, _ in quarantines([a])]
    segs = sorted(f for f in os.listdir(qa) if f.endswith(".dat"))
    size = os.path.getsize(os.path.join(qa, segs[-1]))
    assert reclaim(ns, 0, 10**12) == 0  # within the capacity: nothing to do
    assert reclaim(ns, 1, sum(os.path.getsize(os.path.join(qa, f)) for f in segs)) == size
    assert sorted(f for f in os.listdir(qa) if f.endswith(".dat")) == segs[:-1]  # the newest
    assert reclaim(ns, 1, 0) > 0 and not quarantines([a])  # all of it, and the directory


def test_growth_ahead_never_deletes_what_re_homing_has_not_read(tmp_path, monkeypatch):
    """The grower thread grows ahead of need, so it may not make room by deleting quarantined
    segment files (heal.reclaim): at open it can run before the re-homing thread holds its flock,
    when reclaim grants no slack, and the pages in those files would be lost (seen once in a CI
    run: 12 of 24 pages re-homed). Only a write that needs the row may reclaim."""
    from tutti_hicache.store import objectstore as store_mod
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    ks = keys_of(60)  # the whole capacity: growing a row now needs room
    write(s, ks)
    s.close()
    held, real_start = [], store_mod.Rehome.start
    monkeypatch.setattr(store_mod.Rehome, "start", lambda self: held.append(self) or self)
    s = ObjectStore(cfg_for([a, b, c]), GEOM, IDENT)  # a dir appended: the namespace set aside
    try:
        assert s.quarantined and len(held) == 1  # re-homing not started yet
        files = lambda: sorted(f for q, _, _ in quarantines([a, b]) for f in os.listdir(q))
        before = files()
        w = s._writes
        assert not s._rows.claim_next(w._claimed, lambda: True, ahead=True)  # the grower's ask
        w.stop()  # and the grower's own try at open, if it ran
        assert files() == before and not s.owned_rows()
        real_start(held[0])
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.all()
    finally:
        s.close()


def test_quarantines_are_held_for_re_homing_before_the_attach_returns(tmp_path, monkeypatch):
    """Rehome.start takes every quarantine's flock before it returns, so a write that grows the
    store right after the attach already sees them being re-homed (heal.reclaim then keeps a
    row of slack instead of deleting their unread files)."""
    import threading

    from tutti_hicache.store.repair import rehome as rehome_mod
    from tutti_hicache.store.repair.heal import _rehoming
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    ks = keys_of(40)
    write(s, ks)
    s.close()
    go, real_run = threading.Event(), rehome_mod.Rehome._run

    def held_run(self):
        go.wait(60)
        real_run(self)
    monkeypatch.setattr(rehome_mod.Rehome, "_run", held_run)
    s = ObjectStore(cfg_for([a, b, c]), GEOM, IDENT)  # a dir appended: both old dirs set aside
    try:
        qs = [q for q, _, _ in quarantines([a, b])]
        assert len(qs) == 2 and all(_rehoming(q) for q in qs)  # the thread has not run yet
        go.set()
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.all() and not quarantines([a, b])
    finally:
        go.set()
        s.close()


def test_re_homing_stopped_part_way_loses_nothing_and_resumes(tmp_path, monkeypatch):
    """close() stops the re-homing in the middle of a set-aside segment file: that file stays
    (it was deleted with its unread pages), and the attach after the restart deletes no set-aside
    file the re-homing still has to read (it reclaimed before the re-homing held its flocks);
    that attach's re-homing then brings every page back, byte-exact."""
    from tutti_hicache.store.repair import rehome as rehome_mod
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    ks = keys_of(60)  # the whole capacity
    write(s, ks)
    s.close()
    monkeypatch.setattr(rehome_mod, "CHUNK", 4)  # several reads per segment file
    real_chunk, stopper = rehome_mod.Rehome._chunk, []

    def chunk_then_stop(self, buf, arr, n):
        done = real_chunk(self, buf, arr, n)
        if stopper:
            self._stop.set()  # close() while this file is half read
        return done
    monkeypatch.setattr(rehome_mod.Rehome, "_chunk", chunk_then_stop)
    stopper.append(True)
    s = ObjectStore(cfg_for([a, b, c]), GEOM, IDENT)  # a dir appended: the namespace set aside
    assert s.rehome_wait(60)
    s.close()
    left = [f for q, _, _ in quarantines([a, b]) for f in os.listdir(q) if f.endswith(".dat")]
    assert left, "the re-homing was to stop part-way"
    stopper.clear()
    s = ObjectStore(cfg_for([a, b, c]), GEOM, IDENT)  # the restart
    try:
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.all(), f"{int((~ok).sum())} of {len(ks)} pages lost"
    finally:
        s.close()


def test_re_homing_tries_again_the_pages_a_write_refused(tmp_path, monkeypatch):
    """A write refuses a page when no slot can be reserved for it at that moment (every slot
    pinned by reads or held by writes in flight). The set-aside file holds the only copy and is
    deleted once read, so re-homing tries those pages again instead of losing them (it lost
    every refused page before)."""
    from tutti_hicache.store import writes as writes_mod
    from tutti_hicache.store.repair import rehome as rehome_mod
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    s = ObjectStore(cfg_for([a, b]), GEOM, IDENT)
    ks = keys_of(40)
    write(s, ks)
    s.close()
    monkeypatch.setattr(rehome_mod, "RETRIES", (0.01, 0.01))
    real, calls = writes_mod.Writes.write_pages, []

    def refuse_half_at_first(self, keys, addrs, aligned):
        calls.append(len(keys))
        if len(calls) > 1:
            return real(self, keys, addrs, aligned)
        ok = real(self, keys[: len(keys) // 2], addrs[: len(keys) // 2], aligned)
        return np.concatenate([ok, np.zeros(len(keys) - len(ok), dtype=bool)])
    monkeypatch.setattr(writes_mod.Writes, "write_pages", refuse_half_at_first)
    s = ObjectStore(cfg_for([a, b, c]), GEOM, IDENT)  # a dir appended: the namespace set aside
    try:
        assert s.quarantined and s.rehome_wait(60)
        ok, wrong = read_all(s, ks)
        assert not wrong and ok.all(), f"{int((~ok).sum())} of {len(ks)} pages lost"
        assert s.stats()["rehome_refused"] == 0 and len(calls) > 1
    finally:
        s.close()
