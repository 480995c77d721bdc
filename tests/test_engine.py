"""The engine contract, run against every available engine on ext4 and on /dev/shm."""

import errno
import os
import threading

import numpy as np
import pytest

from tutti_hicache.engine import extension, open_engine, probe_o_direct

E = extension()
KINDS = [("uring", True), ("uring", False), ("posix", True)] if E.uring_compiled() else [("posix", True)]


@pytest.fixture(params=KINDS, ids=lambda k: f"{k[0]}-{'vectored' if k[1] else 'fixed'}")
def engine(request):
    kind, vectored = request.param
    try:
        e = open_engine(kind, queue_depth=64, vectored=vectored, threads=4)
    except OSError as exc:
        pytest.skip(f"{kind} engine unavailable here: {exc}")
    yield e
    e.close()


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
    w = engine.write(np.full(n, f), np.arange(n) * sz, np.full(n, sz), src.address + perm * sz)
    assert (w == sz).all()
    dst, b = buf_of(n * sz)
    r = engine.read(np.full(n, f), np.arange(n) * sz, np.full(n, sz), dst.address + np.arange(n) * sz)
    assert (r == sz).all()
    assert (b.reshape(n, sz) == a.reshape(n, sz)[perm]).all()
    c = engine.counters()
    assert c["errors"] == 0 and c["bytes"] == 2 * n * sz and c["requests"] == 2 * n


def test_file_contiguous_requests_coalesce(engine, tmp_path):
    n, sz = 64, 4096
    f = engine.open_file(make_file(tmp_path, n * sz), True, True)
    b, _ = buf_of(n * sz, seed=3)
    before = engine.counters()
    r = engine.read(np.full(n, f), np.arange(n) * sz, np.full(n, sz), b.address + np.arange(n)[::-1] * sz)
    assert (r == sz).all()
    after = engine.counters()
    subs = after["submissions"] - before["submissions"]
    if engine.name == "uring":
        assert after["enter_calls"] - before["enter_calls"] == 1
    # vectored: one READV for the whole run; fixed: one per memory-contiguous piece
    assert subs in (1, n)


def test_bad_requests_are_per_request_errors(engine, tmp_path):
    f = engine.open_file(make_file(tmp_path, 1 << 16), True, True)
    b, _ = buf_of(1 << 16)
    r = engine.read(np.array([f, 1000, f, f, f]), np.array([0, 0, -4096, 1 << 16, 4096]),
                    np.array([4096, 4096, 4096, 4096, 4096]),
                    np.array([b.address] * 5, dtype=np.uint64))
    assert r[0] == 4096 and r[4] == 4096
    assert r[1] == -errno.EBADF and r[2] == -errno.EINVAL
    assert r[3] == -errno.ENODATA  # past the end of the file


def test_misaligned_o_direct_is_a_clean_result(engine, tmp_path):
    """Whether O_DIRECT accepts an odd address depends on the device's DMA alignment (kernel
    6.x relaxed it); either way the request completes whole or fails with -EINVAL."""
    f = engine.open_file(make_file(tmp_path, 1 << 16), True, True)
    b, _ = buf_of(1 << 16)
    r = engine.read(np.array([f]), np.array([0]), np.array([4096]), np.array([b.address + 1], dtype=np.uint64))
    assert r[0] in (4096, -errno.EINVAL)


def test_errors_are_oserror_with_file(engine):
    with pytest.raises(FileNotFoundError) as ei:
        engine.open_file("/nonexistent/tutti", False, True)
    assert ei.value.filename == "/nonexistent/tutti" and ei.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="same length"):
        engine.read(np.array([0]), np.array([0, 1]), np.array([1]), np.array([1], dtype=np.uint64))


def test_registered_buffers_and_large_batches(engine, tmp_path):
    """More requests than the queue depth: all complete; io_uring stays within 2 + n/depth enters."""
    n, sz = 500, 4096
    f = engine.open_file(make_file(tmp_path, 2 * n * sz), True, True)
    b, a = buf_of(n * sz, seed=4)
    engine.register_buffers([(b.address, b.nbytes)])
    offs = np.arange(n) * 2 * sz  # gaps: nothing coalesces
    assert (engine.write(np.full(n, f), offs, np.full(n, sz), b.address + np.arange(n) * sz) == sz).all()
    a[:] = 0
    before = engine.counters()
    assert (engine.read(np.full(n, f), offs, np.full(n, sz), b.address + np.arange(n) * sz) == sz).all()
    after = engine.counters()
    assert a.min() > 0
    if engine.name == "uring":
        assert after["enter_calls"] - before["enter_calls"] <= 2 + n / 64
    engine.unregister_buffers()


def test_reads_and_writes_from_two_threads(engine, tmp_path):
    n, sz = 256, 4096
    fr = engine.open_file(make_file(tmp_path, n * sz, "r.bin"), True, True)
    fw = engine.open_file(make_file(tmp_path, n * sz, "w.bin"), True, True)
    src, a = buf_of(n * sz, seed=5)
    assert (engine.write(np.full(n, fr), np.arange(n) * sz, np.full(n, sz), src.address + np.arange(n) * sz) == sz).all()
    errors = []

    def loop(op, f, buf):
        for _ in range(20):
            r = op(np.full(n, f), np.arange(n) * sz, np.full(n, sz), buf.address + np.arange(n) * sz)
            if not (r == sz).all():
                errors.append(r)

    dst, b = buf_of(n * sz)
    ts = [threading.Thread(target=loop, args=(engine.read, fr, dst)),
          threading.Thread(target=loop, args=(engine.write, fw, src))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and (a == b).all()


def test_closed_engine_refuses(tmp_path):
    e = open_engine("posix")
    e.close()
    e.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        e.read(np.array([0]), np.array([0]), np.array([4096]), np.array([4096], dtype=np.uint64))


def test_checksums_and_memcpy():
    b, a = buf_of(3 * 4096, seed=6)
    addr = np.array([b.address, b.address + 4096, b.address + 8192], dtype=np.uint64)
    lens = np.array([4096, 4096, 4096])
    g = E.checksum_groups(addr, lens, np.array([0, 1, 3]))
    assert g[0] == E.checksum(a[:4096]) and g[1] == E.checksum(a[4096:])
    d, da = buf_of(3 * 4096)
    E.memcpy_batch(d.address + np.array([8192, 0, 4096], dtype=np.uint64), addr, lens)
    assert (da[8192:] == a[:4096]).all() and (da[:4096] == a[4096:8192]).all()
    with pytest.raises(ValueError):
        E.checksum_groups(addr, lens, np.array([0, 5]))


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
