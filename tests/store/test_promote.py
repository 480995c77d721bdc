"""Promotion of remote hits off the read path (promote.py) through a real store on temp dirs:
pages are copied out of the caller's memory before submit() returns (the source may be reused at
once), written byte-exact by the promotion thread, limited by the ring (pages beyond it are not
taken), not taken twice while queued, and the ring wraps and serves concurrent submitters."""

import threading

import numpy as np
import pytest

from tutti_hicache.promote import Promoter, _Ring
from tutti_hicache.store import ObjectStore

from test_store import GEOM, IDENT, Pages, cfg_for, keys

PAGE = GEOM.page_nbytes  # 8 objects of 4 KiB


@pytest.fixture
def store(store_dirs):
    s = ObjectStore(cfg_for(store_dirs), GEOM, IDENT)
    yield s
    s.close()


def promoter(store, pages: int, done=None):
    return Promoter(store, pages * PAGE, GEOM.object_nbytes, threads=2, on_done=done)


def read_back(store, ks):
    dst = Pages(len(ks), seed=None)
    ok = store.read_pages(ks, dst.addrs, True)
    return ok, dst


def test_pages_are_copied_before_submit_returns_and_written_byte_exact(store):
    src, ks = Pages(12, seed=1), keys(12, "p")
    want = [src.page(i).copy() for i in range(12)]
    counts = []
    p = promoter(store, 64, lambda ok, bad: counts.append((ok, bad)))
    assert p.submit(ks, src.addrs).all()
    src.a[:] = 0  # SGLang reuses the host pages as soon as the read call returned
    p.drain()
    ok, dst = read_back(store, ks)
    assert ok.all() and all(np.array_equal(dst.page(i), want[i]) for i in range(12))
    assert counts == [(12, 0)] and p.pending == 0
    p.close()


def test_the_ring_limits_what_is_taken_and_queued_keys_are_not_taken_twice(store):
    src, ks = Pages(10, seed=2), keys(10, "q")
    gate = threading.Event()
    real = store.write_pages
    store.write_pages = lambda *a: (gate.wait(30), real(*a))[1]  # hold the promotion thread
    p = promoter(store, 6)
    assert p.submit(ks, src.addrs).tolist() == [True] * 6 + [False] * 4  # the pages that fit
    assert p.submit(ks[:6], src.addrs[:6]).all()  # queued already: not taken twice
    assert not p.submit(ks[6:], src.addrs[6:]).any()  # the ring is full
    assert p.pending == 6
    gate.set()
    p.drain()
    assert p.pending == 0
    assert read_back(store, ks[:6])[0].all() and not read_back(store, ks[6:])[0].any()
    assert p.submit(ks[6:], src.addrs[6:]).all()  # room again
    p.close()  # close writes what is queued
    assert read_back(store, ks)[0].all()


def test_concurrent_submitters_share_the_ring_and_every_page_lands_exact(store):
    n_threads, per = 4, 10
    srcs = [Pages(per, seed=10 + t) for t in range(n_threads)]
    kss = [keys(per, f"t{t}") for t in range(n_threads)]
    p = promoter(store, 16)  # smaller than the total: submitters retry until taken
    def run(t):
        i = 0
        while i < per:
            q = p.submit(kss[t][i:i + 3], srcs[t].addrs[i:i + 3])
            i += int(np.argmin(q)) if not q.all() else len(q)  # the queued prefix
    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    p.drain()
    for t in range(n_threads):
        ok, dst = read_back(store, kss[t])
        assert ok.all()
        assert all(np.array_equal(dst.page(i), srcs[t].page(i)) for i in range(per))
    p.close()


def test_ring_regions_are_fifo_and_wrap():
    r = _Ring(100)
    assert r.alloc(40) == 0 and r.alloc(40) == 40 and r.free_bytes() == 20
    assert r.alloc(30) is None  # 20 at the end, nothing free at the start
    r.free_oldest()  # [0, 40) free
    assert r.free_bytes() == 40 and r.alloc(30) == 0  # wraps
    assert r.alloc(15) is None and r.free_bytes() == 10 and r.alloc(10) == 30
    r.free_oldest(); r.free_oldest(); r.free_oldest()
    assert r.free_bytes() == 100 and r.alloc(100) == 0 and r.alloc(1) is None
    assert r.alloc(0) is None and _Ring(10).alloc(11) is None
