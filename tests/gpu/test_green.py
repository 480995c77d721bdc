"""The I/O stream: fallbacks everywhere (faked devices on CPU), the real green context on a Hopper GPU."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from tutti_hicache import green

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(green, "_cache", {})


def records(caplog):
    return [r for r in caplog.records if r.name == "tutti_hicache.green"]


@pytest.mark.slow  # a fresh interpreter imports torch (about 2 s)
def test_import_touches_neither_cuda_nor_the_driver():
    code = ("import sys, torch, tutti_hicache.green; "
            "assert 'tutti_hicache.driver' not in sys.modules, 'driver loaded'; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialized'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_num_sms_must_be_non_negative():
    with pytest.raises(ValueError, match="num_sms must be a non-negative int"):
        green.io_stream(-1)


def test_zero_sms_gives_a_priority_stream_on_every_sm(monkeypatch):
    """tutti_io_sms=0: no partition, even where green contexts exist."""
    fake_device(monkeypatch, (9, 0), total_sms=132)
    io = green.io_stream(0)
    assert (io.kind, io.num_sms, io.device, io.stream.priority) == ("priority", 132, 0, -1)
    assert "num_sms=0" in io.reason


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_no_cuda_gives_kind_none_and_logs_once(caplog):
    caplog.set_level(logging.INFO, logger="tutti_hicache.green")
    first = green.io_stream(8)
    assert (first.stream, first.kind, first.num_sms, first.device) == (None, "none", 0, None)
    assert "CUDA is not available" in first.reason
    assert green.io_stream(8) is first
    assert len(records(caplog)) == 1 and "none" in records(caplog)[0].getMessage()


class FakeStream:
    def __init__(self, device=None, priority=0):
        self.device, self.priority = device, priority


def fake_device(monkeypatch, capability, total_sms=132):
    monkeypatch.setattr(green, "_device_index", lambda device: 0)
    monkeypatch.setattr(green, "_device_facts", lambda index: (capability, total_sms))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)


def test_pre_hopper_falls_back_to_priority_stream(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tutti_hicache.green")
    fake_device(monkeypatch, (8, 0), total_sms=108)
    io = green.io_stream(8)
    assert (io.kind, io.num_sms, io.device, io.stream.priority) == ("priority", 108, 0, -1)
    assert "sm_80" in io.reason
    green.io_stream(8)
    assert len(records(caplog)) == 1


def test_hopper_without_green_contexts_falls_back(monkeypatch):
    fake_device(monkeypatch, (9, 0))

    def broken(index, num_sms):
        raise RuntimeError("not here")

    monkeypatch.setattr(green, "_torch_green", broken)
    monkeypatch.setattr(green, "_driver_green", broken)
    io = green.io_stream(16)
    assert io.kind == "priority"
    assert "driver API: not here" in io.reason and "torch.cuda.green_contexts: not here" in io.reason


def test_hopper_prefers_the_driver_then_torch(monkeypatch):
    fake_device(monkeypatch, (9, 0))
    calls = []

    def failing_driver(index, num_sms):
        calls.append("driver")
        raise RuntimeError("no green-context streams")

    def torch_green(index, num_sms):
        calls.append("torch")
        return green.IOStream("s", "green", num_sms, "fake torch", index)

    monkeypatch.setattr(green, "_driver_green", failing_driver)
    monkeypatch.setattr(green, "_torch_green", torch_green)
    assert green.io_stream(8).kind == "green" and calls == ["driver", "torch"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_driver_way_without_cuda_fails_with_its_reason():
    """The C++ way loads libcuda lazily: the extension builds and imports without CUDA, its CUDA
    part says why it cannot run, and a call raises RuntimeError with the loader's reason."""
    from tutti_hicache import driver
    from tutti_hicache.engine import extension
    ok, why = driver.available()
    assert not ok and why
    assert not extension().cuda_available() and extension().cuda_reason() == why
    with pytest.raises(RuntimeError, match="."):
        green._driver_green(0, 8)
    if not os.path.exists("/dev/nvidiactl"):  # no driver at all (not merely no GPU for torch)
        with pytest.raises(RuntimeError, match="CUDA driver unavailable"):
            driver.green_streams(0, 8)


def test_asking_for_every_sm_gives_a_priority_stream(monkeypatch):
    fake_device(monkeypatch, (9, 0), total_sms=132)
    assert green.io_stream(132).kind == "priority"


@gpu
@pytest.mark.gpu
def test_real_stream_runs_torch_work():
    io = green.io_stream(8)
    assert io.kind in ("green", "priority") and io.stream is not None
    if torch.cuda.get_device_capability() >= (9, 0):
        assert io.kind == "green", io.reason
        assert io.reason.startswith("driver API"), io.reason  # the C++ way, not torch's
        assert 8 <= io.num_sms < torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    io.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(io.stream):
        y = x * 2
    torch.cuda.current_stream().wait_stream(io.stream)
    assert torch.equal(y, x * 2)
    assert green.io_stream(8) is io


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="inline PTX needs compiled Triton")
def test_green_stream_confines_triton_kernels_to_its_sms():
    import triton
    import triton.language as tl

    @triton.jit
    def record_sm(out_ptr):
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), smid)

    io = green.io_stream(8)
    if io.kind != "green":
        pytest.skip(f"no green context here: {io.reason}")
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(io.stream):
        record_sm[(out.numel(),)](out)
    io.stream.synchronize()
    used = torch.unique(out).numel()
    assert bool((out >= 0).all()) and used <= io.num_sms, f"{used} SMs used, partition has {io.num_sms}"


@gpu
@pytest.mark.gpu
def test_green_stream_has_the_greatest_priority():
    io = green.io_stream(8)
    if io.kind != "green" or not io.reason.startswith("driver API"):
        pytest.skip(f"no driver-API green context here: {io.reason}")
    # The driver's range can be wider than torch's (-5 against torch's -3 on an H200): the stream
    # must be at least as urgent as any torch can make, and ahead of the default (0) the forward uses.
    _least, greatest = torch.cuda.Stream.priority_range()
    assert io.stream.priority <= greatest < 0, (io.stream.priority, greatest)
