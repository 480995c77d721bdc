"""A read stream's completion gate on plain host memory (no CUDA needed): the two words advance
in chunk order as chunks land whole and verified; a failed checksum, a failed request, a cancel
or a stream dropped unjoined stores the terminal value into `release` and leaves `verified` at
the chunks that passed. The GPU waits on exactly these words (tests/gpu/test_gpu_wait.py)."""

import errno
import os

import numpy as np
import pytest

from tutti_hicache.engine import extension

from test_engine import engine_or_skip

E = extension()
KINDS = ["uring", "posix"] if E.uring_compiled() else ["posix"]
N, SZ, CHUNKS = 24, 4096, np.array([0, 8, 16, 24])  # three chunks of eight 4 KiB requests


@pytest.fixture(params=KINDS)
def engine(request):
    yield from engine_or_skip(request.param, queue_depth=32, threads=2)


@pytest.fixture
def source(engine, tmp_path):
    """A file of N random 4 KiB blocks, opened in the engine; (file index, its bytes)."""
    data = np.random.default_rng(5).integers(0, 256, N * SZ, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.tobytes())
    return engine.open_file(str(path), False, False), data


def expected_sums(data):
    """XXH3 of each block (one checksum group per request), computed by the extension."""
    offs = np.arange(N, dtype=np.uint64) * SZ
    return E.checksum_groups(data.ctypes.data + offs, np.full(N, SZ), np.arange(N + 1), 1)


class Words:
    """Two gate words in a page-aligned buffer: [release, verified]."""

    def __init__(self):
        self.buf = E.AlignedBuffer(4096)
        self.w = np.frombuffer(self.buf, dtype=np.uint32)
        self.addrs = (self.buf.address, self.buf.address + 4)

    def values(self):
        return int(self.w[0]), int(self.w[1])


def stream(engine, f, words, offsets=None, expect=None, must=None, groups=True):
    dst = E.AlignedBuffer(N * SZ)
    offsets = np.arange(N) * SZ if offsets is None else offsets
    n_groups = N if groups else 0
    expect = np.zeros(n_groups, np.uint64) if expect is None else expect
    must = np.ones(n_groups, np.uint8) if must is None else must
    st = engine.read_stream(np.full(N, f), offsets, np.full(N, SZ),
                            dst.address + np.arange(N, dtype=np.uint64) * SZ, CHUNKS,
                            np.arange(N + 1) if groups else None,
                            (words.addrs[0], words.addrs[1], expect, must))
    return st, dst


def test_gate_advances_in_chunk_order_before_each_wait_returns(engine, source):
    f, data = source
    words = Words()
    st, dst = stream(engine, f, words, expect=expected_sums(data))
    assert words.values() == (0, 0)  # nothing allowed, nothing released
    for c in range(3):
        st.allow(c + 1)
        res, _ = st.wait(c)
        assert (res == SZ).all()
        assert words.values() == (c + 1, c + 1)
    st.join()
    assert words.values() == (3, 3)
    assert (np.frombuffer(dst, np.uint8) == data).all()


def test_a_bad_checksum_releases_with_the_terminal_value_and_verified_stops_before_it(engine, source):
    f, data = source
    words = Words()
    expect = expected_sums(data)
    expect[10] ^= 1  # chunk 1's third page "corrupt"
    st, _ = stream(engine, f, words, expect=expect)
    st.allow(3)
    st.join()
    assert words.values() == (E.GATE_TERMINAL, 1)


def test_an_unchecked_group_does_not_fail_the_gate(engine, source):
    f, data = source
    words = Words()
    expect = expected_sums(data)
    expect[10] ^= 1
    must = np.ones(N, np.uint8)
    must[10] = 0  # a fresh page the store trusts: its checksum is not compared
    st, _ = stream(engine, f, words, expect=expect, must=must)
    st.allow(3)
    st.join()
    assert words.values() == (3, 3)


def test_a_failed_request_fails_a_results_only_gate(engine, source):
    f, _ = source
    words = Words()
    offsets = np.arange(N) * SZ
    offsets[17] = (N + 64) * SZ  # chunk 2: past the end of the file
    st, _ = stream(engine, f, words, offsets=offsets, groups=False)
    st.allow(3)
    res, _ = st.wait(2)
    assert res[1] in (0, -errno.ENODATA) or res[1] < SZ
    st.join()
    assert words.values() == (E.GATE_TERMINAL, 2)


@pytest.mark.parametrize("end", ["cancel", "drop"])
def test_a_stream_ended_early_releases_every_wait(engine, source, end):
    """cancel() after chunk 0, or the stream dropped unjoined before any allow() (the destructor
    cancels, joins and releases)."""
    f, data = source
    words = Words()
    st, _ = stream(engine, f, words, expect=expected_sums(data))
    if end == "cancel":
        st.allow(1)
        st.wait(0)
        st.cancel()
        st.join()
    del st
    assert words.values() == (E.GATE_TERMINAL, 1 if end == "cancel" else 0)


def test_a_link_admits_chunks_from_another_thread_and_outlives_its_stream(engine, source):
    """What a GPU-wait load's CUDA host functions do (cuda.hpp allow_after), without CUDA: admit
    chunks through the stream's link from a thread that is not the stream's owner; once the
    stream is destroyed, the link's allow() does nothing (a host function that runs late)."""
    import threading
    f, data = source
    words = Words()
    st, dst = stream(engine, f, words, expect=expected_sums(data))
    link = st.link()
    st.allow(1)
    res, _ = st.wait(0)
    assert (res == SZ).all()
    t = threading.Thread(target=lambda: [link.allow(c) for c in (2, 3)])
    t.start()
    t.join()
    for c in (1, 2):
        res, _ = st.wait(c)
        assert (res == SZ).all()
    st.join()
    assert words.values() == (3, 3)
    assert (np.frombuffer(dst, np.uint8) == data).all()
    del st
    link.allow(3)  # detached: no stream behind it, nothing happens
    link.allow(1)


def test_gate_spec_is_checked(engine, source):
    f, _ = source
    words = Words()
    with pytest.raises(ValueError, match="one entry per checksum group"):
        stream(engine, f, words, expect=np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="4-byte aligned"):
        engine.read_stream(np.full(N, f), np.arange(N) * SZ, np.full(N, SZ),
                           np.full(N, words.addrs[0], np.uint64), CHUNKS, None,
                           (words.addrs[0] + 2, words.addrs[1], np.zeros(0, np.uint64),
                            np.zeros(0, np.uint8)))


def test_gate_store_and_load_are_plain_words():
    words = Words()
    E.gate_store(words.addrs[1], 7)
    assert E.gate_load(words.addrs[1]) == 7 and words.values() == (0, 7)
    with pytest.raises(ValueError, match="4-byte aligned"):
        E.gate_store(words.addrs[0] + 1, 1)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="checks a machine without the CUDA driver")
def test_the_cuda_part_imports_and_reports_why_without_a_driver():
    """The extension builds and imports without CUDA; the CUDA part says why it cannot run and
    every call raises RuntimeError naming it, instead of failing at import."""
    from tutti_hicache import driver
    ok, why = driver.available()
    assert not ok and why
    assert not E.cuda_available() and E.cuda_reason() == why
    with pytest.raises(RuntimeError, match="CUDA driver unavailable"):
        E.HostWords(0, 2)
    with pytest.raises(RuntimeError, match="CUDA driver unavailable"):
        E.stream_wait_value32(0, 0, 0, 1)
