"""Slack-aware I/O scheduling: reads first, reads and writes never together on a device, writes
in chunks that fit the current window, a floor on write progress, a bounded write backlog.

At a glance:
    Policy      pure and deterministic (no threads, no files, no torch; time is an argument):
        read_arrives(id, devices) -> read_may_start(id) -> read_starts(id) -> read_done(id, now)
        write_arrives(id, devices, nbytes, now) -> bool      False: backlog full, refused at once
        next_write(now) -> Chunk | None                      the one chunk that may start now
        chunk_done(chunk, now, seconds)
        set_window(seconds | None)                           from the slack table (linker)
    Gate        the thread-safe shell the store uses: `with gate.reading(devs) as lease:` around a
                read batch, `gate.write(devs, nbytes, run)` splits a write into chunks and runs each
                when the policy allows (blocking only the calling writer thread).
    Lease       a read hold: lease.lend(seconds) lets writes use its devices for one window
                (from a slack table), then holds them for reads again.

Rules, per device (= store directory):
  1. Reads first: a read starts at once unless a write chunk is in flight on its devices; it then
     waits for the chunks in flight only (one, or on idle devices at most `idle_chunk` bytes).
  2. No write chunk starts on a device while a read is pending or in flight there.
  3. At most one write chunk in flight per device; on a device, writes are served oldest first.
     Except on idle devices (rule 4) without a lent window: there a younger write's chunk may
     join those in flight once every older write there has issued its last chunk, as long as
     the chunks' bytes together stay within `idle_chunk`. Two writers (the linker's chunk
     writes) then keep the queues full while the older one drains, and a read arriving still
     waits for about one queue's bytes.
  4. Chunk bytes = window x measured write bandwidth (at least `min_chunk`): a newly arriving read
     waits behind at most one chunk of about one window. On idle devices (no read for
     `idle_after` seconds) and without a lent window, at least `idle_chunk` (the bytes their
     queues hold, iodepth.py): writes run at full queue depth while reads stay away, and the
     first read after a quiet spell waits about one queue's drain.
  5. Floor: when writes have made no progress for `max_write_wait` seconds, pending reads stop
     blocking the next chunk and new reads on its devices wait for it; it starts once the reads
     in flight end. Writes thus progress by >= min_chunk every max_write_wait + one chunk.
  6. Backlog: a write that would queue more than `max_backlog` bytes is refused at arrival.
Without a window from a slack table (the host tier, or no table) `default_window` applies: writes
run only while no read is pending on their devices (plus the floor).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional


@dataclass(frozen=True)
class Chunk:
    write_id: int
    index: int  # chunk number within its write
    devices: frozenset
    nbytes: int
    last: bool


@dataclass
class _Write:
    id: int
    devices: frozenset
    remaining: int
    unit: int = 1  # chunks are whole multiples of this many bytes
    next_index: int = 0


@dataclass
class Policy:
    write_bw: float = 1e9  # bytes/s, an EWMA over completed chunks
    default_window: float = 0.010  # seconds of writing per chunk without a slack table
    min_chunk: int = 1 << 20
    max_backlog: int = 4 << 30
    max_write_wait: float = 0.5
    idle_chunk: int = 0  # bytes of a chunk on idle devices: what their queues hold
    idle_after: float = 0.2  # seconds without a read that make a device idle
    window: Optional[float] = None
    pending_reads: dict = field(default_factory=dict)  # id -> devices
    reads: dict = field(default_factory=dict)  # in flight: id -> devices
    writes: deque = field(default_factory=deque)
    inflight: dict = field(default_factory=dict)  # device -> [Chunk] (more than one: rule 3)
    backlog: int = 0
    last_progress: float = 0.0
    last_read: dict = field(default_factory=dict)  # device -> when its last read ended
    shared: set = field(default_factory=set)  # chunks that shared a device: no bandwidth sample

    # ---------------------------------------------------------------- reads
    def read_arrives(self, read_id, devices: Iterable) -> None:
        self.pending_reads[read_id] = frozenset(devices)

    def read_may_start(self, read_id, now: float) -> bool:
        devs = self.pending_reads[read_id]
        if any(d in self.inflight for d in devs):
            return False
        return not (self.starving(now) and any(devs & w.devices for w in self.writes))

    def read_starts(self, read_id) -> None:
        self.reads[read_id] = self.pending_reads.pop(read_id)

    def read_done(self, read_id, now: Optional[float] = None) -> None:
        devs = self.reads.pop(read_id, None) or self.pending_reads.pop(read_id, None) or ()
        self.pending_reads.pop(read_id, None)
        if now is not None:
            for d in devs:
                self.last_read[d] = now

    # --------------------------------------------------------------- writes
    def write_arrives(self, write_id: int, devices: Iterable, nbytes: int, now: float,
                      unit: int = 1) -> bool:
        if self.backlog + nbytes > self.max_backlog:
            return False
        if not self.writes and not self.inflight:
            self.last_progress = now
        self.writes.append(_Write(write_id, frozenset(devices), nbytes, unit))
        self.backlog += nbytes
        return True

    def starving(self, now: float) -> bool:
        return bool(self.writes) and now - self.last_progress >= self.max_write_wait

    def chunk_bytes(self, idle: bool = False) -> int:
        window = self.window if self.window is not None else self.default_window
        n = max(self.min_chunk, int(window * self.write_bw))
        return max(n, self.idle_chunk) if idle and self.window is None else n

    def idle(self, devices: frozenset, now: float) -> bool:
        """No read on these devices for idle_after seconds (none pending or in flight either:
        a chunk starts only then). A chunk there fills the device queues (idle_chunk)."""
        return all(now - self.last_read.get(d, -math.inf) >= self.idle_after for d in devices)

    def next_write(self, now: float, only: Optional[int] = None) -> Optional[Chunk]:
        """The write chunk that may start now, if any (of write `only` when given): the oldest
        write whose devices are free, or on idle devices one that fits beside the chunks in
        flight there (rule 3); a younger write never overtakes an older one on a device."""
        active = {d for devs in self.reads.values() for d in devs}
        if not self.starving(now):
            active |= {d for devs in self.pending_reads.values() for d in devs}
        older: set = set()
        for w in self.writes:
            blocked = any(d in active or d in older for d in w.devices)
            older |= w.devices
            if blocked or (only is not None and w.id != only):
                continue
            idle = self.idle(w.devices, now)
            size = self.chunk_bytes(idle)
            busy = max((sum(c.nbytes for c in self.inflight.get(d, ())) for d in w.devices), default=0)
            if busy:  # rule 3: join the chunks in flight only on idle devices, within idle_chunk,
                # and never one's own (a write runs its chunks one after another)
                mine = any(c.write_id == w.id for d in w.devices for c in self.inflight.get(d, ()))
                if mine or not (idle and self.window is None and self.idle_chunk):
                    continue
                size = min(size, self.idle_chunk - busy)
                if size < max(w.unit, self.min_chunk) and size < w.remaining:
                    continue
            n = min(max(w.unit, size // w.unit * w.unit), w.remaining)
            chunk = Chunk(w.id, w.next_index, w.devices, n, last=n == w.remaining)
            if busy:  # neither chunk's time is the device's rate any more
                self.shared.add(chunk)
                self.shared.update(c for d in w.devices for c in self.inflight.get(d, ()))
            w.remaining -= n
            w.next_index += 1
            for d in w.devices:
                self.inflight.setdefault(d, []).append(chunk)
            if chunk.last:
                self.writes.remove(w)
            return chunk
        return None

    def write_abandoned(self, write_id: int) -> None:
        """A write that raised before its last chunk: its chunks not yet issued leave the queue
        and the backlog (left there, it would hold every later write on its devices, and, after
        max_write_wait, every read: a younger write never overtakes an older one)."""
        for w in self.writes:
            if w.id == write_id:
                self.writes.remove(w)
                self.backlog -= w.remaining
                break

    def chunk_done(self, chunk: Chunk, now: float, seconds: float) -> None:
        for d in chunk.devices:
            here = self.inflight.get(d)
            if here and chunk in here:
                here.remove(chunk)
                if not here:
                    del self.inflight[d]
        self.backlog -= chunk.nbytes
        self.last_progress = now
        if chunk in self.shared:
            self.shared.discard(chunk)
        elif seconds > 0 and chunk.nbytes >= self.min_chunk:
            self.write_bw = 0.7 * self.write_bw + 0.3 * (chunk.nbytes / seconds)

    def set_window(self, seconds: Optional[float]) -> None:
        self.window = seconds


class Gate:
    """Thread-safe shell around Policy for the store's reader and writer threads."""

    def __init__(self, policy: Optional[Policy] = None, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy or Policy()
        self.enabled = enabled
        self.clock = clock
        self._cv = threading.Condition()
        self._ids = 0
        self.stats = {"read_waits": 0, "read_wait_s": 0.0, "write_chunks": 0, "refused": 0}

    @contextlib.contextmanager
    def reading(self, devices: Iterable) -> Iterator["Lease"]:
        """Hold `devices` for reads (waiting for at most one write chunk in flight there) for
        the body of the with; the lease it yields can lend them to writes in between."""
        lease = Lease(self, frozenset(devices))
        lease._acquire()
        try:
            yield lease
        finally:
            lease._release()

    def write(self, devices: Iterable, nbytes: int, run: Callable[[int, int], None],
              unit: int = 1) -> bool:
        """Run a write of nbytes in chunks of whole `unit`s: run(offset, length) per chunk, each
        when the policy allows. Returns False, running nothing, when the backlog refuses it."""
        if not self.enabled:
            run(0, nbytes)
            return True
        with self._cv:
            self._ids += 1
            wid = self._ids
            if not self.policy.write_arrives(wid, devices, nbytes, self.clock(), unit):
                self.stats["refused"] += 1
                return False
        done = 0
        try:
            while done < nbytes:
                chunk = self._wait_chunk(wid)
                t0 = self.clock()
                try:
                    run(done, chunk.nbytes)
                finally:
                    with self._cv:
                        self.policy.chunk_done(chunk, self.clock(), self.clock() - t0)
                        self.stats["write_chunks"] += 1
                        self._cv.notify_all()
                done += chunk.nbytes
        except BaseException:  # the rest of this write is not issued: it frees its place
            with self._cv:
                self.policy.write_abandoned(wid)
                self._cv.notify_all()
            raise
        return True

    def _wait_chunk(self, wid: int) -> Chunk:
        with self._cv:
            while True:
                chunk = self.policy.next_write(self.clock(), only=wid)
                if chunk is not None:
                    return chunk
                self._cv.wait(timeout=self.policy.max_write_wait / 4)

    def set_window(self, seconds: Optional[float]) -> None:
        with self._cv:
            self.policy.set_window(seconds)
            self._cv.notify_all()


class Lease:
    """A read hold on devices, from Gate.reading (which takes and releases it)."""

    def __init__(self, gate: Gate, devices: frozenset):
        self.gate, self.devices, self.id = gate, devices, None

    def lend(self, seconds: float) -> None:
        """Let writes use the devices for one window of `seconds` (chunks sized to it), then
        hold them for reads again. The caller's reads must have landed (nothing in flight)."""
        g = self.gate
        self._release()
        g.set_window(seconds)
        time.sleep(seconds)
        g.set_window(None)
        self._acquire()

    def _acquire(self) -> None:
        g = self.gate
        if not g.enabled:
            return
        with g._cv:
            g._ids += 1
            self.id = g._ids
            g.policy.read_arrives(self.id, self.devices)
            if not g.policy.read_may_start(self.id, g.clock()):
                t0 = g.clock()
                g.stats["read_waits"] += 1
                while not g.policy.read_may_start(self.id, g.clock()):
                    g._cv.wait(timeout=0.05)
                g.stats["read_wait_s"] += g.clock() - t0
            g.policy.read_starts(self.id)

    def _release(self) -> None:
        g = self.gate
        if self.id is not None:  # registered at acquire: release it even if `enabled` flipped since
            with g._cv:
                g.policy.read_done(self.id, g.clock())
                g._cv.notify_all()
            self.id = None
