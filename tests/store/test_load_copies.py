"""A page is read from the SSD once per batch, and a page the previous batch restored is copied
from its slot when no forward ran in between (loader.py): requests on one document that arrive
while its first restore's forward runs. Every case compares every byte of every destination with
what was offloaded; the store's reads are counted through the linker's stats."""

import pytest

from test_layerwise import DEVICES, ENGINES, N, PAGE, forward, make_lw, offload_all, restore

torch = pytest.importorskip("torch")
KEYS = [f"p{i:063d}" for i in range(N)]


def _setup(tmp_path, device="cpu", engine="posix", pages=N, **kw):
    """A pool of N + 1 pages (page 0 unused) whose first `pages` pages are offloaded, a record of
    their bytes per key, and the pool poisoned. No DRAM tier unless asked for: on a GPU one is on
    by default and serves some pages the counts below expect from the SSD."""
    kw.setdefault("tutti_host_gb", 0)
    lw, k, v = make_lw(tmp_path, engine, device, **kw)
    if lw.host is not None:  # on a GPU it pins its memory on a thread: until then it takes nothing
        assert lw.host.online.wait(60)
    rows = torch.arange(PAGE, PAGE * (pages + 1), device=device)
    offload_all(lw, KEYS[:pages], rows)
    want = {key: [t[PAGE * (i + 1):PAGE * (i + 2)].clone() for t in k + v] for i, key in enumerate(KEYS[:pages])}
    for t in k + v:
        t[PAGE:] = -7
    return lw, k, v, want


def _rows(pages, device="cpu"):
    """Pool page ids -> their token rows (what SGLang hands load())."""
    p = torch.as_tensor(pages, dtype=torch.int64, device=device)
    return (p[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)


def _exact(k, v, keys, pages, want) -> bool:
    return all(torch.equal(t[PAGE * p:PAGE * (p + 1)], w)
               for key, p in zip(keys, pages) for t, w in zip(k + v, want[key]))


def _counts(lw):
    """(pages read, pages copied) so far, once every started load has been counted."""
    lw.drain_loads()
    s = lw.stats()["linker"]
    return s["load_pages"], s["load_copied_pages"]


def _batch(lw, loads, decode=True) -> bool:
    """One prefill batch of several loads [(rid, keys, pool pages)], its forward and finish."""
    for rid, keys, pages in loads:
        assert lw.load(rid, keys, _rows(pages, lw.device))
    return forward(lw, lw.start(), decode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
def test_two_requests_of_one_batch_on_one_document_read_it_once(tmp_path, device, engine):
    lw, k, v, want = _setup(tmp_path, device, engine, pages=100)
    a, b = list(range(1, 101)), list(range(101, 201))
    c_keys, c_pages = KEYS[50:100], list(range(201, 251))  # a third sharing half of it
    assert _batch(lw, [("a", KEYS[:100], a), ("b", KEYS[:100], b), ("c", c_keys, c_pages)])
    assert _counts(lw) == (100, 150)  # 100 pages read, 150 copied on the device
    assert _exact(k, v, KEYS[:100], a, want) and _exact(k, v, KEYS[:100], b, want)
    assert _exact(k, v, c_keys, c_pages, want)
    lw.close()


def test_the_timeline_records_each_loads_copied_pages(tmp_path):
    """tutti_timeline_file: a load's record says how many of its pages were copied in the pool and
    how many came from the DRAM tier, beside the pages read (what a batch of requests on one
    document cost, from the record alone)."""
    import json

    from tutti_hicache.benchmarks import timeline
    lw, k, v, want = _setup(tmp_path, pages=40, tutti_timeline_file=str(tmp_path / "tl-{pid}.jsonl"))
    a, b = list(range(1, 41)), list(range(41, 81))
    assert _batch(lw, [("a", KEYS[:40], a), ("b", KEYS[:40], b)])
    assert _counts(lw) == (40, 40)
    lw.close()
    (path,) = tmp_path.glob("tl-*.jsonl")
    (rec,) = [r for r in map(json.loads, path.read_text().splitlines()) if "start_ns" in r]
    s = timeline.summarize(rec)
    assert (s["pages"], s["copied_pages"], s["host_pages"]) == (40, 40, 0)
    assert _exact(k, v, KEYS[:40], b, want)


@pytest.mark.parametrize("device", DEVICES)
def test_one_document_of_two_requests_partly_in_the_dram_tier(tmp_path, device):
    """With the DRAM tier on, each page is taken once per batch, from DRAM where the tier holds
    it and else from the SSD, and copied in the pool for the second request."""
    lw, k, v, want = _setup(tmp_path, device, pages=100, tutti_host_gb=0.001)
    a, b = list(range(1, 101)), list(range(101, 201))
    assert _batch(lw, [("a", KEYS[:100], a), ("b", KEYS[:100], b)])
    lw.drain_loads()
    s = lw.stats()["linker"]
    assert 0 < s["load_host_pages"] < 100  # 1 MB holds part of the document
    assert (s["load_pages"], s["load_copied_pages"]) == (100, 100)
    assert s["load_ssd_pages"] == 100 - s["load_host_pages"]  # what the SSD served, read once
    assert _exact(k, v, KEYS[:100], a, want) and _exact(k, v, KEYS[:100], b, want)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_document_in_dram_is_copied_over_the_bus_once(tmp_path, device):
    """Every page in the DRAM tier: two requests of a batch take the document from it once,
    and a third in the next batch (no forward between) copies it from their slots."""
    lw, k, v, want = _setup(tmp_path, device, pages=100, tutti_host_gb=0.05)
    a, b, c = list(range(1, 101)), list(range(101, 201)), list(range(201, 301))
    assert _batch(lw, [("a", KEYS[:100], a), ("b", KEYS[:100], b)], decode=False)
    assert _batch(lw, [("c", KEYS[:100], c)])
    lw.drain_loads()
    s = lw.stats()["linker"]
    assert (s["load_pages"], s["load_host_pages"], s["load_copied_pages"]) == (100, 100, 200)
    assert s["load_ssd_pages"] == 0  # the SSD served nothing: a restore rate has no SSD bytes
    assert all(_exact(k, v, KEYS[:100], p, want) for p in (a, b, c))
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_matched_during_the_last_restores_forward_copies_its_pages(tmp_path, device):
    """B arrives while A's restore and forward run (SGLang's tree does not hold A's pages yet):
    the next batch copies them from A's slots, reads only what A did not restore, and A's slots
    keep their bytes."""
    lw, k, v, want = _setup(tmp_path, device, pages=120)
    a = list(range(1, 101))
    assert _batch(lw, [("a", KEYS[:100], a)], decode=False)
    b_keys, b = KEYS[:120], list(range(151, 271))  # A's 100 pages and 20 more
    assert _batch(lw, [("b", b_keys, b)])
    assert _counts(lw) == (100 + 20, 100)
    assert _exact(k, v, b_keys, b, want) and _exact(k, v, KEYS[:100], a, want)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_slots_released_and_handed_out_again_in_the_same_pass_still_get_the_right_bytes(tmp_path, device):
    """A's request released its slots before B was admitted and B got them back in another order
    (every page lands on another key's source slot, and one on its own): B still gets its own
    page's bytes in every slot."""
    lw, k, v, want = _setup(tmp_path, device, pages=64)
    a = list(range(1, 65))
    assert _batch(lw, [("a", KEYS[:64], a)], decode=False)
    b = [a[(i * 9 + 8) % 64] for i in range(64)]  # a permutation of A's slots
    assert sorted(b) == a and sum(x == y for x, y in zip(a, b)) == 8  # 8 on their own slot
    assert _batch(lw, [("b", KEYS[:64], b)])
    assert _counts(lw) == (64, 64)
    assert _exact(k, v, KEYS[:64], b, want)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_slots_handed_out_again_with_half_the_pages_in_dram_still_get_the_right_bytes(tmp_path, device):
    """The same with a DRAM tier that holds half of A's pages: B's pages from the SSD and from
    DRAM are both copied from A's slots, and a slot the first group's copy writes is one the
    second group's copy reads. One copy over both groups reads every source first (two copies,
    one per group, put another key's bytes in 16 of the 64 slots)."""
    lw, k, v, want = _setup(tmp_path, device, pages=64, tutti_host_gb=0.001)
    if lw.host is None:
        pytest.skip("no DRAM tier on this machine")
    assert int(lw.host.present(KEYS[:64]).sum()) == lw.host.slots == 32
    a = list(range(1, 65))
    assert _batch(lw, [("a", KEYS[:64], a)], decode=False)
    b = [a[(i * 9 + 8) % 64] for i in range(64)]
    assert _batch(lw, [("b", KEYS[:64], b)])
    assert _counts(lw) == (64, 64)
    assert _exact(k, v, KEYS[:64], b, want)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_between_the_batches_means_the_pages_are_read_again(tmp_path, device):
    """A decode batch ran between A's batch and B's: A's slots may hold other bytes (here they
    do), so B reads from the store."""
    lw, k, v, want = _setup(tmp_path, device, pages=100)
    a, b = list(range(1, 101)), list(range(101, 201))
    assert _batch(lw, [("a", KEYS[:100], a)])  # and the decode batch after it
    for t in k + v:
        t[PAGE:PAGE * 101] = -7  # what that forward may have written into released slots
    assert _batch(lw, [("b", KEYS[:100], b)])
    assert _counts(lw) == (200, 0)
    assert _exact(k, v, KEYS[:100], b, want)
    lw.close()


@pytest.mark.parametrize("device", DEVICES)
def test_pages_of_a_failed_batch_are_never_copied(tmp_path, device):
    lw, k, v, want = _setup(tmp_path, device, pages=100)
    store = lw.store
    path, off = store.locate(KEYS[60])
    with open(path, "r+b") as f:  # one bit of page 60's layer 0 K
        at = off + int(store.layout.object_offsets[0]) + 5
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    assert not _batch(lw, [("a", KEYS[:100], list(range(1, 101)))], decode=False)
    good, b = KEYS[:60], list(range(101, 161))
    assert _batch(lw, [("b", good, b)])
    assert _counts(lw)[1] == 0  # read again, not copied from the failed batch's slots
    assert _exact(k, v, good, b, want)
    lw.close()


def test_a_reset_forgets_the_last_batchs_pages(tmp_path):
    lw, k, v, want = _setup(tmp_path, pages=50)
    assert _batch(lw, [("a", KEYS[:50], list(range(1, 51)))], decode=False)
    lw.reset()  # /flush_cache
    assert _batch(lw, [("b", KEYS[:50], list(range(51, 101)))])
    assert _counts(lw) == (100, 0)
    assert _exact(k, v, KEYS[:50], list(range(51, 101)), want)
    lw.close()


def test_copies_are_bytes_for_any_pool_dtype(tmp_path):
    """An fp8 KV pool (SGLang stores it as uint8): copies move bytes, whatever the dtype."""
    from tutti_hicache.layerwise import LayerwiseKV
    from tutti_hicache.config import TuttiConfig
    from test_layerwise import GEOM
    g = torch.Generator().manual_seed(3)
    rows = (N + 1) * PAGE
    k = [torch.randint(0, 256, (rows, 2, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
         for _ in range(GEOM.num_layers)]
    v = [torch.randint(0, 256, (rows, 2, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
         for _ in range(GEOM.num_layers)]
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path / "a")], "tutti_capacity_gb": 0.05,
                                    "tutti_stage_mb": 1}, env={})
    lw = LayerwiseKV(cfg, GEOM, {"t": "fp8"}, k, v, PAGE)
    offload_all(lw, KEYS[:40], _rows(range(1, 41)))
    want = [t[PAGE:PAGE * 41].view(torch.uint8).clone() for t in k + v]
    assert _batch(lw, [("a", KEYS[:40], list(range(41, 81))), ("b", KEYS[:40], list(range(81, 121)))],
                  decode=False)
    assert _batch(lw, [("c", KEYS[:40], list(range(121, 161)))])
    assert _counts(lw) == (40, 80)
    for lo in (41, 81, 121):
        assert all(torch.equal(t[PAGE * lo:PAGE * (lo + 40)].view(torch.uint8), w) for t, w in zip(k + v, want))
    lw.close()


def test_restore_helper_without_decode_copies_and_with_it_reads(tmp_path):
    """The shared helper's two modes (test_layerwise.restore), as the other tests rely on them."""
    lw, k, v, want = _setup(tmp_path, pages=20)
    rows = _rows(range(1, 21))
    assert restore(lw, KEYS[:20], rows, decode=False)
    assert restore(lw, KEYS[:20], rows)
    assert restore(lw, KEYS[:20], rows)
    assert _counts(lw) == (40, 20)
    assert _exact(k, v, KEYS[:20], list(range(1, 21)), want)
    lw.close()


def test_without_copy_recent_only_a_batchs_own_duplicates_are_copied(tmp_path):
    """LayerwiseKV(..., copy_recent=False), as TuttiLinker builds it where a forward can write the
    pool without set_consumer (test_linker.py): pages the last batch restored are read again;
    one batch's duplicates are still read once."""
    lw, k, v, want = _setup(tmp_path, pages=40, copy_recent=False)
    a, b, c = list(range(1, 41)), list(range(41, 81)), list(range(81, 121))
    assert _batch(lw, [("a", KEYS[:40], a), ("b", KEYS[:40], b)], decode=False)
    assert _batch(lw, [("c", KEYS[:40], c)])
    assert _counts(lw) == (80, 40)  # A read, B copied from A, C read again
    assert all(_exact(k, v, KEYS[:40], p, want) for p in (a, b, c))
    lw.close()


def test_a_copy_that_fails_at_start_reads_every_page_instead(tmp_path, monkeypatch, caplog):
    """A copy raising in start() (e.g. no device memory for it) never reaches SGLang's scheduler:
    the batch reads every page from the store, byte-exact."""
    lw, k, v, want = _setup(tmp_path, pages=40)
    a, b = list(range(1, 41)), list(range(41, 81))
    assert _batch(lw, [("a", KEYS[:40], a)], decode=False)

    def no_memory(*args, **kw):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(lw._loader, "_copy_own", no_memory)
    with caplog.at_level("WARNING", logger="tutti_hicache.linker"):
        assert _batch(lw, [("b", KEYS[:40], b)])
    assert "reading them from the store instead" in caplog.text
    assert _counts(lw) == (80, 0)
    assert _exact(k, v, KEYS[:40], b, want)
    lw.close()
