"""The io_uring engine when the kernel refuses an io_uring_enter (not EINTR, EAGAIN or EBUSY):
no operation may stay with the kernel once the batch or stream that queued it has returned.
Before, the error was thrown out of the ring's loop with reads still in flight and one still in
the submission queue; the next batch on that ring reaped those completions as its own (requests
reported whole before their bytes landed, checksums over bytes not there yet, a hang), and the
kernel wrote into the first batch's memory after it had returned.

The failure is injected with a seccomp filter (irreversible for a process, so each case runs in
a child): io_uring_enter fails with ENOMEM when it submits exactly one entry and waits for
fewer than three, the pattern of a batch topping its ring up with one request. Waiting without
submitting is never refused. And close() returns while a read stream waits for its owner's
allow() (it used to wait for that stream forever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tutti_hicache.engine import extension, open_engine

E = extension()


CHILD = r'''
import ctypes, json, os, struct, sys, threading
import numpy as np
from tutti_hicache.engine import extension, open_engine
E = extension()
SZ = 4096
d = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)

def refuse_single_submits():
    def stmt(code, k): return struct.pack("HBBI", code, 0, 0, k)
    def jump(code, k, jt, jf): return struct.pack("HBBI", code, jt, jf, k)
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    prog = b"".join([
        stmt(LD, 0), jump(JEQ, 426, 0, 5),          # nr == io_uring_enter
        stmt(LD, 24), jump(JEQ, 1, 0, 3),           # to_submit == 1
        stmt(LD, 32), jump(JGE, 3, 1, 0),           # min_complete < 3
        stmt(RET, 0x00050000 | 12),                 # ERRNO(ENOMEM)
        stmt(RET, 0x7fff0000)])                     # ALLOW
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fp = Fprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fp), 0, 0) != 0:
        print(json.dumps({"skip": f"seccomp refused: errno {ctypes.get_errno()}"})); sys.exit(0)

path = os.path.join(d, "f.bin")
data = np.random.default_rng(1).integers(1, 256, 64 * SZ, dtype=np.uint8)
data.tofile(path)
e = open_engine("uring", queue_depth=8, threads=2)
f = e.open_file(path, False, False)
fifo = os.path.join(d, "q.fifo")
os.mkfifo(fifo)
q = e.open_file(fifo, True, False)

def checksum(chunk):
    a = np.ascontiguousarray(chunk)
    return int(E.checksum_groups(np.array([a.ctypes.data], np.uint64), np.array([len(a)]),
                                 np.array([0, 1]))[0])

def batch(offsets, fifo_at=None, timeout=20):
    """One verified read (a group per request) of file pages at offsets, the FIFO at fifo_at;
    per request: (result, landed = the bytes are the file's, sum right); "hung", or the error."""
    n = len(offsets) + (fifo_at is not None)
    files, offs, want = [], [], []
    it = iter(offsets)
    for i in range(n):
        if i == fifo_at:
            files.append(q); offs.append(0); want.append(None)
        else:
            o = next(it); files.append(f); offs.append(o * SZ); want.append(data[o * SZ:(o + 1) * SZ])
    dst = E.AlignedBuffer(n * SZ); b = np.frombuffer(dst, np.uint8)
    out = []
    def run():
        try:
            out.append(e.submit("read", np.array(files), np.array(offs), np.full(n, SZ),
                                dst.address + np.arange(n, dtype=np.uint64) * SZ, np.arange(n + 1)))
        except OSError as ex:
            out.append(repr(ex))
    t = threading.Thread(target=run, daemon=True)
    t.start(); t.join(timeout)
    if t.is_alive():
        return "hung", b
    if isinstance(out[0], str):
        return out[0], b
    res, sums = out[0]
    rows = []
    for i in range(n):
        got = b[i * SZ:(i + 1) * SZ].copy()
        ok = want[i] is not None and (got == want[i]).all()
        rows.append([int(res[i]), bool(ok), bool(want[i] is not None and int(sums[i]) == checksum(want[i]))])
    return rows, b

refuse_single_submits()
report = {}
# 1: eight file reads fill the ring (depth 8), the ninth (the FIFO, fed only later) tops it up
#    with a single submission: refused. Whatever was in flight lands before the call returns.
rows1, b1 = batch(list(range(0, 16, 2)), fifo_at=8)
report["first"] = rows1
snap = b1[8 * SZ:9 * SZ].copy()
w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # a reader never came back for these bytes
try:
    os.write(w, bytes([7]) * SZ)
except BlockingIOError:
    pass
# 2 and 3: the same ring again (the first free read ring), file reads only
report["second"], _ = batch([1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21])
report["third"], _ = batch([30, 33, 36])  # three ops: submitted together, never refused
import time; time.sleep(0.2)
report["fifo_slot_written_after_return"] = bool((b1[8 * SZ:9 * SZ] != snap).any())
report["counters"] = e.counters()
print(json.dumps(report), flush=True)
e.close()  # waits for every batch: one left running would hold it
print("closed", flush=True)
'''


def _child(tmp_path):
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                             timeout=150)
    except subprocess.TimeoutExpired as ex:
        pytest.fail(f"the child hung; it printed: {(ex.stdout or b'')[-2000:]!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rep = json.loads(lines[0])
    if "skip" in rep:
        pytest.skip(rep["skip"])
    rep["closed"] = lines[-1] == "closed"
    return rep, out.stderr


@pytest.mark.skipif(not E.uring_compiled(), reason="the io_uring engine's")
def test_a_refused_enter_ends_the_batch_without_leaving_reads_with_the_kernel(tmp_path):
    rep, err = _child(tmp_path)
    assert rep.get("closed"), "close() did not return"
    first = rep["first"]
    assert isinstance(first, list), f"the batch whose enter was refused: {first}"
    assert first[8][0] == -12, f"the injected failure did not hit: {first[8]}"  # the FIFO: ENOMEM
    assert "io_uring_submit_and_wait failed" in err
    for name in ("first", "second", "third"):
        rows = rep[name]
        assert isinstance(rows, list), f"{name} batch: {rows}"
        for i, (res, landed, right_sum) in enumerate(rows):
            # a request reported whole holds the file's bytes and their checksum; others failed
            assert res < 0 or (res == 4096 and landed and right_sum), (name, i, res, landed, right_sum)
    assert all(res == 4096 for res, _, _ in first[:8])  # in flight when refused: they landed
    assert all(res == 4096 for res, _, _ in rep["third"]), rep
    assert not rep["fifo_slot_written_after_return"]


def test_close_cancels_a_stream_that_waits_for_its_owner(tmp_path):
    """A stream allowed one of its two chunks holds the engine's life while it waits for the
    next allow(): close() cancels it and returns, on the io_uring engine as on the POSIX one."""
    for kind in ("uring", "posix") if E.uring_compiled() else ("posix",):
        e = open_engine(kind, queue_depth=8, threads=2)
        path = tmp_path / f"{kind}.bin"
        path.write_bytes(os.urandom(8 * 4096))
        f = e.open_file(str(path), False, False)
        dst = E.AlignedBuffer(8 * 4096)
        st = e.read_stream(np.full(8, f), np.arange(8) * 4096, np.full(8, 4096),
                           dst.address + np.arange(8, dtype=np.uint64) * 4096, np.array([0, 4, 8]))
        st.allow(1)
        res, _ = st.wait(0)
        assert (res == 4096).all()
        t = threading.Thread(target=e.close, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(10)
        assert not t.is_alive(), f"{kind}: close() waited for a stream its owner had not finished"
        assert time.monotonic() - t0 < 10
        res, _ = st.wait(1)  # the cancelled chunk is final, never read
        assert (res < 0).all()
        with pytest.raises(ValueError, match="engine is closed"):
            e.read_stream(np.full(1, f), np.zeros(1), np.full(1, 4096), np.array([dst.address], np.uint64),
                          np.array([0, 1]))


def test_a_verified_read_refuses_an_empty_checksum_group(tmp_path):
    """submit() with a group of no requests: refused up front (as read streams refuse it); it
    used to come back with sum 0, "a request failed", where checksum_groups() gives the hash of
    nothing for the same group."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8192))
    for kind in ("uring", "posix") if E.uring_compiled() else ("posix",):
        e = open_engine(kind, queue_depth=8, threads=2)
        f = e.open_file(str(path), False, False)
        dst = E.AlignedBuffer(8192)
        addrs = dst.address + np.array([0, 4096], dtype=np.uint64)
        with pytest.raises(ValueError, match="non-empty"):
            e.submit("read", np.array([f, f]), np.array([0, 4096]), np.full(2, 4096), addrs, np.array([0, 1, 1, 2]))
        res, sums = e.submit("read", np.array([f, f]), np.array([0, 4096]), np.full(2, 4096), addrs,
                             np.array([0, 1, 2]))
        assert (res == 4096).all() and (sums == E.checksum_groups(addrs, np.full(2, 4096), np.array([0, 1, 2]))).all()
        e.close()
