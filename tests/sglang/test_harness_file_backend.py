"""The SGLang harness, proven on SGLang's own backends: HiCacheFile through the generic path
(batch_set/batch_get) and a small in-memory interface_v1 backend through the zero-copy path.

Each round trip: random pages in a real host pool -> _page_backup -> poison the source ->
_storage_hit_query -> _page_transfer into other host slots -> byte-exact per page. 200 pages, so
two batches of STORAGE_BATCH_SIZE (128 + 72).
"""

import ctypes

import pytest

torch = pytest.importorskip("torch")

from tutti_hicache.testing import controller as HC  # noqa: E402

PAGE = 16
N_PAGES = 200
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
GEOMETRIES = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


@pytest.fixture(autouse=True)
def _no_file_backend_env(monkeypatch):
    """HiCacheFile prefers this variable over its file_path argument."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


def make_pool(h, kind, layout, n_pages=2 * N_PAGES):
    """2 layers, bf16, 16-token pages: MHA 2 heads x 16 dims, MLA 32 + 16 dims."""
    if kind == "mha":
        return h.make_mha_host_pool(layout, 2, 2, 16, PAGE, torch.bfloat16, n_pages)
    return h.make_mla_host_pool(layout, 2, 32, 16, PAGE, torch.bfloat16, n_pages)


def counting_file_backend(h, config, directory):
    """HiCacheFile that records the batch sizes SGLang hands it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    class CountingFile(HiCacheFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = []

        def batch_set(self, keys, values=None, *args, **kwargs):
            self.calls.append(("set", len(keys)))
            return super().batch_set(keys, values, *args, **kwargs)

        def batch_get(self, keys, target_locations=None, *args, **kwargs):
            self.calls.append(("get", len(keys)))
            return super().batch_get(keys, target_locations, *args, **kwargs)

    return CountingFile(config, file_path=str(directory))


def memory_v1_backend():
    """A zero-copy (interface_v1) backend keeping pages in a dict, copying with ctypes."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class MemoryV1(HiCacheStorage):
        def __init__(self):
            self.pages, self.calls = {}, []

        def _objects(self, keys, host_indices):
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
            per_page = len(ptrs) // len(keys)
            objects = list(zip(ptrs, sizes))
            return [objects[i * per_page:(i + 1) * per_page] for i in range(len(keys))]

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            self.calls.append(("set_v1", len(keys)))
            for key, objects in zip(keys, self._objects(keys, host_indices)):
                self.pages[key] = [ctypes.string_at(ptr, size) for ptr, size in objects]
            return [True] * len(keys)

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            self.calls.append(("get_v1", len(keys)))
            results = []
            for key, objects in zip(keys, self._objects(keys, host_indices)):
                data = self.pages.get(key)
                for (ptr, size), blob in zip(objects, data or []):
                    ctypes.memmove(ptr, blob, size)
                results.append(data is not None)
            return results

        def exists(self, key):
            return key in self.pages

        def get(self, *args, **kwargs):
            raise NotImplementedError

        batch_get = set = batch_set = get

    return MemoryV1()


def round_trip(h, pool, ctrl, keys):
    """Backup, poison, query, transfer into fresh slots; return (written, hits, tokens, ok)."""
    src, dst = pool.alloc(len(keys) * PAGE), pool.alloc(len(keys) * PAGE)
    h.fill_random(pool, src, seed=1)
    h.fill_random(pool, dst, seed=3)
    expected = h.page_bytes(pool, src)
    written = HC.controller_backup(ctrl, keys, src)
    h.fill_random(pool, src, seed=2)
    hits = HC.controller_hit_query(ctrl, keys)
    tokens = HC.controller_transfer(ctrl, keys, dst)
    return written, hits, tokens, h.page_bytes(pool, dst) == expected


@pytest.mark.sglang
@pytest.mark.parametrize("kind,layout", GEOMETRIES)
def test_file_backend_round_trip(sglang, store_dirs, kind, layout):
    h = sglang
    pool = make_pool(h, kind, layout)
    config = h.make_storage_config(
        is_mla=kind == "mla", is_page_first_layout=layout == "page_first"
    )
    backend = counting_file_backend(h, config, store_dirs[0])
    ctrl = HC.make_controller(backend, pool, PAGE, config, zero_copy=False)
    keys = h.make_page_keys(N_PAGES, seed=7)

    assert round_trip(h, pool, ctrl, keys) == (N_PAGES, N_PAGES, N_PAGES * PAGE, True)
    assert backend.calls == [("set", 128), ("set", 72), ("get", 128), ("get", 72)]
    assert len(list(store_dirs[0].iterdir())) == N_PAGES


@pytest.mark.sglang
@pytest.mark.parametrize("kind,layout", GEOMETRIES)
def test_zero_copy_round_trip(sglang, kind, layout):
    h = sglang
    pool = make_pool(h, kind, layout)
    config = h.make_storage_config(
        is_mla=kind == "mla", is_page_first_layout=layout == "page_first",
        extra_config={"interface_v1": 1},
    )
    backend = memory_v1_backend()
    ctrl = HC.make_controller(backend, pool, PAGE, config, zero_copy=True)
    keys = h.make_page_keys(N_PAGES, seed=8)

    assert backend.mem_pool_host is pool
    assert round_trip(h, pool, ctrl, keys) == (N_PAGES, N_PAGES, N_PAGES * PAGE, True)
    assert backend.calls == [("set_v1", 128), ("set_v1", 72), ("get_v1", 128), ("get_v1", 72)]


@pytest.mark.sglang
@pytest.mark.parametrize("missing", [5, 150])
def test_transfer_stops_at_first_missing_page(sglang, tmp_path, missing):
    h = sglang
    pool = make_pool(h, "mha", "layer_first")
    config = h.make_storage_config()
    ctrl = HC.make_controller(counting_file_backend(h, config, tmp_path), pool, PAGE, config, False)
    keys = h.make_page_keys(N_PAGES, seed=9)
    src, dst = pool.alloc(N_PAGES * PAGE), pool.alloc(N_PAGES * PAGE)
    h.fill_random(pool, src, seed=1)
    h.fill_random(pool, dst, seed=3)
    cut = missing * PAGE
    assert HC.controller_backup(ctrl, keys[:missing], src[:cut]) == missing
    assert HC.controller_backup(ctrl, keys[missing + 1:], src[cut + PAGE:]) == N_PAGES - missing - 1
    before = h.page_bytes(pool, dst)

    assert HC.controller_hit_query(ctrl, keys) == missing
    assert HC.controller_transfer(ctrl, keys, dst) == cut
    after = h.page_bytes(pool, dst)
    assert after[:missing] == h.page_bytes(pool, src)[:missing]
    assert after[missing:] == before[missing:]  # nothing copied past the hole


@pytest.mark.sglang
def test_mla_reader_rank_writes_nothing(sglang, tmp_path):
    h = sglang
    pool = make_pool(h, "mla", "layer_first", n_pages=8)
    config = h.make_storage_config(tp_rank=1, tp_size=2, is_mla=True)
    backend = counting_file_backend(h, config, tmp_path)
    ctrl = HC.make_controller(backend, pool, PAGE, config, zero_copy=False)
    src = pool.alloc(4 * PAGE)
    h.fill_random(pool, src, seed=1)

    assert HC.controller_backup(ctrl, h.make_page_keys(4), src) == 0
    assert backend.calls == [] and list(tmp_path.iterdir()) == []


@pytest.mark.sglang
def test_dense_controller_class(sglang):
    known = {"0.5.17": "HiCacheController", "0.5.23": "HybridCacheController"}
    if sglang.sglang_version() not in known:
        pytest.skip(f"no expectation recorded for sglang {sglang.sglang_version()}")
    assert HC.dense_controller_class().__name__ == known[sglang.sglang_version()]


def test_page_keys_are_distinct_hex():
    from tutti_hicache.testing.sglang import make_page_keys

    keys = make_page_keys(300, seed=1)
    assert len(set(keys)) == 300 and all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    assert keys == make_page_keys(300, seed=1) != make_page_keys(300, seed=2)
