"""SlotIndex: scripted sequences with exact slots, evictions, pins (no I/O)."""

import pytest

from tutti_hicache.store.index import SlotIndex


def fill(ix, keys):
    out = []
    for k in keys:
        r = ix.reserve(k, evict=True)
        ix.publish(r, checksum=hash(k) & 0xFFFF, seq=len(out))
        out.append(r)
    return out


def test_allocation_in_grant_order_then_lru_eviction():
    ix = SlotIndex()
    ix.grant([0, 1, 2, 3], dirty=False)
    rs = fill(ix, ["a", "b", "c", "d"])
    assert [r.slot for r in rs] == [0, 1, 2, 3] and not any(r.dirty for r in rs)
    assert ix.prefix_len(["a", "b", "x", "c"]) == 2  # touches a, b
    assert ix.reserve("e", evict=False) is None
    r = ix.reserve("e", evict=True)
    assert (r.slot, r.dirty, r.evicted) == (2, True, "c")  # c is now least recent
    ix.publish(r, 1, 9)
    assert "c" not in ix and ix.entries["e"].slot == 2 and ix.evictions == 1


def test_pinned_slots_are_never_evicted():
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    fill(ix, ["a", "b"])
    ix.pin(["a", "b"])
    assert ix.reserve("c", evict=True) is None
    ix.unpin([0])
    r = ix.reserve("c", evict=True)
    assert (r.slot, r.evicted) == (0, "a")


def test_abort_returns_a_dirty_slot_first():
    ix = SlotIndex()
    ix.grant([5, 6], dirty=False)
    r = ix.reserve("a", evict=False)
    ix.abort(r)
    r2 = ix.reserve("b", evict=False)
    assert (r2.slot, r2.dirty) == (5, True)


def test_reserve_twice_is_a_bug():
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    ix.reserve("a", evict=False)
    with pytest.raises(KeyError):
        ix.reserve("a", evict=False)


def test_learn_keeps_the_newest_and_never_owns_foreign():
    ix = SlotIndex()
    assert ix.learn(3, "k", 11, seq=5, owned=False)
    assert not ix.learn(4, "k", 12, seq=4, owned=False)  # older copy loses
    assert ix.entries["k"].slot == 3
    assert ix.learn(4, "k", 12, seq=6, owned=False)  # newer copy wins
    assert ix.entries["k"].slot == 4 and 3 not in ix.by_slot
    assert "k" not in ix.lru  # foreign: not evictable here
    assert ix.learn(4, "j", 13, seq=7, owned=True)  # slot rewritten with another key
    assert "k" not in ix and "j" in ix.lru


def test_drop_while_pinned_frees_at_last_unpin():
    ix = SlotIndex()
    ix.grant([0], dirty=False)
    fill(ix, ["a"])
    ix.pin(["a"])
    ix.pin(["a"])
    assert ix.drop("a") == 0
    assert ix.reserve("b", evict=True) is None
    ix.unpin([0])
    assert ix.reserve("b", evict=False) is None
    ix.unpin([0])
    r = ix.reserve("b", evict=False)
    assert (r.slot, r.dirty) == (0, True)


def test_a_slot_is_never_granted_twice():
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    with pytest.raises(RuntimeError, match="already free"):
        ix.grant([1, 2], dirty=False)
    fill(ix, ["a"])
    with pytest.raises(RuntimeError):
        ix.grant([0], dirty=True)  # slot 0 holds "a"
