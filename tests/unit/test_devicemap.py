"""DeviceMap: SGLang's device KV pools -> per-layer buffers and page geometry (fake pools, CPU)."""

import pytest

torch = pytest.importorskip("torch")

from tutti_hicache.devicemap import DeviceMap  # noqa: E402


class MHATokenToKVPool:  # named like SGLang's, which DeviceMap recognises by class name
    def __init__(self, layers=3, rows=64, heads=2, dim=8, **extra):
        self.k_buffer = [torch.zeros(rows, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
        self.v_buffer = [torch.zeros(rows, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
        self.__dict__.update(extra)


class MLATokenToKVPool:
    def __init__(self, layers=3, rows=64, dim=576):
        self.kv_buffer = [torch.zeros(rows, 1, dim, dtype=torch.bfloat16) for _ in range(layers)]


def test_mha_pool():
    dm = DeviceMap.from_pool(MHATokenToKVPool(), 16)
    assert not dm.mla and len(dm.k_bufs) == len(dm.v_bufs) == 3
    g = dm.geometry
    assert (g.kind, g.num_layers, g.page_size, g.k_token_bytes, g.v_token_bytes) == ("mha", 3, 16, 32, 32)


def test_mla_pool():
    dm = DeviceMap.from_pool(MLATokenToKVPool(), 16)
    assert dm.mla and dm.v_bufs is None and len(dm.k_bufs) == 3
    assert (dm.geometry.kind, dm.geometry.k_token_bytes, dm.geometry.v_token_bytes) == ("mla", 1152, 0)


@pytest.mark.parametrize("pool, message", [
    (MHATokenToKVPool(use_hnd=True), r"MHATokenToKVPool \(HND\) is not supported"),
    (MHATokenToKVPool(k_scale_buffer=[1]), "with scales or a 5D layout"),
    (MHATokenToKVPool(kv_cache_layout="vectorized_5d"), "with scales or a 5D layout"),
    (object(), "object is not supported"),
])
def test_unsupported_pools_are_refused(pool, message):
    with pytest.raises(ValueError, match=message):
        DeviceMap.from_pool(pool, 16)


def test_non_contiguous_buffers_are_refused():
    pool = MHATokenToKVPool()
    pool.k_buffer[1] = pool.k_buffer[1].transpose(0, 1)
    with pytest.raises(ValueError, match="must be contiguous"):
        DeviceMap.from_pool(pool, 16)


def test_k_and_v_of_other_sizes_are_refused_at_attach():
    """v_head_dim != head_dim: refused with the reason, not attached and then failing every
    offload."""
    pool = MHATokenToKVPool()
    pool.v_buffer = [torch.zeros(64, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    with pytest.raises(ValueError, match="v_head_dim != head_dim"):
        DeviceMap.from_pool(pool, 16)
