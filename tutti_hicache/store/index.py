"""Pure bookkeeping of the object store: key -> slot, LRU eviction, pins, free slots.

At a glance (no I/O, no torch, no threads; the store holds the lock around every call):
    grant(slots, dirty)          make slots allocatable by this process (its own segments)
    reserve(key, evict) -> Reservation | None
                                 a free slot, or the least recently used unpinned own entry
                                 evicted when `evict`; None when neither exists
    publish(res, checksum, seq)  the reserved slot now holds key (visible to readers)
    abort(res)                   give a reserved slot back (dirty: its header may be torn)
    pin(keys) -> entries         pin present keys for a read (eviction skips pinned slots)
    unpin(slots)
    learn(slot, key, checksum, seq, owned)   an entry found on disk (rebuild, re-scan)
    forget_slot(slot, foreign_only)          the header at slot is gone: forget its entry
    order_lru(keys)              own keys a scan learned, oldest first: to the LRU's recent end
    drop(key)                    forget a key (bad checksum, clear)

A slot is "dirty" when it may hold a valid header on disk; the store writes a tombstone
header before reusing a dirty slot so a torn rewrite can never be read as the old key.
Only slots granted to this process are ever allocated or evicted; entries learned from
other processes' segments are readable but never reused here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass
class Entry:
    slot: int
    checksum: int
    seq: int
    owned: bool
    pins: int = 0
    units: bytes = b""  # per-unit (per-layer) XXH3-64s, little-endian uint64
    fresh: bool = False  # published by this process since it opened the store


@dataclass(frozen=True)
class Reservation:
    key: str
    slot: int
    dirty: bool
    evicted: Optional[str] = None  # key whose slot was taken


class SlotIndex:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.by_slot: dict[int, str] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # own, published, oldest first
        self.free: deque[tuple[int, bool]] = deque()  # (slot, dirty)
        self.reserved: dict[str, int] = {}
        self.pinned_slots: dict[int, int] = {}
        self.zombies: set[int] = set()  # own slots dropped while pinned: freed at last unpin
        self.held: set[int] = set()  # own slots dropped with hold=True: free at let_go()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def grant(self, slots: Iterable[int], dirty: bool) -> None:
        """Make slots allocatable. A slot already free, reserved or holding an entry is a bug in
        the caller and raises: granting it twice would give two keys one slot."""
        slots = [int(s) for s in slots]
        taken = set(slots) - set(self.unaccounted(slots))
        if taken:
            raise RuntimeError(f"grant: slots {sorted(taken)[:5]} are already free or in use")
        self.free.extend((s, dirty) for s in slots)

    def unaccounted(self, slots: Iterable[int]) -> list[int]:
        """Of slots, those in no entry, free list, reservation, zombie or hold: what grant()
        may take. O(slots + free + reserved), not O(entries)."""
        placed = {f[0] for f in self.free} | set(self.reserved.values()) | self.zombies | self.held
        return [s for s in slots if s not in self.by_slot and s not in placed]

    def prefix_len(self, keys: list[str]) -> int:
        """Number of leading keys present; touches them in the LRU. Non-string keys are absent."""
        n = 0
        for k in keys:
            if not isinstance(k, str) or k not in self.entries:
                break
            if k in self.lru:
                self.lru.move_to_end(k)
            n += 1
        return n

    def reserve(self, key: str, evict: bool) -> Optional[Reservation]:
        if key in self.entries or key in self.reserved:
            raise KeyError(f"reserve: {key} is already present or being written")
        if self.free:
            slot, dirty = self.free.popleft()
            self.reserved[key] = slot
            return Reservation(key, slot, dirty)
        if not evict:
            return None
        # a pinned slot, not only a pinned entry (an entry's pins are its slot's too): a reader's
        # pin stays on the slot when the entry there changed under it (learned from another
        # writer), and the slot is what it reads
        victim = next((k for k in self.lru if self.entries[k].slot not in self.pinned_slots), None)
        if victim is None:
            return None
        slot = self.entries[victim].slot
        self._remove(victim)
        self.evictions += 1
        self.reserved[key] = slot
        return Reservation(key, slot, True, evicted=victim)

    def publish(self, res: Reservation, checksum: int, seq: int, units: bytes = b"") -> None:
        del self.reserved[res.key]
        self._add(res.key, Entry(res.slot, checksum, seq, owned=True, units=units, fresh=True))

    def abort(self, res: Reservation) -> None:
        del self.reserved[res.key]
        self.free.appendleft((res.slot, True))

    def pin(self, keys: list[str]) -> list[Optional[Entry]]:
        out = []
        for k in keys:
            e = self.entries.get(k) if isinstance(k, str) else None
            if e is not None:
                e.pins += 1
                self.pinned_slots[e.slot] = self.pinned_slots.get(e.slot, 0) + 1
                if k in self.lru:
                    self.lru.move_to_end(k)
            out.append(e)
        return out

    def unpin(self, slots: Iterable[int]) -> None:
        for s in slots:
            n = self.pinned_slots.get(s, 0)
            if n <= 1:
                self.pinned_slots.pop(s, None)
                if s in self.zombies:
                    self.zombies.discard(s)
                    self.free.append((s, True))
            else:
                self.pinned_slots[s] = n - 1
            e = self.entries.get(self.by_slot.get(s, ""))
            if e is not None and e.slot == s and e.pins > 0:
                e.pins -= 1

    def learn(self, slot: int, key: str, checksum: int, seq: int, owned: bool,
              units: bytes = b"") -> bool:
        """Record an entry read from disk. Newer sequence numbers win; returns True if kept. An
        own copy of the key elsewhere that loses (another writer stored the same page later)
        gives its slot back."""
        old_key = self.by_slot.get(slot)
        if old_key == key and self.entries[key].seq == seq:
            if owned and not self.entries[key].owned:
                self.entries[key].owned = True
                self.lru[key] = None
            return True
        if old_key is not None:
            self._remove(old_key)
        cur = self.entries.get(key)
        if cur is not None:
            if cur.seq >= seq:
                return False
            self._remove(key)
            self._release(cur)
        self._add(key, Entry(slot, checksum, seq, owned, units=units))
        return True

    def disown(self, slots) -> bool:
        """Give up slots (another process will own them): their entries stay readable as foreign,
        they leave the LRU and the free list. False (nothing changed) if one is pinned or reserved."""
        slots = set(int(s) for s in slots)
        if slots & set(self.pinned_slots) or slots & set(self.reserved.values()) \
                or slots & self.zombies or slots & self.held:
            return False
        for s in slots:
            key = self.by_slot.get(s)
            if key is not None:  # another process's page from now on: read it verified
                self.entries[key].owned = self.entries[key].fresh = False
                self.lru.pop(key, None)
        self.free = deque(f for f in self.free if f[0] not in slots)
        return True

    def forget_slot(self, slot: int, foreign_only: bool = False) -> None:
        """Forget the entry at slot (its header on disk is gone); with foreign_only, only an
        entry learned from another writer (a row this process has just taken over)."""
        key = self.by_slot.get(slot)
        if key is not None and not (foreign_only and self.entries[key].owned):
            self._remove(key)

    def order_lru(self, keys: Iterable[str]) -> None:
        """Move the keys that are in the LRU to its recent end in the order given (oldest
        first): the own entries a scan learned, by their headers' sequence numbers, so that a
        restart evicts the pages written longest ago first, not those in the lowest slots. Keys
        no longer in the LRU (evicted or dropped meanwhile) are skipped. Iterates in C."""
        lru = self.lru
        deque(map(lru.move_to_end, filter(lru.__contains__, keys)), maxlen=0)

    def drop(self, key: str, hold: bool = False) -> Optional[int]:
        """Forget key; an own slot goes back to the free list (dirty), or with hold stays out
        of every list until let_go() (its header is still to be overwritten: clear()). Returns
        the slot."""
        e = self.entries.get(key)
        if e is None:
            return None
        self._remove(key)
        if hold and e.owned:
            self.held.add(e.slot)
        else:
            self._release(e)
        return e.slot

    def let_go(self, slots: Iterable[int]) -> None:
        """Slots held by drop(hold=True): free now, or at their last unpin while pinned."""
        for s in slots:
            if s in self.held:
                self.held.discard(s)
                if s in self.pinned_slots:
                    self.zombies.add(s)
                else:
                    self.free.append((s, True))

    def _release(self, e: Entry) -> None:
        """An own slot whose entry left the index: back to the free list (dirty), or, while a
        read holds it, once the last pin goes."""
        if e.owned and e.slot in self.pinned_slots:
            self.zombies.add(e.slot)
        elif e.owned:
            self.free.append((e.slot, True))

    def _add(self, key: str, e: Entry) -> None:
        """Index key at e.slot; an entry the key had elsewhere (learned from another writer while
        this process wrote the same page) leaves the index, and its slot if own is released."""
        old = self.entries.get(key)
        if old is not None:
            self._remove(key)
            if old.slot != e.slot:
                self._release(old)
        self.entries[key] = e
        self.by_slot[e.slot] = key
        if e.owned:
            self.lru[key] = None

    def _remove(self, key: str) -> None:
        e = self.entries.pop(key)
        if self.by_slot.get(e.slot) == key:
            del self.by_slot[e.slot]
        self.lru.pop(key, None)
