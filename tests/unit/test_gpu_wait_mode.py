"""Which completion path a layer-wise load takes (tutti_gpu_wait), decided at attach: the GPU-wait
path needs the CUDA part and KV objects whose checksums the read stream computes in C++ (a multiple
of 4 KiB); otherwise auto falls back to the CPU-event path with the reason, and on fails the attach."""

import types

import pytest

from tutti_hicache import driver
from tutti_hicache.layerwise import LayerwiseKV
from tutti_hicache.layout import PageGeometry

ALIGNED = PageGeometry("mha", 2, 16, 256, 256)  # 4096 B objects
PADDED = PageGeometry("mha", 2, 16, 200, 200)  # 3200 B objects: padded to 4 KiB on disk


def mode(setting, geometry, cuda=True):
    kv = types.SimpleNamespace(cuda=cuda)
    kv._cuda_part = lambda: LayerwiseKV._cuda_part(kv)
    return LayerwiseKV._gpu_wait_mode(kv, setting, geometry)


@pytest.fixture
def cuda_part(monkeypatch):
    monkeypatch.setattr(driver, "available", lambda: (True, ""))


def test_off_is_off_whatever_the_machine():
    assert mode("off", ALIGNED) == (False, "tutti_gpu_wait=off")


def test_auto_and_on_take_the_gpu_path_with_the_cuda_part_and_aligned_objects(cuda_part):
    assert mode("auto", ALIGNED)[0] and mode("on", ALIGNED)[0]


def test_padded_objects_keep_auto_on_the_cpu_path_and_fail_on(cuda_part):
    on, why = mode("auto", PADDED)
    assert not on and "3200 B" in why and "Python" in why
    with pytest.raises(RuntimeError, match="3200 B, not a multiple of 4 KiB"):
        mode("on", PADDED)


def test_a_cpu_pool_never_takes_the_gpu_path(cuda_part):
    assert mode("auto", ALIGNED, cuda=False) == (False, "the pool is not on a CUDA device")
    with pytest.raises(RuntimeError, match="not on a CUDA device"):
        mode("on", ALIGNED, cuda=False)
