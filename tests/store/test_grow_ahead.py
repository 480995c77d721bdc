"""Growth ahead of need: a writer's store claims its next segment row on the grower thread, so a
write that fits in what is free never waits for a create + fallocate + header scan."""

import os
import time

from tutti_hicache.store import ObjectStore

from test_store import GEOM, IDENT, Pages, cfg_for, keys  # 64 slots, rows of 28: 3 rows


def wait_for(pred, timeout=30.0):
    """Poll until pred() (a functional wait for the grower thread, not a timing check)."""
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


def spy_claims(store):
    """Record the `ahead` flag of every row claim from now on: a call that finds the row no
    longer wanted (another thread grew the store while it waited for the lock) claims nothing.
    A writer can make such a call when the grower holds a row but has not sized and scanned it
    yet, so its slots are not free (a slow fallocate made it so)."""
    calls, claim = [], store._rows.claim_next

    def spy(scan, wanted, ahead=False):
        asked = []

        def still_wanted():
            asked.append(wanted())
            return asked[-1]
        out = claim(scan, still_wanted, ahead)
        if asked and asked[0]:
            calls.append(ahead)
        return out
    store._rows.claim_next = spy
    return calls


def test_rows_grow_ahead_and_writes_never_claim_one_themselves(tmp_path):
    s = ObjectStore(cfg_for([tmp_path / "s"]), GEOM, IDENT)
    try:
        assert wait_for(lambda: len(s.owned_rows()) == 1)  # no write yet: the grower's first row
        calls = spy_claims(s)
        src, written = Pages(20, seed=21), []
        for r, rows in ((0, 2), (1, 3), (2, 3)):  # 28 free -> 8 (grow) -> 16 (grow) -> 4
            ks = keys(20, f"g{r}")
            assert s.write_pages(ks, src.addrs, True).all()
            written.append(ks)
            assert wait_for(lambda: len(s.owned_rows()) == rows)
        assert calls and all(calls)  # every claim was the grower's
        assert len(s) == 60 and s.stats()["evictions"] == 0
        dst = Pages(20, seed=None)
        for ks in written:
            assert s.read_pages(ks, dst.addrs, True).all()
            assert all((dst.page(i) == src.page(i)).all() for i in range(20))
    finally:
        s.close()
    assert s._writes._grower is None  # close stopped it


def test_a_write_larger_than_what_is_free_still_grows_for_itself(tmp_path):
    s = ObjectStore(cfg_for([tmp_path / "s"]), GEOM, IDENT)
    try:
        src = Pages(60, seed=22)
        assert s.write_pages(keys(60), src.addrs, True).all()  # all three rows, at once
        assert len(s.owned_rows()) == 3 and len(s) == 60
        dst = Pages(60, seed=None)
        assert s.read_pages(keys(60), dst.addrs, True).all()
        assert all((dst.page(i) == src.page(i)).all() for i in range(60))
    finally:
        s.close()


def test_a_read_only_store_grows_nothing(tmp_path):
    d = tmp_path / "s"
    w = ObjectStore(cfg_for([d]), GEOM, IDENT)
    assert wait_for(lambda: len(w.owned_rows()) == 1)
    ns = w.ns_dirs[0]
    w.close()
    before = sorted(os.listdir(ns))
    r = ObjectStore(cfg_for([d]), GEOM, IDENT, writer=False)
    try:
        time.sleep(0.2)  # room for a (wrong) grower to act; the check below needs no timing
        assert r._writes._grower is None and not r.owned_rows()
        assert sorted(os.listdir(ns)) == before
    finally:
        r.close()


def test_the_grower_does_not_delay_a_writer_waiting_for_a_row_another_process_held(tmp_path):
    """The grower's failed tries on rows another writer holds are its own: a writer that needs
    a row once it is handed over claims it at once (not RETRY_HELD_S later)."""
    dirs = [tmp_path / "s"]
    a = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    src = Pages(16, seed=23)
    for r in range(5):
        assert a.write_pages(keys(16, f"a{r}"), src.addrs, True).all()
    assert len(a.owned_rows()) == a.n_rows
    b = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        assert wait_for(lambda: b._rows._ahead_checked)  # the grower tried a's rows, and failed
        assert not b.owned_rows()
        a.rebalance()
        assert b.write_pages(keys(4, "b"), src.addrs[:4], True).all()
        assert b.owned_rows() and not b.owned_rows() & a.owned_rows()
    finally:
        b.close()
        a.close()


def test_a_growth_that_raises_fails_the_write_and_gives_its_reservations_back(tmp_path):
    """A write larger than what is free grows for itself; when the new row's scan raises (here
    a MemoryError, as the scan's buffer allocation can; also a closed engine), the write is a
    failed result and a log line, and the slots it had reserved go back. Before, the exception
    reached the caller and its keys stayed reserved: every later store of them was
    deduplicated (True) and never findable."""
    s = ObjectStore(cfg_for([tmp_path / "s"]), GEOM, IDENT)
    try:
        assert wait_for(lambda: len(s.owned_rows()) == 1)
        with s._lock:
            free = len(s._index.free)
        real = s._scan.scan_rows

        def flaky(rows, grant=False):
            if grant:
                s._scan.scan_rows = real  # once
                raise MemoryError("injected")
            return real(rows, grant)
        s._scan.scan_rows = flaky
        ks = keys(free + 5, "m")
        src = Pages(free + 5, seed=5)
        assert not s.write_pages(ks, src.addrs, True).any()
        assert not s._index.reserved and s.stats()["dedup_skips"] == 0
        assert s.write_pages(ks[:3], src.addrs[:3], True).all()  # written now, not deduplicated
        assert s.stats()["dedup_skips"] == 0
        back = Pages(3, seed=None)
        assert s.read_pages(ks[:3], back.addrs, True).all()
        assert all((back.page(i) == src.page(i)).all() for i in range(3))
    finally:
        s.close()
