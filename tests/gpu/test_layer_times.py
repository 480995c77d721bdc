"""LayerTimes' CUDA-event marks (windows.py): a forward's stream stalls and layer times, as the
timeline reports them, on a real GPU. On CPU the same arithmetic is tested with host clocks
(tests/unit/test_windows.py)."""

import time

import pytest
import torch

from tutti_hicache.layerwise.windows import LayerTimes

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_a_stream_waiting_on_another_streams_work_is_reported_as_a_stall():
    """Layer 1's KV 'lands' on a side stream after a long GPU sleep; the forward's stream waits
    for it between arrive(1) and passed(1). The check is where the time is attributed (that
    stall is the largest mark), not how long anything took."""
    times = LayerTimes(cuda=True)
    assert times.report() == []  # start keeping
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    times.begin(128, 4096, index=3)
    times.arrive(0)
    times.passed(0)
    x.mul_(2)  # layer 0's compute
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # layer 1's copy, still running (tens of ms)
        landed = torch.cuda.Event()
        landed.record()
    times.arrive(1)
    torch.cuda.current_stream().wait_event(landed)
    times.passed(1)
    x.mul_(2)
    times.arrive(2)
    times.passed(2)
    times.end()
    before = time.monotonic_ns()  # layer 1's copy is still sleeping on the GPU
    (rec,) = times.report(wait=True)
    assert rec["forward_of"] == 3 and rec["clock"] == "gpu"
    assert len(rec["stall_ms"]) == 3 and len(rec["span_ms"]) == 2
    assert min(rec["stall_ms"] + rec["span_ms"]) >= 0
    assert max(rec["stall_ms"] + rec["span_ms"]) == rec["stall_ms"][1]  # the wait, not the compute
    # the host time the GPU passed the last layer's wait
    assert rec.get("last_passed_ns", 0) >= before, (rec, before)
    assert times.report() == []
