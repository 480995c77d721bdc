"""The engine contract, run against every available engine on ext4 and on /dev/shm."""

import errno
import os
import threading
import time

import numpy as np
import pytest

from tutti_hicache.engine import extension, open_engine, probe_o_direct

E = extension()
KINDS = ["uring", "posix"] if E.uring_compiled() else ["posix"]


def engine_or_skip(kind: str, **options):
    """An engine of `kind` for a fixture to yield (closed after), or the test skipped where that
    engine cannot open here."""
    try:
        e = open_engine(kind, **options)
    except OSError as exc:
        pytest.skip(f"{kind} engine unavailable here: {exc}")
    yield e
    e.close()


@pytest.fixture(params=KINDS)
def engine(request):
    yield from engine_or_skip(request.param, queue_depth=64, threads=4)


def make_file(d, nbytes, name="f.bin"):
    path = os.path.join(d, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    os.close(fd)
    return path


def buf_of(nbytes, seed=None):
    b = E.AlignedBuffer(nbytes)
    a = np.frombuffer(b, dtype=np.uint8)
    if seed is not None:
        a[:] = np.random.default_rng(seed).integers(1, 256, nbytes, dtype=np.uint8)
    return b, a


def test_roundtrip_scatter_gather(engine, store_dirs):
    if not probe_o_direct(str(store_dirs[0])):
        pytest.skip("no O_DIRECT here")
    n, sz = 96, 8192
    f = engine.open_file(make_file(store_dirs[0], n * sz), True, True)
    src, a = buf_of(n * sz, seed=1)
    perm = np.random.default_rng(2).permutation(n)  # memory order differs from file order
    w = engine.submit("write", np.full(n, f), np.arange(n) * sz, np.full(n, sz), src.address + perm * sz)
    assert (w == sz).all()
    dst, b = buf_of(n * sz)
    r = engine.submit("read", np.full(n, f), np.arange(n) * sz, np.full(n, sz), dst.address + np.arange(n) * sz)
    assert (r == sz).all()
    assert (b.reshape(n, sz) == a.reshape(n, sz)[perm]).all()
    c = engine.counters()
    assert c["errors"] == 0 and c["bytes"] == 2 * n * sz and c["requests"] == 2 * n


def test_file_contiguous_requests_coalesce(engine, tmp_path):
    n, sz = 64, 4096
    f = engine.open_file(make_file(tmp_path, n * sz), True, True)
    b, _ = buf_of(n * sz, seed=3)
    before = engine.counters()
    r = engine.submit("read", np.full(n, f), np.arange(n) * sz, np.full(n, sz), b.address + np.arange(n)[::-1] * sz)
    assert (r == sz).all()
    after = engine.counters()
    subs = after["submissions"] - before["submissions"]
    if engine.name == "uring":
        assert after["enter_calls"] - before["enter_calls"] == 1
    # one READV for the whole run, though the destinations are reversed (every request is a
    # memory piece of its own)
    assert subs == 1


def test_bad_requests_are_per_request_errors(engine, tmp_path):
    """Each request reads into its own page: two into one would race (ThreadSanitizer caught
    requests 0 and 4 landing in one page at once from two POSIX workers)."""
    f = engine.open_file(make_file(tmp_path, 1 << 16), True, True)
    b, _ = buf_of(1 << 16)
    r = engine.submit("read", np.array([f, 1000, f, f, f]), np.array([0, 0, -4096, 1 << 16, 4096]),
                    np.array([4096, 4096, 4096, 4096, 4096]),
                    b.address + np.arange(5, dtype=np.uint64) * 4096)
    assert r[0] == 4096 and r[4] == 4096
    assert r[1] == -errno.EBADF and r[2] == -errno.EINVAL
    assert r[3] == -errno.ENODATA  # past the end of the file


def test_misaligned_o_direct_is_a_clean_result(engine, tmp_path):
    """Whether O_DIRECT accepts an odd address depends on the device's DMA alignment (kernel
    6.x relaxed it); either way the request completes whole or fails with -EINVAL."""
    f = engine.open_file(make_file(tmp_path, 1 << 16), True, True)
    b, _ = buf_of(1 << 16)
    r = engine.submit("read", np.array([f]), np.array([0]), np.array([4096]), np.array([b.address + 1], dtype=np.uint64))
    assert r[0] in (4096, -errno.EINVAL)


def test_errors_are_oserror_with_file(engine):
    with pytest.raises(FileNotFoundError) as ei:
        engine.open_file("/nonexistent/tutti", False, True)
    assert ei.value.filename == "/nonexistent/tutti" and ei.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="same length"):
        engine.submit("read", np.array([0]), np.array([0, 1]), np.array([1]), np.array([1], dtype=np.uint64))


def test_registered_buffers_and_large_batches(engine, tmp_path):
    """More requests than the queue depth: all complete; io_uring stays within 2 + n/depth enters."""
    n, sz = 500, 4096
    f = engine.open_file(make_file(tmp_path, 2 * n * sz), True, True)
    b, a = buf_of(n * sz, seed=4)
    engine.register_buffers([(b.address, b.nbytes)])
    offs = np.arange(n) * 2 * sz  # gaps: nothing coalesces
    assert (engine.submit("write", np.full(n, f), offs, np.full(n, sz), b.address + np.arange(n) * sz) == sz).all()
    a[:] = 0
    before = engine.counters()
    assert (engine.submit("read", np.full(n, f), offs, np.full(n, sz), b.address + np.arange(n) * sz) == sz).all()
    after = engine.counters()
    assert a.min() > 0
    if engine.name == "uring":
        assert after["enter_calls"] - before["enter_calls"] <= 2 + n / 64
    engine.register_buffers([])


def test_reads_and_writes_from_two_threads(engine, tmp_path):
    n, sz = 256, 4096
    fr = engine.open_file(make_file(tmp_path, n * sz, "r.bin"), True, True)
    fw = engine.open_file(make_file(tmp_path, n * sz, "w.bin"), True, True)
    src, a = buf_of(n * sz, seed=5)
    assert (engine.submit("write", np.full(n, fr), np.arange(n) * sz, np.full(n, sz), src.address + np.arange(n) * sz) == sz).all()
    errors = []

    def loop(op, f, buf):
        for _ in range(20):
            r = op(np.full(n, f), np.arange(n) * sz, np.full(n, sz), buf.address + np.arange(n) * sz)
            if not (r == sz).all():
                errors.append(r)

    dst, b = buf_of(n * sz)
    ts = [threading.Thread(target=loop, args=(lambda *a: engine.submit("read", *a), fr, dst)),
          threading.Thread(target=loop, args=(lambda *a: engine.submit("write", *a), fw, src))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and (a == b).all()


def test_read_batches_from_several_threads_land_exactly(engine, tmp_path):
    """Four readers at once (io_uring: two read rings in flight, the rest wait their turn) on
    one registered buffer: every byte lands where its own batch asked."""
    n, sz, readers = 64, 8192, 4
    f = engine.open_file(make_file(tmp_path, readers * n * sz), True, True)
    src, a = buf_of(readers * n * sz, seed=6)
    offs = np.arange(readers * n) * sz
    assert (engine.submit("write", np.full(readers * n, f), offs, np.full(readers * n, sz),
                         src.address + offs.astype(np.uint64)) == sz).all()
    dst, b = buf_of(readers * n * sz)
    engine.register_buffers([(dst.address, dst.nbytes)])
    errors = []

    def loop(r):
        rng = np.random.default_rng(r)
        for _ in range(30):
            perm = rng.permutation(n) + r * n  # this reader's pages, shuffled
            got = engine.submit("read", np.full(n, f), perm * sz, np.full(n, sz),
                              dst.address + (perm * sz).astype(np.uint64))
            if not (got == sz).all():
                errors.append(got)

    ts = [threading.Thread(target=loop, args=(r,)) for r in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and (a == b).all()
    engine.register_buffers([])


def test_verified_read_checksums_each_group(engine, tmp_path):
    """submit with group_starts: each group's sum equals checksum_groups over the bytes read; a
    group with a failed request gets 0; groups are for reads only."""
    n, sz = 12, 4096
    f = engine.open_file(make_file(tmp_path, n * sz), True, True)
    src, a = buf_of(n * sz, seed=11)
    offs = np.arange(n) * sz
    assert (engine.submit("write", np.full(n, f), offs, np.full(n, sz), src.address + offs.astype(np.uint64)) == sz).all()
    dst, b = buf_of(n * sz)
    files = np.full(n, f)
    files[7] = 999  # no such file: its group fails
    groups = np.array([0, 3, 6, 9, 12])
    addrs = dst.address + offs.astype(np.uint64)
    res, sums = engine.submit("read", files, offs, np.full(n, sz), addrs, groups)
    assert res[7] == -errno.EBADF and (np.delete(res, 7) == sz).all()
    want = E.checksum_groups(src.address + offs.astype(np.uint64), np.full(n, sz), groups)
    assert list(sums[[0, 1, 3]]) == list(want[[0, 1, 3]]) and sums[2] == 0
    with pytest.raises(ValueError, match="reads only"):
        engine.submit("write", np.full(n, f), offs, np.full(n, sz), addrs, groups)
    with pytest.raises(ValueError, match="'read' or 'write'"):
        engine.submit("append", np.full(n, f), offs, np.full(n, sz), addrs)


def test_closed_engine_refuses(tmp_path):
    e = open_engine("posix")
    e.close()
    e.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        e.submit("read", np.array([0]), np.array([0]), np.array([4096]), np.array([4096], dtype=np.uint64))


def test_checksums_and_memcpy():
    b, a = buf_of(3 * 4096, seed=6)
    addr = np.array([b.address, b.address + 4096, b.address + 8192], dtype=np.uint64)
    lens = np.array([4096, 4096, 4096])
    g = E.checksum_groups(addr, lens, np.array([0, 1, 3]))
    def whole(addr, nbytes):  # one piece: the XXH3-64 of contiguous bytes
        return E.checksum_groups(np.array([addr], dtype=np.uint64), np.array([nbytes]), np.array([0, 1]))[0]

    assert g[0] == whole(b.address, 4096) and g[1] == whole(b.address + 4096, 8192)
    d, da = buf_of(3 * 4096)
    E.memcpy_batch(d.address + np.array([8192, 0, 4096], dtype=np.uint64), addr, lens)
    assert (da[8192:] == a[:4096]).all() and (da[:4096] == a[4096:8192]).all()
    with pytest.raises(ValueError):
        E.checksum_groups(addr, lens, np.array([0, 5]))


def test_memcpy_batch_splits_a_few_mib_over_threads_exactly():
    """A DRAM-tier copy-up is one layer's staging chunk, 8-16 MiB: memcpy_batch splits batches
    that small over its threads (one per 2 MiB). Rows of uneven sizes, scattered destinations,
    1 to 8 threads: every byte lands where it belongs, and nothing around it changes."""
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 600_000, size=37).astype(np.int64)  # ~11 MB in all
    src, s = buf_of(int(lens.sum()), seed=9)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
    order = rng.permutation(len(lens))  # destination i holds source row order[i], with gaps
    dst_offs, pos = np.zeros(len(lens), dtype=np.uint64), 0
    for i in order:
        dst_offs[i] = pos
        pos += int(lens[i]) + 4096
    for threads in (1, 2, 3, 8):
        d, da = buf_of(pos)
        da[:] = 0xAB
        E.memcpy_batch(d.address + dst_offs, src.address + offs, lens, threads)
        for i in range(len(lens)):
            o, n = int(dst_offs[i]), int(lens[i])
            assert (da[o:o + n] == s[int(offs[i]):int(offs[i]) + n]).all(), (threads, i)
            assert (da[o + n:o + n + 4096] == 0xAB).all()


def test_auto_falls_back_to_posix_when_uring_is_refused(monkeypatch):
    from tutti_hicache import engine as eng

    real = E.make_engine

    def refuse(kind, *a):
        if kind == "uring":
            raise PermissionError(errno.EPERM, "blocked by seccomp")
        return real(kind, *a)

    monkeypatch.setattr(E, "make_engine", refuse)
    e = eng.open_engine("auto")
    assert e.name == "posix"
    e.close()
    with pytest.raises(PermissionError):
        eng.open_engine("uring")


def test_fallback_reason_tells_a_posix_only_build_from_a_kernel_refusal():
    from tutti_hicache.engine import _fallback_reason

    nosys = OSError(errno.ENOSYS, "no io_uring")
    assert "built without io_uring" in _fallback_reason(nosys, compiled=False)
    assert "kernel refused" in _fallback_reason(nosys, compiled=True)
    assert "built" not in _fallback_reason(nosys, compiled=True)
    assert "seccomp" in _fallback_reason(OSError(errno.EPERM, "blocked"), compiled=True)


def _stream_file(engine, tmp_path, n, sz, seed):
    f = engine.open_file(make_file(tmp_path, n * sz, "s.bin"), True, True)
    src, a = buf_of(n * sz, seed=seed)
    offs = np.arange(n) * sz
    assert (engine.submit("write", np.full(n, f), offs, np.full(n, sz), src.address + offs.astype(np.uint64)) == sz).all()
    return f, a


def test_read_stream_chunks_land_in_order_with_checksums(engine, tmp_path):
    """Five chunks (one empty) allowed two at a time, groups of 3 requests inside chunks: every
    chunk's bytes, results and group checksums equal a plain read's."""
    n, sz = 60, 8192
    f, a = _stream_file(engine, tmp_path, n, sz, 7)
    order = np.random.default_rng(1).permutation(n)  # scattered file offsets
    dst, b = buf_of(n * sz)
    engine.register_buffers([(dst.address, dst.nbytes)])
    chunks = np.array([0, 12, 12, 30, 45, 60])
    groups = np.arange(0, n + 1, 3)
    st = engine.read_stream(np.full(n, f), order * sz, np.full(n, sz),
                            dst.address + np.arange(n, dtype=np.uint64) * sz, chunks, groups)
    assert st.nchunks == 5
    want = E.checksum_groups(a.ctypes.data + (order * sz).astype(np.uint64), np.full(n, sz), groups, 1)
    got_sums = []
    for c in range(5):
        st.allow(c + 2)
        res, sums = st.wait(c)
        assert (res == sz).all() and len(res) == chunks[c + 1] - chunks[c]
        got_sums.append(sums)
        for i in range(chunks[c], chunks[c + 1]):  # the chunk's bytes are final now
            assert (b[i * sz:(i + 1) * sz] == a[order[i] * sz:(order[i] + 1) * sz]).all()
    st.join()
    assert (np.concatenate(got_sums) == want).all()
    engine.register_buffers([])


def test_read_stream_small_groups_are_final_when_each_chunk_is_allowed_only_after_the_last(engine, tmp_path):
    """Checksums go to the pool in tasks of about 1 MiB of groups (GroupChecksums::kTaskBytes);
    what a reap pass leaves below that is sent before the ring waits. Here the owner allows chunk
    c + 1 only after chunk c is final, every group 4 KiB (a chunk never fills a task) and some
    groups 1.5 MiB (one fills a task alone): every chunk still turns final, with the sums of a
    plain checksum over the bytes; a held-back group would leave the owner waiting forever."""
    small, big = 4096, 3 << 19
    sizes = np.array([small] * 40 + [big, small, big] + [small] * 21, dtype=np.int64)
    n, total = len(sizes), int(sizes.sum())
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    f = engine.open_file(make_file(tmp_path, total, "g.bin"), True, True)
    src, a = buf_of(total, seed=21)
    assert (engine.submit("write", np.full(n, f), offs, sizes, src.address + offs.astype(np.uint64)) == sizes).all()
    dst, b = buf_of(total)
    chunks = np.array([0, 8, 16, 40, 44, 64])
    groups = np.concatenate([np.arange(0, 40, 2), [40, 41, 42, 43], np.arange(44, n + 1, 4)])
    st = engine.read_stream(np.full(n, f), offs, sizes, dst.address + offs.astype(np.uint64), chunks, groups)
    want = E.checksum_groups(src.address + offs.astype(np.uint64), sizes, groups, 1)
    got, errors = [], []

    def owner():
        try:
            for c in range(len(chunks) - 1):
                st.allow(c + 1)
                res, sums = st.wait(c)
                assert (res == sizes[chunks[c]:chunks[c + 1]]).all()
                got.append(sums)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a chunk never turned final: a checksum was held back"
    assert not errors, errors
    st.join()
    assert (np.concatenate(got) == want).all() and (b == a).all()


def test_read_stream_submits_nothing_before_allow_and_cancel_ends_it(engine, tmp_path):
    n, sz = 16, 4096
    f, a = _stream_file(engine, tmp_path, n, sz, 8)
    dst, b = buf_of(n * sz)
    before = engine.counters()["bytes"]
    st = engine.read_stream(np.full(n, f), np.arange(n) * sz, np.full(n, sz),
                            dst.address + np.arange(n, dtype=np.uint64) * sz, np.array([0, 8, 16]))
    time.sleep(0.05)
    assert engine.counters()["bytes"] == before and b.max() == 0  # nothing allowed, nothing read
    st.allow(1)
    res, sums = st.wait(0)
    assert (res == sz).all() and len(sums) == 0 and (b[:8 * sz] == a[:8 * sz]).all()
    st.cancel()
    res, _ = st.wait(1)
    assert (res == -errno.ECANCELED).all() and b[8 * sz:].max() == 0
    st.join()


def test_a_file_opens_while_a_read_stream_holds_its_ring(engine, tmp_path):
    """A read stream holds one of the engine's rings for its whole life (a layer-wise load);
    opening a file meanwhile (a writer growing the store, a re-scan) does not wait for it, and
    the new file is read and written through at once; the stream then finishes byte-exact."""
    n, sz = 16, 4096
    f, a = _stream_file(engine, tmp_path, n, sz, 9)
    dst, b = buf_of(n * sz)
    st = engine.read_stream(np.full(n, f), np.arange(n) * sz, np.full(n, sz),
                            dst.address + np.arange(n, dtype=np.uint64) * sz, np.array([0, 8, 16]))
    st.allow(1)
    assert (st.wait(0)[0] == sz).all()  # the stream is running and waits for allow(2)
    opened = []
    t = threading.Thread(target=lambda: opened.append(
        engine.open_file(make_file(tmp_path, 4 * sz, "new.bin"), True, True)), daemon=True)
    t.start()
    t.join(30)
    in_time = bool(opened)
    if not in_time:  # the open waits for the stream's end: let both end, then fail
        st.allow(2)
        t.join(30)
        st.join()
    assert in_time, "open_file waited for the read stream"
    g = opened[0]
    src, sa = buf_of(4 * sz, seed=10)
    out, ob = buf_of(4 * sz)
    offs = np.arange(4) * sz
    assert (engine.submit("write", np.full(4, g), offs, np.full(4, sz), src.address + offs.astype(np.uint64)) == sz).all()
    assert (engine.submit("read", np.full(4, g), offs, np.full(4, sz), out.address + offs.astype(np.uint64)) == sz).all()
    assert (ob == sa).all()
    st.allow(2)
    assert (st.wait(1)[0] == sz).all() and (b == a).all()
    st.join()


def test_read_stream_reports_per_request_errors(engine, tmp_path):
    n, sz = 8, 4096
    f, a = _stream_file(engine, tmp_path, n, sz, 9)
    dst, b = buf_of(n * sz)
    offs = np.arange(n) * sz
    offs[5] = (n + 100) * sz  # past the end of the file
    files = np.full(n, f)
    files[2] = 999  # no such file
    st = engine.read_stream(files, offs, np.full(n, sz), dst.address + np.arange(n, dtype=np.uint64) * sz,
                            np.array([0, 4, 8]), np.arange(0, n + 1, 2))
    st.allow(2)
    r0, s0 = st.wait(0)
    r1, s1 = st.wait(1)
    assert list(r0) == [sz, sz, -errno.EBADF, sz] and r1[1] == -errno.ENODATA
    assert s0[1] == 0 and s1[0] == 0  # groups with a failed request get no checksum
    assert s0[0] != 0 and s1[1] != 0
    st.join()


def test_read_stream_refuses_groups_across_chunks(engine, tmp_path):
    f, _ = _stream_file(engine, tmp_path, 4, 4096, 10)
    dst, _ = buf_of(4 * 4096)
    with pytest.raises(ValueError, match="inside one chunk"):
        engine.read_stream(np.full(4, f), np.arange(4) * 4096, np.full(4, 4096),
                           dst.address + np.arange(4, dtype=np.uint64) * 4096, np.array([0, 2, 4]),
                           np.array([0, 3, 4]))


def _scattered_stream(engine, tmp_path, n_chunks, per, sz, seed):
    """A read stream of n_chunks chunks of `per` requests at scattered file offsets, one checksum
    group per request: (stream, source bytes, destination bytes, file order, chunk starts,
    destination buffer)."""
    n = n_chunks * per
    f, a = _stream_file(engine, tmp_path, n, sz, seed)
    order = np.random.default_rng(seed).permutation(n)
    dst, b = buf_of(n * sz)
    chunks = np.arange(0, n + 1, per)
    st = engine.read_stream(np.full(n, f), order * sz, np.full(n, sz),
                            dst.address + np.arange(n, dtype=np.uint64) * sz, chunks,
                            np.arange(n + 1))
    return st, a, b, order, chunks, dst


def test_read_stream_lands_every_chunk_when_all_are_allowed_up_front(engine, tmp_path):
    """Every chunk allowed at once: each lands with the bytes and checksums of a plain read, and
    each has its completion time."""
    n_chunks, per, sz = 40, 3, 8192
    st, a, b, order, chunks, _dst = _scattered_stream(engine, tmp_path, n_chunks, per, sz, 12)
    st.allow(n_chunks)
    got_sums = []
    for c in range(n_chunks):
        res, sums = st.wait(c)
        assert (res == sz).all() and len(sums) == per
        got_sums.append(sums)
    st.join()
    n = n_chunks * per
    src = a.reshape(n, sz)[order]
    assert (b.reshape(n, sz) == src).all()
    want = E.checksum_groups(a.ctypes.data + (order * sz).astype(np.uint64), np.full(n, sz),
                             np.arange(n + 1), 1)
    assert (np.concatenate(got_sums) == want).all()
    assert (np.asarray(st.done_ns()) > 0).all()


def test_read_stream_cancel_with_every_chunk_allowed_ends_and_keeps_cancel_semantics(engine, tmp_path):
    """cancel() while admitted chunks are still at the devices or queued: the stream ends (no
    hang), every chunk's wait returns, requests that ran hold their bytes, the rest -ECANCELED
    and no bytes."""
    n_chunks, per, sz = 64, 2, 4096
    st, a, b, order, chunks, _dst = _scattered_stream(engine, tmp_path, n_chunks, per, sz, 13)
    st.allow(n_chunks)
    st.wait(2)
    st.cancel()
    joiner = threading.Thread(target=st.join)
    joiner.start()
    joiner.join(60)
    assert not joiner.is_alive(), "a cancelled stream did not end"
    src = a.reshape(-1, sz)[order]
    for c in range(n_chunks):
        res, _ = st.wait(c)
        assert len(res) == per
        for j, r in enumerate(res):
            i = chunks[c] + j
            assert r in (sz, -errno.ECANCELED) and (c > 2 or r == sz)
            assert (b[i * sz:(i + 1) * sz] == (src[i] if r == sz else 0)).all()


def _feed(fifo, nbytes, value):
    """nbytes of `value` into a FIFO the engine holds open (O_RDWR), so opening it never waits."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        assert os.write(fd, bytes([value]) * nbytes) == nbytes
    finally:
        os.close(fd)


def _fifo_stream(engine, tmp_path, n, sz, groups, at=0):
    """n + 1 one-request chunks: chunk `at` reads a FIFO (in flight until the test feeds it), the
    others the n requests of a file in order. (stream, file bytes, destination bytes, FIFO path,
    destination buffer)."""
    f, a = _stream_file(engine, tmp_path, n, sz, 14)
    fifo = str(tmp_path / f"chunk{at}.fifo")
    os.mkfifo(fifo)
    p = engine.open_file(fifo, True, False)  # O_RDWR: the open does not wait for a writer
    files = np.insert(np.full(n, f), at, p)
    offsets = np.insert(np.arange(n) * sz, at, 0)
    dst, b = buf_of((n + 1) * sz)
    st = engine.read_stream(files, offsets, np.full(n + 1, sz),
                            dst.address + np.arange(n + 1, dtype=np.uint64) * sz, np.arange(n + 2),
                            np.arange(n + 2) if groups else None)
    return st, a, b, fifo, dst


def _wait_within(st, c, seconds=30.0):
    """st.wait(c) on a thread: its results, or an assertion when it did not end in time."""
    out = []
    t = threading.Thread(target=lambda: out.append(st.wait(c)), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"chunk {c} did not land within {seconds} s"
    return out[0]


@pytest.mark.parametrize("groups", [False, True], ids=["no-checksums", "checksums"])
@pytest.mark.parametrize("at", [0, 1])
def test_read_stream_chunks_past_an_unfinished_one_still_land(engine, tmp_path, at, groups):
    """Chunk `at` reads a FIFO, so it stays in flight until the test writes into it, and every
    chunk is allowed up front: every other chunk lands first (a chunk in flight holds nothing
    back), then chunk `at` once fed. io_uring only: preadv refuses a FIFO (ESPIPE)."""
    if engine.name != "uring":
        pytest.skip("the POSIX engine's preadv cannot read a FIFO")
    n, sz = 8, 4096
    st, a, b, fifo, _dst = _fifo_stream(engine, tmp_path, n, sz, groups, at)
    try:
        st.allow(n + 1)
        for c in range(n + 1):
            if c != at:
                res, _ = _wait_within(st, c)
                assert (res == sz).all()
        assert st.done_ns()[at] == 0
    finally:
        _feed(fifo, sz, 7)  # chunk `at` lands (also when an assertion failed: nothing hangs)
    res, _ = _wait_within(st, at)
    assert (res == sz).all()
    st.join()
    got = b.reshape(n + 1, sz)
    assert (got[at] == 7).all() and (np.delete(got, at, axis=0) == a.reshape(n, sz)).all()


@pytest.mark.parametrize("groups", [False, True], ids=["no-checksums", "checksums"])
@pytest.mark.parametrize("zero_at", [0, 1])
def test_a_chunk_whole_at_plan_time_is_final_while_another_is_in_flight(engine, tmp_path, zero_at, groups):
    """A chunk of one zero-byte request (its checksum group whole before any I/O) and a chunk
    reading a FIFO (in flight until fed), both allowed: the zero-byte chunk turns final at once,
    in either order. Its group's checksum must go to the pool before the ring waits, not after
    the first completion (GroupChecksums holds whole groups back to batch them)."""
    if engine.name != "uring":
        pytest.skip("the POSIX engine's preadv cannot read a FIFO")
    fifo = str(tmp_path / "z.fifo")
    os.mkfifo(fifo)
    p = engine.open_file(fifo, True, False)
    dst, b = buf_of(2 * 4096)
    sizes = np.array([0, 4096]) if zero_at == 0 else np.array([4096, 0])
    st = engine.read_stream(np.array([p, p]), np.array([0, 0]), sizes,
                            dst.address + np.array([0, 4096], dtype=np.uint64), np.array([0, 1, 2]),
                            np.array([0, 1, 2]) if groups else None)
    try:
        st.allow(2)
        end = time.time() + 10
        while not st.final(zero_at) and time.time() < end:
            time.sleep(0.005)
        assert st.final(zero_at) and not st.final(1 - zero_at)
    finally:
        _feed(fifo, 4096, 7)  # the FIFO chunk lands (also when an assertion failed)
    res, _ = _wait_within(st, 1 - zero_at)
    assert (res == 4096).all()
    st.join()
    assert (b[4096 * (1 - zero_at):][:4096] == 7).all()


def test_a_second_write_batch_runs_while_the_first_is_still_in_flight(engine, tmp_path):
    """Two writers at once (the linker's chunk writers): the first batch writes into a full FIFO,
    so it stays in flight until the test drains it, and a second batch on another file still
    completes meanwhile (its own write ring), byte-exact; then the first one lands too. io_uring
    only: pwritev refuses a FIFO's offset (ESPIPE)."""
    if engine.name != "uring":
        pytest.skip("the write rings are the io_uring engine's")
    e = engine
    fifo = str(tmp_path / "w.fifo")
    os.mkfifo(fifo)
    p = e.open_file(fifo, True, False)
    ours = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    sz, first, second = 4096, [], []
    try:
        while True:  # fill the pipe: the engine's write then waits for a reader
            try:
                os.write(ours, b"x" * 65536)
            except BlockingIOError:
                break
        src, _ = buf_of(sz, seed=3)
        f = e.open_file(make_file(tmp_path, 8 * sz, "other.bin"), True, True)
        t1 = threading.Thread(target=lambda: first.append(
            e.submit("write", np.full(1, p), np.zeros(1), np.full(1, sz), np.full(1, src.address))),
            daemon=True)
        t1.start()
        time.sleep(0.2)
        assert not first, "the FIFO write should wait for a reader"
        mem, a = buf_of(8 * sz, seed=4)
        t2 = threading.Thread(target=lambda: second.append(e.submit(
            "write", np.full(8, f), np.arange(8) * sz, np.full(8, sz), mem.address + np.arange(8) * sz)),
            daemon=True)
        t2.start()
        t2.join(10)
        assert second and (second[0] == sz).all(), "the second batch waited behind the first"
        assert not first
        back, b = buf_of(8 * sz)
        assert (e.submit("read", np.full(8, f), np.arange(8) * sz, np.full(8, sz),
                         back.address + np.arange(8) * sz) == sz).all() and (a == b).all()
    finally:
        deadline = time.monotonic() + 10
        while t1.is_alive() and time.monotonic() < deadline:  # drain: the first write lands
            try:
                os.read(ours, 1 << 20)
            except BlockingIOError:
                time.sleep(0.01)
        t1.join(10)
        os.close(ours)
    assert first and (first[0] == sz).all()


@pytest.mark.skipif(not E.uring_compiled(), reason="the byte cap is the io_uring engine's")
def test_inflight_byte_cap_bounds_what_a_ring_submits(tmp_path):
    """read/write_inflight_bytes: with a cap of one operation's bytes the ring submits one at a
    time (one io_uring_enter per operation), without it the whole batch in one enter; the bytes
    are the same either way."""
    n, sz = 16, 64 << 10
    offsets = np.arange(n) * 2 * sz  # gaps: no two requests coalesce
    src, a = buf_of(n * sz, seed=5)
    for cap, enters in ((sz, n), (0, 1)):
        try:
            e = open_engine("uring", 64, 2, read_inflight_bytes=cap, write_inflight_bytes=cap)
        except OSError as exc:
            pytest.skip(f"uring engine unavailable here: {exc}")
        f = e.open_file(make_file(tmp_path, 2 * n * sz, f"cap{cap}.bin"), True, True)
        dst, b = buf_of(n * sz)
        for op, mem in (("write", src), ("read", dst)):
            before = e.counters()["enter_calls"]
            res = e.submit(op, np.full(n, f), offsets, np.full(n, sz), mem.address + np.arange(n) * sz)
            assert (res == sz).all()
            assert e.counters()["enter_calls"] - before == enters
        assert (a == b).all()
        e.close()


# ------------------------------------------------------------------ rings, registration, joins
def _within(fn, seconds=10.0):
    """fn() on a daemon thread: its result, or an assertion when it did not return in time."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    return out[0]


def test_streams_waiting_for_their_first_chunk_hold_no_read_ring(engine, tmp_path):
    """Two read streams opened and not yet allowed (io_uring has two read rings): a plain read,
    a third stream, a buffer registration still run (a stream used to take its ring at once)."""
    f, a = _stream_file(engine, tmp_path, 4, 4096, 21)
    dst, b = buf_of(4 * 4096)

    def stream(i):
        return engine.read_stream(np.array([f]), np.array([i * 4096]), np.array([4096]),
                                  np.array([dst.address + i * 4096], dtype=np.uint64), np.array([0, 1]))
    idle = [stream(0), stream(1)]
    try:
        assert _within(lambda: engine.submit("read", np.array([f]), np.array([2 * 4096]), np.array([4096]),
                                             np.array([dst.address + 2 * 4096], dtype=np.uint64)))[0] == 4096
        third = stream(3)
        third.allow(1)
        assert _within(lambda: third.wait(0))[0][0] == 4096
        third.join()
        assert _within(lambda: engine.register_buffers([(dst.address, 4 * 4096)])) >= 0
    finally:
        for s in idle:
            s.allow(1)
            s.join()
    assert (b == a).all()


def test_a_stream_joined_from_two_threads_returns_in_both(engine, tmp_path):
    f, _ = _stream_file(engine, tmp_path, 2, 4096, 22)
    dst, _ = buf_of(2 * 4096)
    for _ in range(20):
        st = engine.read_stream(np.array([f, f]), np.array([0, 4096]), np.array([4096, 4096]),
                                dst.address + np.arange(2, dtype=np.uint64) * 4096, np.array([0, 1, 2]))
        st.allow(2)
        ts = [threading.Thread(target=st.join, daemon=True) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        assert not any(t.is_alive() for t in ts)


def test_reads_while_buffers_are_registered_again_never_fail(engine, tmp_path):
    """register_buffers on one thread, reads into the registered memory on another: every read
    whole and exact (a read planned with one ring's old buffer index failed with -EFAULT)."""
    f, a = _stream_file(engine, tmp_path, 16, 4096, 23)
    r1, b1 = buf_of(16 * 4096)
    r2, _ = buf_of(16 * 4096)
    stop, bad, n = time.time() + 1.0, [], [0]

    def register():
        i = 0
        while time.time() < stop:
            regions = [(r1.address, 16 * 4096), (r2.address, 16 * 4096)]
            engine.register_buffers(regions[::-1] if i % 2 else regions)
            i += 1

    def read():
        while time.time() < stop:
            b1[:] = 0
            res = engine.submit("read", np.full(16, f), np.arange(16) * 4096, np.full(16, 4096),
                                r1.address + np.arange(16, dtype=np.uint64) * 4096)
            n[0] += 1
            if not (res == 4096).all() or not (b1 == a).all():
                bad.append(res.tolist())
    ts = [threading.Thread(target=register), threading.Thread(target=read)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert n[0] and not bad, bad[:3]


def test_a_chunk_allowed_while_the_oldest_is_in_flight_goes_out_at_once(engine, tmp_path):
    """Chunk 0 is two reads of a FIFO (in flight until fed); chunk 1, allowed afterwards, must
    reach the device then, not once chunk 0 landed (the wait for chunk 0 counted the wake-up as
    one of its two completions). io_uring only: preadv refuses a FIFO."""
    if engine.name != "uring":
        pytest.skip("the POSIX engine's preadv cannot read a FIFO")
    f, a = _stream_file(engine, tmp_path, 1, 4096, 24)
    fifo = str(tmp_path / "two.fifo")
    os.mkfifo(fifo)
    p = engine.open_file(fifo, True, False)
    dst, b = buf_of(3 * 4096)
    st = engine.read_stream(np.array([p, p, f]), np.array([0, 0, 0]), np.full(3, 4096),
                            dst.address + np.arange(3, dtype=np.uint64) * 4096, np.array([0, 2, 3]))
    try:
        st.allow(1)
        time.sleep(0.2)
        st.allow(2)
        end = time.time() + 10
        while not (b[2 * 4096:] == a).all() and time.time() < end:
            time.sleep(0.01)
        assert (b[2 * 4096:] == a).all(), "chunk 1 did not go out while chunk 0 was in flight"
    finally:
        _feed(fifo, 2 * 4096, 9)
    st.join()
