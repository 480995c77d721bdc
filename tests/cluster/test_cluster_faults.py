"""The cluster tier against a real Mooncake master that hangs, a peer node that freezes, and
clear() (docs/cluster.md, "What happens on failures").

A hung master or node is its process SIGSTOPped: the kernel still completes TCP connects to its
listeners, nothing answers. Backends run in this process (tiered.TieredStorage over real SGLang
host pools, each with its own Mooncake client and segment, so two of them are two nodes to
Mooncake); the frozen writer is a node process of its own (testing/cluster.py). Bounds on
durations are generous against the hangs they stand for (20 s against 60 s and more).
"""

import hashlib
import logging
import os
import time

import pytest

torch = pytest.importorskip("torch")

# Tests with a master are marked slow: SGLang pools, Mooncake clients (a close takes about 2 s),
# a master process per test.


def keys(n, seed):
    from tutti_hicache.testing.sglang import make_page_keys
    return make_page_keys(n, seed)


class Backends:
    """TieredStorage backends in this process against one master; closed by close()."""

    def __init__(self, sglang, mooncake, tmp_path, master):
        self.h, self.mc, self.tmp, self.master = sglang, mooncake, tmp_path, master
        self.open_ = []

    def open(self, name, model="test-model", up=True, **extra):
        from tutti_hicache.tiered import TieredStorage

        d = self.tmp / name
        d.mkdir()
        cfg = {"tutti_dirs": [str(d)], "tutti_capacity_gb": 0.05, "tutti_cluster_retry_s": 0.2,
               **self.mc.mooncake_extra(self.master), **extra}
        sc = self.h.make_storage_config(is_page_first_layout=True, model_name=model,
                                        extra_config=cfg)
        pool = self.h.make_mha_host_pool("page_first", 2, 2, 64, 16, torch.bfloat16, 48)
        st = TieredStorage(sc, {})
        st.register_mem_pool_host(pool)
        self.open_.append(st)
        if up:
            assert st.cluster.wait_up(30.0)
        return st, pool

    def write(self, st, pool, k, seed):
        """Pages stored (local and published); their bytes."""
        idx = pool.alloc(len(k) * 16)
        try:
            self.h.fill_random(pool, idx, seed)
            assert st.batch_set_v1(k, idx) == [True] * len(k)
            return self.h.page_bytes(pool, idx)
        finally:
            pool.free(idx)

    def read(self, st, pool, k):
        """(batch_get_v1's flags, the bytes of the pages that arrived)."""
        idx = pool.alloc(len(k) * 16)
        try:
            got = st.batch_get_v1(k, idx)
            data = self.h.page_bytes(pool, idx)
            return got, [b for b, ok in zip(data, got) if ok]
        finally:
            pool.free(idx)

    def close(self):
        for st in self.open_:
            st.close()


@pytest.fixture
def cluster(sglang, mooncake, tmp_path):
    """(master, Backends); the master is resumed and stopped at the end whatever happened."""
    master = mooncake.Master(log_path=str(tmp_path / "master.log"), lease_ms=3000).start()
    backends = Backends(sglang, mooncake, tmp_path, master)
    try:
        yield master, backends
    finally:
        try:
            master.resume()
            backends.close()
        finally:
            master.stop()


def _cluster_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("tutti_hicache")]


# ---------------------------------------------------------------- settings, no master

def test_timeouts_go_to_mooncakes_variables_and_an_exported_value_wins(monkeypatch):
    from tutti_hicache import cluster

    monkeypatch.setattr(cluster, "_env_set_by_us", {})
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "12345")  # the user's
    assert cluster.apply_timeouts(2.5) == {"MC_RPC_TIMEOUT_MS": "12345",
                                           "MC_TCP_PROGRESS_TIMEOUT_SEC": "3"}
    assert cluster.apply_timeouts(1.0) == {"MC_RPC_TIMEOUT_MS": "12345",  # ours follow the setting
                                           "MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}
    monkeypatch.delenv("MC_RPC_TIMEOUT_MS")
    assert cluster.apply_timeouts(0.25)["MC_RPC_TIMEOUT_MS"] == "250"
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "1"  # whole seconds, at least one


def test_cluster_timeout_is_a_setting():
    from tutti_hicache.config import TuttiConfig

    assert TuttiConfig.from_sources({}, env={}).cluster_timeout_s == 3.0
    cfg = TuttiConfig.from_sources({"tutti_cluster_timeout_s": "0.5"}, env={})
    assert cfg.cluster_timeout_s == 0.5
    with pytest.raises(ValueError):
        TuttiConfig.from_sources({"tutti_cluster_timeout_s": 0}, env={})


# ------------------------------------------------------------------- a hung master

@pytest.mark.sglang
@pytest.mark.slow
def test_a_transport_that_cannot_start_freezes_no_thread(cluster, caplog):
    """protocol rdma with no such device: Mooncake's setup retries for about 20 s holding the
    GIL. The child process's check used to set up over tcp whatever the configuration said, so
    it passed, and the real setup froze the whole process for about 20 s at every retry. Now the
    check uses the configured transport: no other thread stalls, the tier stays local only
    with one warning naming the transport."""
    import threading
    _, nodes = cluster
    stalls, stop = [], threading.Event()

    def ticker():
        last = time.monotonic()
        while not stop.wait(0.01):
            now = time.monotonic()
            stalls.append(now - last)
            last = now
    t = threading.Thread(target=ticker, daemon=True)
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        t.start()
        st, pool = nodes.open("rdma", up=False, protocol="rdma", device_name="tutti-no-such-device",
                              tutti_cluster_timeout_s=1.0, tutti_cluster_retry_s=1.0)
        deadline = time.monotonic() + 40.0
        while not _cluster_warnings(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # another attempt meanwhile
        stop.set()
        t.join()
        warned = _cluster_warnings(caplog)
    # the defect froze every thread about 20 s per attempt; other in-process Mooncake calls can
    # hold the GIL about 4 s on a loaded machine
    assert max(stalls) < 10.0, f"threads stalled {sorted(stalls)[-3:]} s"
    assert len(warned) == 1 and "'rdma'" in warned[0], warned
    k = keys(2, 9)
    want = nodes.write(st, pool, k, 9)
    assert nodes.read(st, pool, k) == ([True, True], want)  # the local tier serves



@pytest.mark.sglang
@pytest.mark.slow
def test_a_master_hung_at_start_freezes_no_thread_and_is_retried(cluster, caplog):
    """The master accepts TCP connects but answers nothing. Mooncake's setup would hold the GIL
    for 20 x MC_RPC_TIMEOUT_MS (60 s here, 600 s by default): the whole process frozen. The
    client's setup is first tried in a child process: SGLang's calls keep running, the tier is
    local only with one warning, and it comes up once the master answers."""
    master, nodes = cluster
    master.pause()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        t0 = time.monotonic()
        st, pool = nodes.open("a", up=False, tutti_cluster_timeout_s=3.0)
        k = keys(4, 1)
        want = nodes.write(st, pool, k, 1)
        t1, calls = time.monotonic(), 0
        while calls < 2 or time.monotonic() - t1 < 2.0:  # the cluster thread meets the hung
            assert st.batch_exists(k) == 4              # master meanwhile
            assert nodes.read(st, pool, k) == ([True] * 4, want)
            calls += 1
        assert time.monotonic() - t0 < 20.0
        deadline = time.monotonic() + 30.0
        while not _cluster_warnings(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second attempt meanwhile: still one warning
        warned = _cluster_warnings(caplog)
    assert len(warned) == 1 and "does not answer" in warned[0], warned  # (or the transport...)
    assert st.tutti_stats()["cluster_state"] == "connecting"
    master.resume()
    assert st.cluster.wait_up(30.0)
    k2 = keys(2, 2)
    want2 = nodes.write(st, pool, k2, 2)  # published now
    assert st.store.forget(k2) == 2
    assert nodes.read(st, pool, k2) == ([True, True], want2)
    assert st.tutti_stats()["remote_hits"] == 2


@pytest.mark.sglang
@pytest.mark.slow
def test_a_master_hung_while_serving_costs_one_bounded_call(cluster, caplog):
    """Mooncake's master requests time out after 30 s by default; tutti_cluster_timeout_s bounds
    the first call that meets the hung master, which closes the gate: later calls do not wait."""
    master, nodes = cluster
    st, pool = nodes.open("a", tutti_cluster_timeout_s=1.0)
    k = keys(4, 3)
    want = nodes.write(st, pool, k, 3)
    assert st.store.forget(k) == 4  # only the cluster tier has them now
    master.pause()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        # pages never seen: a master request (the client caches others'). One CI run saw the
        # first such call answered as a miss with the gate still up (not reproduced, pause()
        # now waits for the stop): fresh keys until the gate closes, each call bounded
        for seed in range(4, 7):
            t0 = time.monotonic()
            assert st.batch_exists(keys(2, seed)) == 0
            assert time.monotonic() - t0 < 20.0
            if st.tutti_stats()["cluster_state"] == "down":
                break
        assert st.tutti_stats()["cluster_state"] == "down"
        t1 = time.monotonic()
        for _ in range(3):  # the gate is closed: no Mooncake call
            assert st.batch_exists(k) == 0 and nodes.read(st, pool, k)[0] == [False] * 4
        assert time.monotonic() - t1 < 20.0
        warned = _cluster_warnings(caplog)
    assert len(warned) == 1 and st.tutti_stats()["outages"] == 1, warned
    master.resume()
    assert st.cluster.wait_up(30.0)
    assert nodes.read(st, pool, k) == ([True] * 4, want)


# ------------------------------------------------------------------ a frozen writer

@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("read_before", [True, False], ids=["read-before", "never-read"])
def test_a_frozen_writer_is_a_bounded_miss_that_closes_the_gate(cluster, mooncake, caplog,
                                                               read_before):
    """The node holding the pages is SIGSTOPped: the master still lists them, the node sends
    nothing. read-before: the reader has read from it before, Mooncake gives up the transfer after
    MC_TCP_PROGRESS_TIMEOUT_SEC (30 s by default, 60 s per read seen) with TRANSFER_FAIL.
    never-read: Mooncake's first transfer from a node waits 60 s per object for its handshake
    reply (hard-coded); the reader opens the node's segment on a thread of its own and waits for
    that tutti_cluster_timeout_s. Either way the pages are misses, one warning, and the gate
    closes, so the next reads wait for nothing. Once the node runs again, its pages arrive
    byte-exact."""
    master, nodes = cluster
    # the reader first: its client's warm-up object (SGLang's MooncakeStore puts one anywhere)
    # can then only land in its own segment, so it has never read from the writer's
    st, pool = nodes.open("reader", tutti_cluster_timeout_s=1.0, tutti_cluster_promote=False,
                      tutti_cluster_retry_s=3.0)  # the gate stays closed while we look
    writer = mooncake.Node.spawn()
    try:
        writer.ready()
        d = nodes.tmp / "writer"
        d.mkdir()
        writer.call("open", "kv", [str(d)], mooncake.mooncake_extra(master))
        assert writer.call("wait_state", "kv", "up") == "up"
        k = keys(7, 5)
        done, want = writer.call("write", "kv", k, 5)
        assert done == 7
        assert st.batch_exists(k) == 7
        if read_before:
            got, data = nodes.read(st, pool, k[:1])
            assert got == [True] and hashlib.sha256(data[0]).hexdigest() == want[0]
        k, want = k[1:], want[1:]
        writer.pause()
        with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
            t0 = time.monotonic()
            assert nodes.read(st, pool, k) == ([False] * 6, [])
            assert time.monotonic() - t0 < 20.0
            s = st.tutti_stats()
            assert s["cluster_state"] == "down" and s["transfer_failures"] == 1
            t1 = time.monotonic()
            assert nodes.read(st, pool, k) == ([False] * 6, [])  # the gate is closed: no transfer
            assert time.monotonic() - t1 < 20.0
            warned = _cluster_warnings(caplog)
        assert len(warned) == 1 and "read from another node failed" in warned[0], warned
        writer.resume()
        assert st.cluster.wait_up(30.0)
        deadline = time.monotonic() + 30.0  # until its segment is open again (a miss meanwhile)
        while (got := nodes.read(st, pool, k))[0] != [True] * 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got[0] == [True] * 6
        assert [hashlib.sha256(x).hexdigest() for x in got[1]] == want
    finally:
        writer.resume()
        writer.exit()


# ------------------------------------------------------------------------- clear()

@pytest.mark.sglang
@pytest.mark.slow
def test_clear_removes_this_nodes_objects_and_no_one_elses(cluster):
    """A's clear(): A's published objects go (A neither reads nor promotes them meanwhile: an
    object read within the master's lease cannot be removed yet); B's objects of the same
    identity, one A also stored but B published, one A published that is now B's, and other
    identities' objects stay."""
    master, nodes = cluster
    a, pa = nodes.open("a")
    bb, pb = nodes.open("b")
    other, po = nodes.open("other", model="other-model")
    ka, kb, ks, ke = keys(6, 11), keys(4, 12), keys(2, 13), keys(2, 14)
    nodes.write(a, pa, ka, 11)
    want_b = nodes.write(bb, pb, kb, 12)
    nodes.write(bb, pb, ks, 13)
    nodes.write(a, pa, ks, 13)  # B published these first: A put nothing
    nodes.write(other, po, ka, 15)  # the same page keys under another identity
    nodes.write(a, pa, ke, 14)  # A's, then (as if evicted from A's segment) put again by B:
    client = a.cluster._store.store
    for key in ke:
        assert client.remove_by_regex(f"^{a.cluster._store.config_prefix}_{key}_", True) == 2
    nodes.write(bb, pb, ke, 14)
    assert bb.batch_exists(ka) == 6  # B queried A's pages: leased by the master for 3 s
    before = a.tutti_stats()
    a.clear()
    assert a.batch_exists(ka) == 0  # neither local nor remote for A, though still in Mooncake
    assert nodes.read(a, pa, ka)[0] == [False] * 6
    a.drain_promotions()
    assert a.tutti_stats()["promoted"] == before["promoted"] and not a.store.present(ka).any()
    assert a.cluster.wait_retired(30.0)
    assert bb.batch_exists(ka) == 0  # removed from Mooncake
    assert nodes.read(a, pa, ka)[0] == [False] * 6  # and from the client's cache of their replicas
    assert a.tutti_stats()["cleared_objects"] == 12
    # what A finds now is in Mooncake only (its local pages are gone): B's, and the other model's
    assert a.batch_exists(kb) == 4 and a.batch_exists(ks) == 2 and a.batch_exists(ke) == 2
    assert other.store.forget(ka) == 6 and other.batch_exists(ka) == 6
    got, data = nodes.read(a, pa, kb)  # A reads the other node's pages as before
    assert got == [True] * 4 and data == want_b
    nodes.write(a, pa, ka, 16)  # and publishes its own again
    assert bb.batch_exists(ka) == 6


@pytest.mark.sglang
@pytest.mark.slow
def test_clear_while_the_master_hangs_removes_them_once_it_answers(cluster, caplog):
    """clear() while the master is down: one warning; A's objects are not read by A when the
    master answers again, and are removed then."""
    master, nodes = cluster
    a, pa = nodes.open("a", tutti_cluster_timeout_s=1.0)
    bb, pb = nodes.open("b", tutti_cluster_timeout_s=1.0)
    k = keys(4, 21)
    nodes.write(a, pa, k, 21)
    master.pause()
    assert nodes.read(a, pa, keys(1, 22))[0] == [False]  # a remote read meets the hung master
    assert a.tutti_stats()["cluster_state"] == "down"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        a.clear()
        warned = _cluster_warnings(caplog)
    assert len(warned) == 1 and "not answering" in warned[0], warned
    assert a.tutti_stats()["cluster_retired"] == 8
    master.resume()
    assert a.cluster.wait_up(30.0)
    assert a.batch_exists(k) == 0 and nodes.read(a, pa, k)[0] == [False] * 4
    assert a.cluster.wait_retired(30.0)
    assert bb.cluster.wait_up(30.0) and bb.batch_exists(k) == 0


@pytest.mark.sglang
@pytest.mark.slow
def test_published_keys_are_bounded(cluster):
    """Past its cap, the list of objects a client published drops those no longer in its segment
    (evicted or removed), so it stays bounded by what the segment can hold."""
    master, nodes = cluster
    a, pa = nodes.open("a")
    own = a.cluster._own
    own.segment_bytes = 0  # the cap is then its floor
    k = keys(8, 31)
    nodes.write(a, pa, k, 31)
    assert len(own.published) == 16
    client = a.cluster._store.store
    for key in k[:6]:  # gone from the segment, as if evicted
        assert client.remove_by_regex(f"^{a.cluster._store.config_prefix}_{key}_", True) == 2
    floor = type(own).MIN_CAP
    try:
        type(own).MIN_CAP = 10
        nodes.write(a, pa, keys(1, 32), 32)  # 18 > 10: pruned by the cluster thread
        deadline = time.monotonic() + 20.0
        while (own.prune or len(own.published) > 6) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        type(own).MIN_CAP = floor
    assert len(own.published) == 6  # k[6:] and the new page: still in the segment


@pytest.mark.sglang
@pytest.mark.slow
def test_close_during_a_cluster_get_leaves_the_client_to_that_get(cluster, caplog):
    """SGLang's detach joins its storage threads for 10 s, then closes the backend whatever
    they do. A get held by a hung master (2 x tutti_cluster_timeout_s) can still be in the
    Mooncake client then: close() used to close the client under it, and the process crashed
    (a segfault in the client's batch get). Now the client stays open until that get returns,
    which closes it; the get answers a miss, and no exception reaches SGLang's thread."""
    import threading
    master, nodes = cluster
    st, pool = nodes.open("a", tutti_cluster_timeout_s=1.0)
    k = keys(4, 3)
    nodes.write(st, pool, k, 3)  # published to the cluster
    assert st.store.forget(k) == 4  # now only the cluster has them
    master.pause()
    idx = pool.alloc(4 * 16)
    out = {}

    def get():
        try:
            out["got"] = st.batch_get_v1(k, idx)
        except BaseException as e:  # noqa: BLE001 (what reached SGLang's thread)
            out["raised"] = repr(e)
    with caplog.at_level(logging.DEBUG, logger="tutti_hicache.cluster"):
        t = threading.Thread(target=get, daemon=True)
        t.start()
        deadline = time.monotonic() + 10.0  # until the get is inside the Mooncake client
        while st.cluster._calls == 0 and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert t.is_alive() and st.cluster._calls == 1, "the get did not wait on the hung master"
        st.close()
        t.join(60)
    assert not t.is_alive() and "raised" not in out, out
    assert out["got"] == [False] * 4
    assert any("client closes after it" in r.getMessage() for r in caplog.records)
