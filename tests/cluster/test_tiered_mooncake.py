"""The tiered backend (tutti local SSD tier + Mooncake cluster tier) against a real Mooncake.

A mooncake_master subprocess on free loopback ports; nodes A and B are separate processes
(tutti_hicache.testing.cluster), each with its own tutti directory, SGLang host pools and SGLang's
controller methods. Skipped with the reason only when the Mooncake client does not import.
"""

import logging

import pytest

torch = pytest.importorskip("torch")
# slow, all of it: SGLang and Mooncake imported (here and in every node process), a mooncake_master
# process per test or module, and each Mooncake client's close takes about 2 s
pytestmark = [pytest.mark.sglang, pytest.mark.slow]


class Cluster:
    def __init__(self, mc, tmp):
        self.mc, self.tmp = mc, tmp
        self.master = mc.Master(log_path=str(tmp / "master.log")).start()
        self.nodes = {}

    def node(self, name):
        """Node `name` (spawned on first use) with backend "kv" open: its own tutti directory."""
        if name not in self.nodes:
            self.nodes[name] = self.mc.Node.spawn()
        return self.nodes[name]

    def open(self, node, backend="kv", wait="up", extra=None, **kw):
        d = self.tmp / f"{id(node)}-{backend}"
        d.mkdir(exist_ok=True)
        node.call("open", backend, [str(d)], {**self.mc.mooncake_extra(self.master), **(extra or {})},
                  **kw)
        assert node.call("wait_state", backend, wait) == wait

    def close(self):
        try:
            for n in self.nodes.values():
                n.exit()
        finally:
            self.master.stop()


@pytest.fixture(scope="module")
def cluster(mooncake, tmp_path_factory):
    c = Cluster(mooncake, tmp_path_factory.mktemp("cluster"))
    try:
        a, b = c.node("A"), c.node("B")  # both import SGLang at the same time
        a.ready(), b.ready()
        c.open(a)
        c.open(b)
        yield c
    finally:
        c.close()


def keys(n, seed):
    from tutti_hicache.testing.sglang import make_page_keys
    return make_page_keys(n, seed)


def test_a_writes_b_finds_and_reads_byte_exact(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(24, 1)
    done, want = a.call("write", "kv", k, 1)
    assert done == 24
    assert b.call("exists", "kv", k) == 24
    before = b.call("stats", "kv")
    assert b.call("read", "kv", k) == (24, want)
    b.call("drain", "kv")  # the promotion runs on a thread of its own
    s = b.call("stats", "kv")
    assert s["remote_hits"] - before["remote_hits"] == 24 and s["hits"] == before["hits"]
    assert s["promoted"] - before["promoted"] == 24
    assert b.call("read", "kv", k) == (24, want)  # promoted: now from B's own SSD tier
    assert b.call("stats", "kv")["hits"] - s["hits"] == 24


def test_the_master_listens_on_loopback_only(cluster):
    """Every listener of the master is 127.0.0.1 (RPC, metrics; no HTTP metadata server). The
    nodes' transfer-engine listeners are Mooncake's INADDR_ANY (docs/cluster.md, Security)."""
    addrs = cluster.mc.listening(cluster.master.proc.pid)
    assert ("127.0.0.1", cluster.master.rpc_port) in addrs
    assert {ip for ip, _ in addrs} == {"127.0.0.1"}, addrs


def test_mixed_local_and_remote_prefix_is_the_union(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(30, 2)
    want = [None] * 30
    _, want[0:10] = a.call("write", "kv", k[0:10], 3)  # remote for B
    _, want[10:20] = b.call("write", "kv", k[10:20], 4)  # local to B
    _, want[20:25] = a.call("write", "kv", k[20:25], 5)  # remote again; k[25] nowhere
    a.call("write", "kv", k[26:30], 6)
    assert b.call("exists", "kv", k) == 25
    before = b.call("stats", "kv")
    assert b.call("read", "kv", k[:25]) == (25, want[:25])
    s = b.call("stats", "kv")
    assert s["remote_hits"] - before["remote_hits"] == 15  # the 10 local pages were read locally
    assert s["hits"] - before["hits"] == 10 and s["checksum_failures"] == 0


def test_pages_past_the_first_one_found_nowhere_are_neither_read_nor_counted(cluster):
    """SGLang takes a get's answer up to its first False. B holds pages 0-3, 5 and 7, page 4 is
    nowhere, page 6 only in A's segment: B's get reads and counts pages 0-3 only (it used to read
    and count 5 and 7 from its SSD, take 6 from A, count it a remote hit and promote it, for a
    restore of 4 pages)."""
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(8, 7)
    _, want = b.call("write", "kv", k[0:4], 11)
    b.call("write", "kv", [k[5]], 12)
    b.call("write", "kv", [k[7]], 13)
    a.call("write", "kv", [k[6]], 14)
    before = b.call("stats", "kv")
    assert b.call("read", "kv", k) == (4, want)
    b.call("drain", "kv")
    s = b.call("stats", "kv")
    assert s["hits"] - before["hits"] == 4  # was 6
    assert s["remote_hits"] - before["remote_hits"] == 0 and s["promoted"] == before["promoted"]  # were 1
    assert s["remote_misses"] - before["remote_misses"] == 1  # page 4, asked of the cluster (was 0)


def test_a_local_page_that_fails_its_read_comes_from_the_cluster(cluster, tmp_path):
    """B's copy of page 1 is damaged on its SSD; A published the same page: B's get reads pages
    0, 2, 3 locally, fails page 1's checksum and takes it from the cluster, so SGLang keeps all
    4 (it kept 1, and recomputed 3 pages the cluster held). Its prefetch metric counts the
    local pages SGLang keeps."""
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(4, 21)
    for node in (a, b):
        cluster.open(node, "damaged", extra={"tutti_timeline_file": str(tmp_path / f"{id(node)}.jsonl")})
    _, want = a.call("write", "damaged", k, 21)
    assert b.call("write", "damaged", k, 21)[1] == want
    path, off = b.call("locate", "damaged", k[1])
    with open(path, "r+b") as f:  # inside the page's first object, past its 4 KiB header
        f.seek(off + 4096 + 100)
        byte = f.read(1)[0]
        f.seek(off + 4096 + 100)
        f.write(bytes([byte ^ 0xFF]))
    before = b.call("stats", "damaged")
    b.call("prefetch_pgs", "damaged")  # drained: what the read below adds
    assert b.call("exists", "damaged", k) == 4
    assert b.call("read", "damaged", k) == (4, want)
    s = b.call("stats", "damaged")
    assert s["checksum_failures"] - before["checksum_failures"] == 1
    assert s["remote_hits"] - before["remote_hits"] == 1
    assert b.call("prefetch_pgs", "damaged") == [3, 1]  # local, then remote (was [3]: SGLang kept 1)
    import json
    with open(tmp_path / f"{id(b)}.jsonl") as f:
        ops = [json.loads(line).get("host_op") for line in f]
    assert ops.count("get") >= 1 and "exists" in ops  # the tiered backend's calls are traced too


def test_sglang_metrics_of_the_cluster_tier_are_not_kept_twice(cluster):
    """With SGLang's storage metrics on, the cluster tier's own MooncakeStore kept its own
    prefetch and backup lists, one entry per remote get and publish, drained by no one."""
    a, b = cluster.node("A"), cluster.node("B")
    for node in (a, b):
        cluster.open(node, "metrics", metrics=True)
    k = keys(4, 23)
    _, want = a.call("write", "metrics", k, 23)
    assert b.call("read", "metrics", k) == (4, want)
    assert a.call("inner_metrics", "metrics") == 0 and b.call("inner_metrics", "metrics") == 0


def test_other_model_or_layout_finds_nothing(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(8, 7)
    assert a.call("write", "kv", k, 7)[0] == 8
    cluster.open(b, "other-model", model="other-model")
    cluster.open(b, "other-layout", layout="page_first_direct")
    assert b.call("exists", "other-model", k) == 0
    assert b.call("exists", "other-layout", k) == 0
    assert b.call("read", "other-layout", k)[0] == 0
    assert b.call("exists", "kv", k) == 8  # the same layout does


def test_tp_ranks_do_not_collide(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(8, 8)
    want = {}
    for rank in (0, 1):
        cluster.open(a, f"tp{rank}", tp=(rank, 2))
        cluster.open(b, f"tp{rank}", tp=(rank, 2))
        done, want[rank] = a.call("write", f"tp{rank}", k, 10 + rank)  # same keys, other heads
        assert done == 8
    assert want[0] != want[1]
    for rank in (0, 1):
        assert b.call("read", f"tp{rank}", k) == (8, want[rank])


def test_publish_on_hit_offers_only_reused_pages(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    for node in (a, b):
        cluster.open(node, "hit", extra={"tutti_cluster_publish": "hit"})
    k = keys(6, 17)
    done, want = a.call("write", "hit", k, 17)
    assert done == 6 and b.call("exists", "hit", k) == 0  # stored on A's SSD only
    assert a.call("read", "hit", k) == (6, want)  # a local hit: now offered to the cluster
    assert b.call("exists", "hit", k) == 6
    assert b.call("read", "hit", k) == (6, want)


def test_writer_exit_keeps_promoted_pages(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    k = keys(20, 9)
    done, want = a.call("write", "kv", k, 9)
    assert done == 20 and b.call("read", "kv", k[:12]) == (12, want[:12])  # promoted
    b.call("drain", "kv")
    a.exit()  # a client's Mooncake objects vanish with it
    assert b.call("exists", "kv", k) == 12
    assert b.call("read", "kv", k[:12]) == (12, want[:12])


def test_master_death_serves_locally_warns_once_and_recovers(cluster):
    b = cluster.node("B")
    k, fresh, later = keys(16, 11), keys(8, 12), keys(8, 13)
    _, want = b.call("write", "kv", k, 11)
    b.call("warnings")
    cluster.master.stop()
    for i in range(3):  # local pages keep hitting; writes still land locally; nothing raises
        assert b.call("exists", "kv", k) == 16
        assert b.call("read", "kv", k) == (16, want)
        assert b.call("write", "kv", [x + str(i) for x in fresh], 20 + i)[0] == 8
    warned = [w for w in b.call("warnings") if "cluster tier" in w]
    assert len(warned) == 1, warned
    assert b.call("stats", "kv")["cluster_state"] == "down"
    cluster.master.start()  # a master returns on the same port: the client re-mounts
    assert b.call("wait_state", "kv", "up") == "up"
    _, want_later = b.call("write", "kv", later, 14)  # published again
    assert b.call("forget", "kv", later) == 8  # gone locally: only the cluster tier has them
    hits = b.call("stats", "kv")["remote_hits"]
    assert b.call("read", "kv", later) == (8, want_later)
    assert b.call("stats", "kv")["remote_hits"] == hits + 8


def test_unreachable_master_is_local_only_until_one_listens(sglang, mooncake, tmp_path, caplog):
    """In this process: no master at first (one warning, local pages served), then one starts."""
    from tutti_hicache.tiered import TieredStorage
    master = mooncake.Master(log_path=str(tmp_path / "master.log"))
    extra = {"tutti_dirs": [str(tmp_path / "t")], "tutti_capacity_gb": 0.05,
             "tutti_cluster_retry_s": 0.2, **mooncake.mooncake_extra(master)}
    (tmp_path / "t").mkdir()
    sc = sglang.make_storage_config(is_page_first_layout=True, extra_config=extra)
    pool = sglang.make_mha_host_pool("page_first", 2, 2, 64, 16, torch.bfloat16, 16)
    st = TieredStorage(sc, {})
    try:
        with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
            st.register_mem_pool_host(pool)
            k, idx = keys(4, 15), pool.alloc(4 * 16)
            sglang.fill_random(pool, idx, 15)
            assert st.batch_set_v1(k, idx) == [True] * 4
            assert st.batch_exists(k) == 4 and st.batch_get_v1(k, idx) == [True] * 4
            assert not st.cluster.wait_up(1.0)
        warned = [r for r in caplog.records if "cluster tier" in r.getMessage()]
        assert len(warned) == 1 and st.tutti_stats()["cluster_state"] == "connecting"
        master.start()
        assert st.cluster.wait_up(30.0)
        want = sglang.page_bytes(pool, idx)
        assert st.batch_set_v1(k[:2] + keys(2, 16), idx) == [True] * 4  # all four published
        st.store.forget(k[:2])
        dst = pool.alloc(2 * 16)
        assert st.batch_get_v1(k[:2], dst) == [True, True]  # from Mooncake
        assert sglang.page_bytes(pool, dst) == want[:2] and st.tutti_stats()["remote_hits"] == 2
    finally:
        st.close()
        master.stop()


@pytest.mark.parametrize("promote_mb", [64, 0, "two pages"])
def test_a_promotion_stores_the_bytes_read_even_when_the_host_pages_are_reused_at_once(
        sglang, mooncake, tmp_path, promote_mb):
    """In this process: a remote hit is promoted into the local SSD tier from a copy taken inside
    batch_get_v1 (64: the promotion thread; 0: inside the call; a ring of two pages: two on the
    thread, the other four inside the call), so SGLang overwriting the host pages right after the
    call cannot change what the SSD tier stores under the keys."""
    from tutti_hicache.promote import Promoter
    from tutti_hicache.tiered import TieredStorage
    master = mooncake.Master(log_path=str(tmp_path / "master.log")).start()
    (tmp_path / "t").mkdir()
    extra = {"tutti_dirs": [str(tmp_path / "t")], "tutti_capacity_gb": 0.05,
             "tutti_cluster_promote_mb": 0 if promote_mb == 0 else 64,
             **mooncake.mooncake_extra(master)}
    sc = sglang.make_storage_config(is_page_first_layout=True, extra_config=extra)
    pool = sglang.make_mha_host_pool("page_first", 2, 2, 64, 16, torch.bfloat16, 32)
    st = TieredStorage(sc, {})
    try:
        st.register_mem_pool_host(pool)
        assert (st._promoter is not None) == bool(promote_mb)
        if promote_mb == "two pages":
            st._promoter.close()
            st._promoter = Promoter(st.store, 2 * st._promoter._page_bytes, st.hostmap.object_nbytes,
                                    on_done=lambda ok, bad: st._count(promoted=ok, promote_failed=bad))
        assert st.cluster.wait_up(30.0)
        k, idx = keys(6, 21), pool.alloc(6 * 16)
        sglang.fill_random(pool, idx, 21)
        want = sglang.page_bytes(pool, idx)
        assert st.batch_set_v1(k, idx) == [True] * 6  # local and published
        assert st.store.forget(k) == 6  # only the cluster tier has them now
        dst = pool.alloc(6 * 16)
        assert st.batch_get_v1(k, dst) == [True] * 6  # remote hits, promoted
        sglang.fill_random(pool, dst, 22)  # SGLang reuses the pages at once
        st.drain_promotions()
        s = st.tutti_stats()
        assert s["remote_hits"] == 6 and s["promoted"] == 6 and s["promote_failed"] == 0
        assert s["promote_inline"] == (4 if promote_mb == "two pages" else 0)
        assert st.batch_exists(k) == 6 and st.store.present(k).all()
        again = pool.alloc(6 * 16)
        assert st.batch_get_v1(k, again) == [True] * 6
        assert sglang.page_bytes(pool, again) == want and st.tutti_stats()["hits"] >= 6
        assert st.store.forget(k) == 6 and st.batch_get_v1(k, dst) == [True] * 6  # promoting
        st.clear()  # queued promotions included: none lands after it
        assert not st.store.present(k).any()
    finally:
        st.close()
        master.stop()
