"""The host tier's one warning at attach when SGLang's settings will cut its hits: real SGLang
host and device pools on CPU, real server args published in a runtime context."""

import contextlib
import logging

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.sglang

PAGE = 16


@contextlib.contextmanager
def server(model: str, **args):
    """SGLang's server args published as a scheduler's runtime context (0.5.23), for the block."""
    rc = pytest.importorskip("sglang.srt.runtime_context")
    if not hasattr(rc, "create_context"):
        pytest.skip("this SGLang has no runtime context (0.5.17 publishes global server args)")
    from sglang.srt.server_args import ServerArgs
    with rc.use_context(rc.create_context(ServerArgs(model_path=model, device="cpu", **args),
                                          role="scheduler")):
        yield


def pools(h, device_tokens: int, host_ratio: float):
    """A real device KV pool of device_tokens and a host pool of host_ratio times it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    device = MHATokenToKVPool(size=device_tokens, page_size=PAGE, dtype=torch.bfloat16,
                              head_num=2, head_dim=64, layer_num=2, device="cpu",
                              enable_memory_saver=False, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, host_ratio, 0,
                                PAGE, "layer_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size,
                                start_layer=device.start_layer, end_layer=device.end_layer)
    host._tutti_device_pool = device
    return host


def attach_warnings(h, tmp_path, pool, caplog) -> list[str]:
    from tutti_hicache.storage import TuttiStorage
    sc = h.make_storage_config(extra_config={"tutti_dirs": [str(tmp_path)],
                                             "tutti_capacity_gb": 0.01})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        st = TuttiStorage(sc, {})
        st.register_mem_pool_host(pool)
        st.close()
    return [r.getMessage() for r in caplog.records if "will cut" in r.getMessage()]


def test_attach_warns_once_about_the_prefetch_policy_and_a_small_host_pool(sglang, tmp_path,
                                                                          caplog):
    from tutti_hicache.benchmarks.configs import write_model
    h = sglang
    model = str(tmp_path / "model")
    write_model(model, layers=2)  # a config.json: ServerArgs reads the model's
    small = pools(h, 4096, 0.5)  # the host holds half the GPU's tokens
    big = pools(h, 256, 4.0)
    assert attach_warnings(h, tmp_path, small, caplog) == []  # no server here: nothing to check
    with server(model, hicache_storage_prefetch_policy="wait_complete"):
        assert attach_warnings(h, tmp_path, big, caplog) == []
    with server(model):  # SGLang's defaults: the timeout policy
        [msg] = attach_warnings(h, tmp_path, big, caplog)
        assert "--hicache-storage-prefetch-policy timeout" in msg and "use wait_complete" in msg
        assert "1 s + 0.25 s per 1024 tokens" in msg and "host pool" not in msg
    with server(model, hicache_storage_prefetch_policy="best_effort", hicache_ratio=0.5,
                hicache_storage_backend_extra_config='{"prefetch_timeout_base": 3}'):
        [msg] = attach_warnings(h, tmp_path, small, caplog)
        assert "best_effort ends each prefetch" in msg
        assert (f"the host pool (--hicache-ratio 0.5: {small.size} tokens) is smaller than "
                "the GPU's KV pool (4096 tokens)") in msg
        assert "raise --hicache-size to at least" in msg and "--mem-fraction-static" in msg
    with server(model, hicache_storage_prefetch_policy="timeout", hicache_size=12,
                hicache_storage_backend_extra_config='{"prefetch_timeout_base": 3}'):
        [msg] = attach_warnings(h, tmp_path, small, caplog)
        assert "within 3 s + 0.25 s per 1024 tokens" in msg and "--hicache-size 12" in msg
