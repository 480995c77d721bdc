"""Scheduler policy: scripted sequences with exact dispatch orders (pure, no threads), then the
Gate with real threads."""

import threading
import time


from tutti_hicache.store.scheduler import Gate, Policy

MB = 1 << 20


def policy(**kw):
    base = dict(write_bw=100 * MB, default_window=0.01, min_chunk=MB, max_backlog=64 * MB,
                max_write_wait=0.5)
    base.update(kw)
    return Policy(**base)


def test_write_runs_in_window_sized_chunks_when_idle():
    p = policy()  # 10 ms at 100 MB/s -> ~1 MB chunks
    assert p.write_arrives(1, {0}, 3 * MB, now=0.0)
    c1 = p.next_write(0.0)
    assert (c1.write_id, c1.index, c1.nbytes, c1.last) == (1, 0, p.chunk_bytes(), False)
    assert p.next_write(0.0) is None  # one chunk in flight per device
    p.chunk_done(c1, 0.01, 0.01)
    chunks = []
    while p.writes or p.inflight:
        c = p.next_write(1.0)
        chunks.append(c.nbytes)
        p.chunk_done(c, 1.0, 0.0)
    assert sum(chunks) + c1.nbytes == 3 * MB and p.backlog == 0


def test_idle_devices_get_full_queue_chunks_until_a_read_comes():
    """idle_chunk (what the device queues hold) on devices without a read for idle_after s and
    without a lent window; window-sized chunks right after a read, and inside a lent window."""
    p = policy(idle_chunk=8 * MB, idle_after=0.2)
    assert p.write_arrives(1, {0, 1}, 64 * MB, now=0.0)
    c = p.next_write(0.0)  # never a read: idle from the start
    assert c.nbytes == 8 * MB
    p.chunk_done(c, 0.0, 0.0)
    p.read_arrives("r", {1})
    p.read_starts("r")
    assert p.next_write(0.0) is None  # device 1 is reading
    p.read_done("r", now=1.0)
    c = p.next_write(1.1)  # 0.1 s after the read on device 1: one window's bytes
    assert c.nbytes == p.chunk_bytes() == MB
    p.chunk_done(c, 1.1, 0.0)
    c = p.next_write(1.25)  # idle_after since the read: full queue again
    assert c.nbytes == 8 * MB
    p.chunk_done(c, 1.25, 0.0)
    p.set_window(0.01)  # a lent window bounds the chunk whatever the quiet
    c = p.next_write(5.0)
    assert c.nbytes == MB
    p.chunk_done(c, 5.0, 0.0)
    p.set_window(None)
    other = policy(idle_chunk=8 * MB, idle_after=0.2)
    other.write_arrives(2, {0}, 64 * MB, now=0.0)
    other.read_arrives("r", {1})
    other.read_starts("r")
    other.read_done("r", now=1.0)  # a read on another device leaves device 0 idle
    assert other.next_write(1.05).nbytes == 8 * MB


def test_on_idle_devices_a_younger_write_joins_the_chunks_in_flight_within_idle_chunk():
    """Rule 3's exception: two writers on idle devices keep the queue full. A younger write's
    chunk joins an older one's last chunk while their bytes fit idle_chunk (then no more); not
    while the older write still has chunks to issue, not after a recent read, not inside a lent
    window; a read waits for every chunk in flight; shared chunks give no bandwidth sample."""
    p = policy(idle_chunk=8 * MB, idle_after=0.2)
    for wid in (1, 2, 3):
        assert p.write_arrives(wid, {0, 1}, 4 * MB, now=0.0)
    a = p.next_write(0.0)
    b = p.next_write(0.0)
    assert (a.write_id, a.nbytes, a.last) == (1, 4 * MB, True) and (b.write_id, b.nbytes) == (2, 4 * MB)
    assert p.next_write(0.0) is None  # 8 MB in flight: no room for write 3
    p.read_arrives("r", {1})
    assert not p.read_may_start("r", 0.0)
    bw = p.write_bw
    p.chunk_done(a, 0.05, 0.05)
    assert not p.read_may_start("r", 0.05)  # write 2's chunk is still in flight there
    p.chunk_done(b, 0.06, 0.06)
    assert p.write_bw == bw and not p.shared  # shared chunks: no sample
    assert p.read_may_start("r", 0.06)
    p.read_starts("r")
    p.read_done("r", now=0.1)
    c = p.next_write(0.2)  # 0.1 s after the read: window-sized, and nothing joins it
    assert c.write_id == 3 and c.nbytes == MB
    assert p.next_write(0.2) is None
    p.chunk_done(c, 0.2, 0.0)

    q = policy(idle_chunk=8 * MB, idle_after=0.2)
    q.write_arrives(1, {0}, 12 * MB, now=0.0)  # older write with chunks still to issue
    q.write_arrives(2, {0}, 2 * MB, now=0.0)
    first = q.next_write(0.0)
    assert first.nbytes == 8 * MB and q.next_write(0.0) is None
    q.chunk_done(first, 0.01, 0.01)
    last = q.next_write(0.01)
    assert (last.write_id, last.nbytes, last.last) == (1, 4 * MB, True)
    joined = q.next_write(0.01)  # 4 MB of room: write 2 (2 MB) joins
    assert (joined.write_id, joined.nbytes) == (2, 2 * MB)
    q.chunk_done(last, 0.02, 0.01)
    q.chunk_done(joined, 0.02, 0.01)
    assert not q.inflight and q.backlog == 0

    own = policy(idle_chunk=8 * MB, idle_after=0.2, default_window=0.01)
    own.write_arrives(1, {0}, 6 * MB, now=0.0)
    own.read_arrives("r", {0})
    own.read_starts("r")
    own.read_done("r", now=0.0)
    small = own.next_write(0.05)  # right after a read: one window's bytes
    assert small.nbytes == MB
    assert own.next_write(0.5) is None  # idle by now, but a write never joins its own chunk

    r = policy(idle_chunk=8 * MB, idle_after=0.2)
    r.write_arrives(1, {0}, 4 * MB, now=0.0)
    r.write_arrives(2, {0}, 4 * MB, now=0.0)
    r.set_window(0.5)  # a lent window: one chunk per device, as before
    assert r.next_write(0.0).write_id == 1 and r.next_write(0.0) is None


def test_reads_first_and_never_together_with_writes():
    p = policy()
    p.write_arrives(1, {0}, 4 * MB, 0.0)
    p.read_arrives("r1", {0})
    assert p.read_may_start("r1", 0.0)
    assert p.next_write(0.0) is None  # a read is pending on device 0
    p.read_starts("r1")
    assert p.next_write(0.0) is None  # ... and in flight
    p.read_done("r1")
    c = p.next_write(0.0)
    assert c is not None
    p.read_arrives("r2", {0})
    assert not p.read_may_start("r2", 0.0)  # waits for the one chunk in flight, not the backlog
    p.chunk_done(c, 0.01, 0.01)
    assert p.read_may_start("r2", 0.01) and p.next_write(0.01) is None


def test_other_devices_proceed_independently():
    p = policy()
    p.write_arrives(1, {1}, 2 * MB, 0.0)
    p.read_arrives("r", {0})
    p.read_starts("r")
    c = p.next_write(0.0)
    assert c is not None and c.devices == {1}  # device 1 is free of reads


def test_older_write_is_not_overtaken_on_a_device():
    p = policy()
    p.write_arrives(1, {0, 1}, MB, 0.0)
    p.write_arrives(2, {1}, MB, 0.0)
    p.read_arrives("r", {0})
    assert p.next_write(0.0) is None  # write 1 blocked by the read; write 2 may not pass it on 1
    p.read_done("r")
    assert p.next_write(0.0).write_id == 1


def test_floor_lets_a_starving_write_through_steady_reads():
    p = policy(max_write_wait=0.5)
    p.write_arrives(1, {0}, MB, now=0.0)
    p.read_arrives("a", {0})
    p.read_starts("a")
    p.read_arrives("b", {0})  # a steady stream: always one pending, one in flight
    assert p.next_write(0.4) is None
    assert not p.starving(0.4) and p.starving(0.6)
    assert p.next_write(0.6) is None  # read "a" still in flight
    p.read_done("a")
    assert not p.read_may_start("b", 0.6)  # new/pending reads wait for the floor chunk
    c = p.next_write(0.6)
    assert c is not None
    p.chunk_done(c, 0.61, 0.01)
    assert p.read_may_start("b", 0.61)


def test_backlog_bound_refuses_at_once():
    p = policy(max_backlog=4 * MB)
    assert p.write_arrives(1, {0}, 3 * MB, 0.0)
    assert not p.write_arrives(2, {0}, 2 * MB, 0.0)
    assert p.backlog == 3 * MB


def test_chunks_are_whole_units_and_window_from_the_slack_table():
    p = policy(min_chunk=1)
    p.set_window(0.025)  # 2.5 MB at 100 MB/s
    p.write_arrives(1, {0}, 10 * MB, 0.0, unit=MB)
    c = p.next_write(0.0)
    assert c.nbytes == 2 * MB  # rounded down to whole units
    p.set_window(None)
    assert p.chunk_bytes() == int(0.01 * 100 * MB)


def test_bandwidth_estimate_follows_completed_chunks():
    p = policy(write_bw=100 * MB)
    p.write_arrives(1, {0}, 8 * MB, 0.0)
    c = p.next_write(0.0)
    p.chunk_done(c, 1.0, c.nbytes / (400 * MB))
    assert 100 * MB < p.write_bw < 400 * MB


def test_gate_read_waits_for_one_chunk_only():
    g = Gate(policy(default_window=0.05, write_bw=20 * MB))
    order, first_held = [], threading.Event()

    def run(off, n):
        order.append(("w", off))
        if len(order) == 1:
            assert first_held.wait(30)  # in flight until the read waits for it
        time.sleep(0.05)

    def read():
        with g.reading({0}):
            order.append(("r", None))
    t = threading.Thread(target=g.write, args=({0}, 4 * MB, run))
    t.start()
    while not order:
        time.sleep(0.001)
    r = threading.Thread(target=read)
    r.start()
    deadline = time.monotonic() + 30
    while g.stats["read_waits"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    first_held.set()
    t.join()
    r.join()
    kinds = [k for k, _ in order]
    # the read went in after the chunk in flight, ahead of the rest of the 4 MB write
    assert kinds[0] == "w" and "r" in kinds and kinds.index("r") <= 2 and len(kinds) > 3


def test_gate_runs_two_writers_together_on_idle_devices_and_a_read_waits_for_both():
    """Two writer threads, each a write that fits idle_chunk with the other: both are inside their
    chunk at once (the linker's two chunk writers); a read arriving meanwhile starts only after
    both chunks ended; a third writer that would exceed idle_chunk waits for a chunk to end."""
    g = Gate(policy(idle_chunk=8 * MB, idle_after=0.2))
    inside, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()
    ends, read_at = [], []

    def run(off, n):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        release.wait(10)
        with lock:
            inside[0] -= 1
            ends.append(time.monotonic())

    writers = [threading.Thread(target=g.write, args=({0, 1}, 4 * MB, run)) for _ in range(3)]
    for t in writers:
        t.start()
    deadline = time.monotonic() + 10
    while peak[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # time for a third chunk to start, were it (wrongly) let in

    def reader():
        with g.reading({1}):
            read_at.append(time.monotonic())

    r = threading.Thread(target=reader)
    r.start()
    time.sleep(0.05)
    assert peak[0] == 2 and not read_at  # two at once, not three; the read waits
    release.set()
    for t in writers + [r]:
        t.join(10)
    assert len(ends) >= 3 and len(read_at) == 1  # the third write runs in window chunks after the read
    assert read_at[0] >= ends[1]  # after both chunks that were in flight when it came


def test_gate_disabled_and_refusal():
    g = Gate(policy(max_backlog=MB), enabled=False)
    ran = []
    assert g.write({0}, 8 * MB, lambda o, n: ran.append(n)) and ran == [8 * MB]
    g = Gate(policy(max_backlog=MB))
    assert not g.write({0}, 8 * MB, lambda o, n: ran.append(n)) and g.stats["refused"] == 1


def test_gate_toggled_during_a_read_releases_it():
    """A read registered while the scheduler was on is released even if it was switched off since
    (and one that started while off is not released twice): a later write must not wait for it."""
    g = Gate(policy(write_bw=100 * MB))
    hold = g.reading({0})
    hold.__enter__()
    g.enabled = False
    hold.__exit__(None, None, None)
    g.enabled = True
    ran = []
    writer = threading.Thread(target=g.write, args=({0}, MB, lambda o, n: ran.append(n)))
    writer.start()
    writer.join(timeout=10)
    assert not writer.is_alive() and ran == [MB]
    g.enabled = False
    late = g.reading({0})
    late.__enter__()
    g.enabled = True
    late.__exit__(None, None, None)  # never registered: nothing to release
    assert g.write({0}, MB, lambda o, n: ran.append(n)) and ran == [MB, MB]


def test_a_write_that_raises_mid_way_gives_its_place_to_later_writes_and_reads():
    """A chunk that raises (an engine error; a close() racing the write) ends its write: the
    chunks not yet issued leave the queue and the backlog. They used to stay, and as a younger
    write never overtakes an older one on a device, every later write there waited forever,
    and after max_write_wait every read too."""
    g = Gate(policy(max_write_wait=0.05))  # about 1 MB chunks
    ran = []

    def failing(off, n):
        ran.append(off)
        time.sleep(n / (100 * MB))  # the policy's rate: chunks stay about 1 MB
        if len(ran) == 2:
            raise OSError(5, "injected")
    try:
        g.write({0}, 4 * MB, failing)
        raise AssertionError("the write's error was swallowed")
    except OSError:
        pass
    assert len(ran) == 2 and not g.policy.writes and g.policy.backlog == 0 and not g.policy.inflight
    done = threading.Event()
    threading.Thread(target=lambda: g.write({0}, 2 * MB, lambda off, n: None) and done.set(), daemon=True).start()
    assert done.wait(5), "a later write on the device never ran"
    time.sleep(0.1)  # past max_write_wait: a stuck write would now hold reads back too
    got = threading.Event()

    def read():
        with g.reading({0}):
            got.set()
    threading.Thread(target=read, daemon=True).start()
    assert got.wait(5), "a read on the device never started"
