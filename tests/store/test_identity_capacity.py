"""Identity isolation, the capacity bound, ENOSPC, bad input, file modes.

Through TuttiStorage and real SGLang host pools (CPU), like SGLang's storage threads call it:
  - a store written under one identity (geometry, dtype, host layout, tutti_revision, MHA tp
    rank, model) serves no page to another identity in the same directories, and the two never
    disturb each other; identities that must share (layer_first/page_first_direct, MLA ranks) do;
  - the *.dat files never exceed tutti_capacity_gb under churn of 5x the capacity, shrink when
    the capacity does, and a changed directory list heals (more: tests/sglang/test_heal_sglang.py);
  - ENOSPC (a tiny tmpfs, root only) and the free-space floor stop growth cleanly;
  - bad keys and host indices are a clean miss (bad settings: unit/test_config.py);
  - files are 0600, directories 0700, and nothing is written outside the store directories
    (not in their parent, the working directory or the temporary directory).
Page bytes are a function of the key (page_content), so every read is compared byte for byte.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile

import pytest

from tutti_hicache.testing.pagedata import fill_host_pages, page_content

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.sglang

PAGE = 16
MiB = 1 << 20




def make_pool(h, layout="layer_first", layers=2, heads=2, head_dim=64, page=PAGE,
              dtype=None, n_pages=40, kind="mha"):
    dtype = dtype or torch.bfloat16
    if kind == "mla":
        return h.make_mla_host_pool(layout, layers, 32, 16, page, dtype, n_pages)
    return h.make_mha_host_pool(layout, layers, heads, head_dim, page, dtype, n_pages)


def storage(h, dirs, pool=None, tp=(0, 1), model="ident-test", kind="mha", **extra):
    from tutti_hicache.storage import TuttiStorage
    cfg = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": 0.05,
           "tutti_segment_gb": 1 / 1024, "tutti_rescan_interval_s": 0.0, **extra}
    sc = h.make_storage_config(tp_rank=tp[0], tp_size=tp[1], is_mla=kind == "mla",
                               model_name=model, extra_config=cfg)
    st = TuttiStorage(sc, {})
    if pool is not None:
        st.register_mem_pool_host(pool)
    return st


def fill(pool, idx, keys):
    fill_host_pages(pool, idx, keys, PAGE)


def wrong_pages(h, pool, idx, keys, ok):
    """Keys read as True whose bytes are not page_content(key)."""
    tmpl = pool.get_dummy_flat_data_page()
    nbytes = tmpl.numel() * tmpl.element_size()
    got = h.page_bytes(pool, idx[:len(keys) * PAGE])
    return [k for k, g, good in zip(keys, got, ok) if good and g != page_content(k, nbytes).tobytes()]


def object_bytes(st, idx, n):
    """The bytes of every object of n pages, in on-disk order (comparable across layouts)."""
    addrs = st.hostmap.page_addresses(idx[:n * PAGE], n)
    return [b"".join(ctypes.string_at(int(a), int(b)) for a, b in zip(row, st.hostmap.object_nbytes))
            for row in addrs]


def keys_of(n, tag):
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def dat_bytes(dirs):
    return sum(os.path.getsize(os.path.join(r, f)) for d in dirs for r, _, fs in os.walk(d)
               for f in fs if f.endswith(".dat"))


def dat_blocks(dirs):
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for d in dirs
               for r, _, fs in os.walk(d) for f in fs if f.endswith(".dat"))


# ----------------------------------------------------------------------------- identities
BASE = dict(layout="layer_first", layers=2, heads=2, head_dim=64, page=PAGE, dtype="bfloat16")
OTHERS = {  # name: (pool changes, storage changes)
    "layers": ({"layers": 3}, {}),
    "heads": ({"heads": 4}, {}),
    "head_dim": ({"head_dim": 128}, {}),
    "page_size": ({"page": 32}, {}),
    "dtype_fp16": ({"dtype": "float16"}, {}),  # same bytes per element, different numbers
    "layout_page_first": ({"layout": "page_first"}, {}),
    "layout_page_head": ({"layout": "page_head"}, {}),
    "revision": ({}, {"tutti_revision": "weights-v2"}),
    "tp_rank": ({}, {"tp": (1, 2)}),
    "tp_size": ({}, {"tp": (0, 2)}),
    "model": ({}, {"model": "another-model"}),
}


def _pool_of(h, spec, n_pages=40):
    s = dict(BASE, **spec)
    return make_pool(h, s["layout"], s["layers"], s["heads"], s["head_dim"], s["page"],
                     getattr(torch, s["dtype"]), n_pages)


@pytest.mark.parametrize("other", sorted(OTHERS))
def test_another_identity_serves_nothing(sglang, tmp_path, other):
    h = sglang
    dirs = [tmp_path / "s"]
    pool_spec, st_spec = OTHERS[other]
    ks = keys_of(8, "shared-key")  # the same keys: only the identity differs
    pool = _pool_of(h, {})
    st = storage(h, dirs, pool)
    idx = pool.alloc(8 * PAGE)
    fill(pool, idx, ks)
    assert all(st.batch_set_v1(ks, idx))
    fp = st.store.fingerprint
    st.close()

    page = dict(BASE, **pool_spec)["page"]
    opool = _pool_of(h, pool_spec)
    ost = storage(h, dirs, opool, **{k: v for k, v in st_spec.items() if k in ("tp", "model")},
                  **{k: v for k, v in st_spec.items() if k.startswith("tutti_")})
    assert ost.store.fingerprint != fp
    oidx = opool.alloc(8 * page)
    assert ost.batch_exists(ks) == 0
    assert ost.batch_get_v1(ks, oidx) == [False] * 8
    # the other identity stores its own pages under the same keys ...
    tmpl = opool.get_dummy_flat_data_page()
    for i, k in enumerate(ks):
        raw = torch.from_numpy(page_content("other-" + k, tmpl.numel() * tmpl.element_size()).copy())
        opool.set_from_flat_data_page(int(oidx[i * page]), raw.view(tmpl.dtype))
    assert all(ost.batch_set_v1(ks, oidx))
    ost.close()
    # ... and the first identity still reads exactly its own
    st = storage(h, dirs, pool)
    dst = pool.alloc(8 * PAGE)
    ok = st.batch_get_v1(ks, dst)
    assert all(ok) and not wrong_pages(h, pool, dst, ks, ok)
    st.close()


def test_layer_first_and_page_first_direct_share_pages(sglang, tmp_path):
    """Both hold canonical pages (K, V per layer): one identity, the same object bytes."""
    h = sglang
    ks = keys_of(8, "canon")
    a = _pool_of(h, {})
    sa = storage(h, [tmp_path], a)
    ia = a.alloc(8 * PAGE)
    fill(a, ia, ks)
    assert all(sa.batch_set_v1(ks, ia))
    want = object_bytes(sa, ia, 8)
    fp = sa.store.fingerprint
    sa.close()
    b = _pool_of(h, {"layout": "page_first_direct"})
    sb = storage(h, [tmp_path], b)
    assert sb.store.fingerprint == fp
    ib = b.alloc(8 * PAGE)
    assert all(sb.batch_get_v1(ks, ib))
    assert object_bytes(sb, ib, 8) == want
    sb.close()


def test_mla_ranks_share_and_tp_is_not_part_of_their_identity(sglang, tmp_path):
    h = sglang
    ks = keys_of(6, "mla")
    p0 = make_pool(h, kind="mla")
    s0 = storage(h, [tmp_path], p0, tp=(0, 2), kind="mla")
    i0 = p0.alloc(6 * PAGE)
    fill(p0, i0, ks)
    assert all(s0.batch_set_v1(ks, i0))
    s0.close()
    p1 = make_pool(h, kind="mla")
    s1 = storage(h, [tmp_path], p1, tp=(1, 2), kind="mla")
    i1 = p1.alloc(6 * PAGE)
    ok = s1.batch_get_v1(ks, i1)
    assert all(ok) and not wrong_pages(h, p1, i1, ks, ok)
    s1.close()


# ------------------------------------------------------------------------------- capacity
CAP_GB = 0.002  # 2 MiB + a bit: 104 slots of 20 KiB; 51 slots per 1 MiB segment


def test_capacity_is_never_exceeded_under_churn(sglang, tmp_path):
    h = sglang
    dirs = [tmp_path / "a", tmp_path / "b"]
    cap = int(CAP_GB * 2**30)
    pool = make_pool(h, n_pages=40)
    st = storage(h, dirs, pool, tutti_capacity_gb=CAP_GB)
    slots, slot_nbytes = st.store.capacity_slots, st.store.layout.slot_nbytes
    assert slots == cap // slot_nbytes == 104
    idx = pool.alloc(32 * PAGE)
    written = 0
    for b in range(0, 5 * slots, 32):  # 5x the capacity
        ks = keys_of(32, f"churn{b}")
        fill(pool, idx, ks)
        assert all(st.batch_set_v1(ks, idx))
        written += 32
        assert dat_bytes(dirs) <= cap and dat_blocks(dirs) <= cap
        assert len(st.store) <= slots
    assert written >= 5 * slots
    assert dat_bytes(dirs) == slots * slot_nbytes  # preallocated to exactly the slots that fit
    stats = st.tutti_stats()
    assert stats["pages"] == slots and stats["evictions"] == written - slots
    # what is present reads back exact
    present = sorted(st.store.entries())
    dst = pool.alloc(8 * PAGE)
    for s in range(0, len(present), 8):
        part = present[s:s + 8]
        ok = st.batch_get_v1(part, dst[:len(part) * PAGE])
        assert all(ok) and not wrong_pages(h, pool, dst, part, ok)
    st.close()

    # reopen with less: rows beyond removed, files cut, nothing beyond the cap served
    small = 0.001
    st = storage(h, dirs, pool, tutti_capacity_gb=small)
    n_small = st.store.capacity_slots
    assert n_small == int(small * 2**30) // slot_nbytes == 52
    assert dat_bytes(dirs) == n_small * slot_nbytes
    assert len(st.store) <= n_small
    assert all(e.slot < n_small for e in st.store.entries().values())
    kept = sorted(st.store.entries())
    assert kept and set(kept) <= set(present)
    for s in range(0, len(kept), 8):
        part = kept[s:s + 8]
        ok = st.batch_get_v1(part, dst[:len(part) * PAGE])
        assert all(ok) and not wrong_pages(h, pool, dst, part, ok)
    for b in range(0, 3 * n_small, 32):
        ks = keys_of(32, f"small{b}")
        fill(pool, idx, ks)
        assert all(st.batch_set_v1(ks, idx))
        assert dat_bytes(dirs) <= int(small * 2**30)
    st.close()

    # and grow back: the files follow, the pages stay
    st = storage(h, dirs, pool, tutti_capacity_gb=CAP_GB)
    assert set(ks) <= set(st.store.entries())
    for b in range(0, 2 * slots, 32):
        ks = keys_of(32, f"grow{b}")
        fill(pool, idx, ks)
        assert all(st.batch_set_v1(ks, idx))
    assert dat_bytes(dirs) == slots * slot_nbytes
    st.close()


@pytest.mark.parametrize("change", ["fewer", "more", "reordered", "segment_size"])
def test_changed_placement_heals(sglang, tmp_path, change):
    """Attach succeeds (tests/sglang/test_heal_sglang.py has every case); going back to the
    original placement afterwards still serves only exact pages."""
    h = sglang
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    pool = make_pool(h, n_pages=8)
    st = storage(h, [a, b], pool)
    idx = pool.alloc(4 * PAGE)
    ks = keys_of(4, "place")
    fill(pool, idx, ks)
    assert all(st.batch_set_v1(ks, idx))
    st.close()
    dirs, extra = {"fewer": ([a], {}), "more": ([a, b, c], {}), "reordered": ([b, a], {}),
                   "segment_size": ([a, b], {"tutti_segment_gb": 2 / 1024})}[change]
    for back, (d, x) in enumerate(((dirs, extra), ([a, b], {}))):
        st = storage(h, d, pool, **x)
        assert st.store.rehome_wait(60)
        ok = st.batch_get_v1(ks, idx)
        assert not wrong_pages(h, pool, idx, ks, ok)
        # "fewer" lost b's pages; going back from "more" loses those re-homed into c
        assert all(ok) or change == "fewer" or (back and change == "more")
        assert any(ok)
        st.close()


# ------------------------------------------------------------------------ ENOSPC, the floor
@pytest.fixture
def tiny_tmpfs(tmpfs):
    """An 8 MiB tmpfs mounted for the test (needs root and mount; skipped otherwise)."""
    return tmpfs("size=8m")


def _free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_enospc_stops_growth_and_writes_go_on_by_eviction(sglang, tiny_tmpfs):
    h = sglang
    dirs = [tiny_tmpfs / "s"]
    pool = make_pool(h, n_pages=40)
    st = storage(h, dirs, pool, tutti_capacity_gb=0.0625)  # 64 MiB cap on an 8 MiB filesystem
    idx = pool.alloc(32 * PAGE)
    results = []
    for b in range(0, 16 * MiB // 20480, 32):  # twice what the filesystem holds
        ks = keys_of(32, f"full{b}")
        fill(pool, idx, ks)
        ok = st.batch_set_v1(ks, idx)
        assert isinstance(ok, list) and len(ok) == 32 and all(isinstance(x, bool) for x in ok)
        results += ok
    assert dat_bytes(dirs) <= 8 * MiB and _free(tiny_tmpfs) < 1 * MiB  # grew until full
    assert all(results[-64:])  # full filesystem: the store evicts within what it has
    present = sorted(st.store.entries())
    assert present and st.tutti_stats()["evictions"] > 0
    for s in range(0, len(present), 32):
        part = present[s:s + 32]
        ok = st.batch_get_v1(part, idx[:len(part) * PAGE])
        assert all(ok) and not wrong_pages(h, pool, idx, part, ok)
    st.close()


def test_no_room_for_one_slot_is_one_warning_and_clean_failures(sglang, tiny_tmpfs, caplog):
    h = sglang
    with open(tiny_tmpfs / "ballast", "wb") as f:  # leave less than one 20 KiB slot free
        f.write(b"\1" * (_free(tiny_tmpfs) - 8 * 1024))
    pool = make_pool(h, n_pages=8)
    st = storage(h, [tiny_tmpfs / "s"], pool, tutti_capacity_gb=0.0625)
    assert [r.getMessage() for r in caplog.records if "no room" in r.getMessage()] == [
        f"tutti: tutti_dirs: no room for one 20 KiB page slot in {tiny_tmpfs / 's'} (8 KiB "
        "free): nothing is stored until space is freed there and the server restarts"]
    idx = pool.alloc(4 * PAGE)
    ks = keys_of(4, "nospace")
    fill(pool, idx, ks)
    assert st.batch_set_v1(ks, idx) == [False] * 4
    assert st.batch_exists(ks) == 0 and st.batch_get_v1(ks, idx) == [False] * 4
    assert st.batch_set_v1(ks, idx) == [False] * 4  # and again: still a clean failure
    st.close()
    assert dat_bytes([tiny_tmpfs / "s"]) == 0


def test_tutti_stats_of_an_empty_store(sglang, tmp_path):
    h = sglang
    st = storage(h, [tmp_path / "s"], make_pool(h, n_pages=8))
    stats = st.tutti_stats()
    st.close()
    assert stats.get("pages") == 0 and "write_failures" in stats


def test_refused_pages_count_as_write_failures(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, n_pages=8)
    st = storage(h, [tmp_path / "s"], pool, tutti_free_space_floor_gb=1e6)
    idx = pool.alloc(2 * PAGE)
    assert st.batch_set_v1(keys_of(2, "x"), idx) == [False, False]
    stats = st.store.stats()
    st.close()
    assert stats["write_failures"] == 2


def test_free_space_floor_stops_growth(sglang, tiny_tmpfs):
    h = sglang
    dirs = [tiny_tmpfs / "s"]
    floor = 5 * MiB
    pool = make_pool(h, n_pages=40)
    st = storage(h, dirs, pool, tutti_capacity_gb=0.0625, tutti_free_space_floor_gb=floor / 2**30)
    idx = pool.alloc(32 * PAGE)
    for b in range(0, 12 * MiB // 20480, 32):
        ks = keys_of(32, f"floor{b}")
        fill(pool, idx, ks)
        assert all(st.batch_set_v1(ks, idx))  # growth stops, eviction takes over
        assert _free(tiny_tmpfs) >= floor
    assert 0 < dat_bytes(dirs) <= 8 * MiB - floor
    assert st.tutti_stats()["evictions"] > 0
    st.close()


def test_a_huge_floor_means_no_store_at_all(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, n_pages=8)
    st = storage(h, [tmp_path / "s"], pool, tutti_free_space_floor_gb=1e6)
    idx = pool.alloc(2 * PAGE)
    ks = keys_of(2, "floor")
    assert st.batch_set_v1(ks, idx) == [False, False]
    assert dat_bytes([tmp_path / "s"]) == 0
    st.close()


# ------------------------------------------------------------------------------ bad input
BAD_KEYS = [None, 5, 3.5, b"bytes-key", "", "x" * 257, "\u00e9" * 129, ("t",), object()]


def test_bad_keys_are_a_clean_miss(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, n_pages=24)
    st = storage(h, [tmp_path], pool)
    good = keys_of(2, "good")
    idx = pool.alloc(2 * PAGE)
    fill(pool, idx, good)
    for bad in BAD_KEYS + [["unhashable"]]:
        for pos in (0, 1):
            ks = list(good)
            ks.insert(pos, bad)
            i3 = pool.alloc(3 * PAGE)
            fill(pool, i3, [k if k in good else "junk" for k in ks])
            ok = st.batch_set_v1(ks, i3)
            assert ok[pos] is False and len(ok) == 3, (bad, ok)
            assert st.batch_exists([bad]) == 0
            got = st.batch_get_v1(ks, i3)
            assert got[pos] is False and len(got) == 3
            pool.free(i3)
    assert all(st.batch_set_v1(good, idx))
    assert st.batch_exists(good + [None]) == 2
    ok = st.batch_get_v1(good, idx)
    assert all(ok) and not wrong_pages(h, pool, idx, good, ok)
    # the longest key that fits (256 bytes of UTF-8) is a key like any other
    edge = ["k" * 256, "\u00e9" * 128]
    i2 = pool.alloc(2 * PAGE)
    fill(pool, i2, edge)
    assert all(st.batch_set_v1(edge, i2))
    st.close()
    st = storage(h, [tmp_path], pool)
    assert st.batch_exists(edge) == 2
    ok = st.batch_get_v1(edge, i2)
    assert all(ok) and not wrong_pages(h, pool, i2, edge, ok)
    st.close()


def test_bad_host_indices_are_a_clean_miss(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, n_pages=8)
    st = storage(h, [tmp_path], pool)
    idx = pool.alloc(2 * PAGE)
    ks = keys_of(2, "idx")
    fill(pool, idx, ks)
    bad = {
        "short": idx[:-1], "long": torch.cat([idx, idx[:PAGE]]), "shifted": idx + 1,
        "outside": idx + 10**6, "negative": idx - 10**6, "2d": idx.view(2, PAGE),
        "reversed_page": torch.cat([idx[:PAGE].flip(0), idx[PAGE:]]),
        "gap_in_page": torch.cat([idx[:PAGE - 1], idx[PAGE:PAGE + 1], idx[PAGE:]]),
        "empty": idx[:0], "none": None, "strings": ["0"] * (2 * PAGE),
    }
    for name, b in bad.items():
        assert st.batch_set_v1(ks, b) == [False, False], name
        assert st.batch_get_v1(ks, b) == [False, False], name
    assert st.batch_set_v1([], idx[:0]) == [] and st.batch_get_v1([], idx[:0]) == []
    assert st.batch_exists([]) == 0
    assert all(st.batch_set_v1(ks, idx))
    ok = st.batch_get_v1(ks, idx)
    assert all(ok) and not wrong_pages(h, pool, idx, ks, ok)
    # the generic (flat page) API: wrong sizes and None are refused, not stored
    assert st.batch_set(ks, [torch.zeros(3), None]) is False
    assert st.batch_get(ks, [torch.zeros(3), None]) == [None, None]
    st.close()


# ------------------------------------------------------------------ file modes, footprint
def _listing(root):
    out = set()
    for r, ds, fs in os.walk(root):
        for n in ds + fs:
            out.add(os.path.relpath(os.path.join(r, n), root))
    return out


def test_private_files_and_nothing_outside_the_store(sglang, tmp_path, monkeypatch):
    h = sglang
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "neighbour.txt").write_text("keep")
    dirs = [parent / "s0", parent / "s1"]
    monkeypatch.chdir(parent)  # a relative write would land here
    tmpdir = tmp_path / "tmpdir"  # and a temporary file here
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    before_parent = _listing(parent)
    old = os.umask(0)  # modes come from the code, not from a friendly umask
    try:
        pool = make_pool(h, n_pages=24)
        for _ in range(2):  # attach, write, read, clear, close; then again on the same dirs
            st = storage(h, dirs, pool, tutti_capacity_gb=0.001)
            idx = pool.alloc(16 * PAGE)
            ks = keys_of(16, "private")
            fill(pool, idx, ks)
            assert all(st.batch_set_v1(ks, idx)) and all(st.batch_get_v1(ks, idx))
            assert st.batch_exists(ks) == 16
            st.get_stats()
            st.clear()
            pool.free(idx)
            st.close()
    finally:
        os.umask(old)
    after = _listing(parent)
    assert {p.split(os.sep)[0] for p in after - before_parent} == {"s0", "s1"}
    assert before_parent <= after and (parent / "neighbour.txt").read_text() == "keep"
    assert not os.listdir(tmpdir)
    for d in dirs:
        assert d.stat().st_mode & 0o777 == 0o700
        for r, ds, fs in os.walk(d):
            for n in ds:
                assert os.stat(os.path.join(r, n)).st_mode & 0o777 == 0o700, n
            for n in fs:
                assert os.stat(os.path.join(r, n)).st_mode & 0o777 == 0o600, n
                assert n in ("identity.json", "placement.json", "wear.json") or (
                    n.startswith("seg-") and n.endswith(".dat")) or (
                    n.startswith("tutti-") and n.endswith(".lock")), n  # the attach lock
