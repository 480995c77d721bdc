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


def accounted(ix, own_slots):
    """The index's invariants: every slot maps to the entry that names it, and each own slot is
    in exactly one place (an own entry, the free list, a reservation or a zombie)."""
    assert all(ix.entries[k].slot == s for s, k in ix.by_slot.items())
    assert all(ix.by_slot.get(e.slot) == k for k, e in ix.entries.items())
    places = [e.slot for e in ix.entries.values() if e.owned] + [s for s, _ in ix.free] \
        + list(ix.reserved.values()) + list(ix.zombies) + list(ix.held)
    assert sorted(places) == sorted(own_slots), (sorted(places), sorted(own_slots))


def test_a_newer_copy_from_another_writer_gives_the_own_slot_back():
    """Two writers stored the same page; the re-scan learns the other's newer copy: the own slot
    returns to the free list (dirty), not lost until a restart; pinned, at the last unpin."""
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    fill(ix, ["a", "b"])
    ix.pin(["b"])
    assert ix.learn(100, "a", 1, seq=50, owned=False) and ix.learn(101, "b", 2, seq=51, owned=False)
    assert ix.entries["a"].slot == 100 and not ix.entries["a"].owned
    assert list(ix.free) == [(0, True)] and ix.zombies == {1}
    accounted(ix, [0, 1])
    ix.unpin([1])  # the read that pinned the own copy of b ends
    assert sorted(ix.free) == [(0, True), (1, True)] and not ix.zombies
    accounted(ix, [0, 1])


def test_a_copy_learned_while_the_own_write_was_in_flight_leaves_no_stale_slot():
    """The re-scan learns the other writer's copy of k while this process writes k; the publish
    then indexes the own copy. The other writer's slot must not still name k: forgetting or
    reusing that slot later must leave the own entry alone (it used to drop it, leak its slot and
    make every later re-scan of the row raise KeyError)."""
    ix = SlotIndex()
    ix.grant([0], dirty=False)
    r = ix.reserve("k", evict=True)
    assert ix.learn(100, "k", 1, seq=50, owned=False)
    ix.publish(r, checksum=2, seq=51)
    assert ix.entries["k"].slot == 0 and 100 not in ix.by_slot
    accounted(ix, [0])
    ix.forget_slot(100)  # the other writer cleared its copy
    assert ix.learn(100, "other", 3, seq=52, owned=False)  # and reused the slot
    assert ix.entries["k"].slot == 0 and ix.entries["other"].slot == 100
    accounted(ix, [0])
    ix.pin(["k"])
    ix.unpin([0])
    assert ix.entries["k"].pins == 0


def test_pages_handed_to_another_writer_are_read_verified():
    """disown: the rows go to another process, whose writes may replace the slots' bytes at any
    time; its entries are no longer this process's fresh pages (read without a checksum when
    tutti_verify is off)."""
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    fill(ix, ["a", "b"])
    assert ix.entries["a"].fresh
    assert ix.disown([0])
    assert not ix.entries["a"].fresh and not ix.entries["a"].owned and ix.entries["b"].fresh


def test_a_slot_a_reader_pinned_is_not_evicted_when_its_entry_changed():
    """A reader pinned x's slot; the slot then holds another key (learned from the writer that
    owned the row, then reused here): while that first pin lasts the slot is not evicted, and
    the reader's unpin does not take a later reader's pin away."""
    ix = SlotIndex()
    ix.learn(0, "x", 1, seq=1, owned=False)
    assert [e.slot for e in ix.pin(["x"])] == [0]  # reader 1
    assert ix.learn(0, "k3", 2, seq=5, owned=True)  # the slot now holds k3, ours
    ix.pin(["k3"])  # reader 2
    ix.unpin([0])  # reader 1 ends
    assert ix.reserve("k4", evict=True) is None  # k3's slot is still read by reader 2
    ix.unpin([0])
    r = ix.reserve("k4", evict=True)
    assert r is not None and r.slot == 0 and r.evicted == "k3"


def test_slots_held_for_their_tombstones_are_not_reused_before():
    """clear(): the cleared own slots stay out of the free list until their tombstones landed
    (a write reusing one earlier would have its new header overwritten); pinned ones are freed
    at their last unpin."""
    ix = SlotIndex()
    ix.grant([0, 1], dirty=False)
    fill(ix, ["a", "b"])
    ix.pin(["b"])
    assert ix.drop("a", hold=True) == 0 and ix.drop("b", hold=True) == 1
    assert ix.reserve("c", evict=True) is None and not ix.disown([0])
    ix.let_go([0, 1])
    assert list(ix.free) == [(0, True)] and ix.zombies == {1} and not ix.held
    ix.unpin([1])
    assert sorted(ix.free) == [(0, True), (1, True)]
