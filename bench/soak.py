"""Soak test of the object store: churn at 100% fill, verified reads, re-opens, kills.

Several worker processes share one store namespace (like data-parallel replicas or a server
restarted over its predecessor). In each worker, writer threads store new pages continuously
into a store far smaller than what they write (so it is full and evicting all the time), reader
threads read recent pages of every worker (their own and, through re-scans, the others') and
compare every page read as present with the bytes it must hold (a page's bytes are a function
of its key), and the worker closes and re-opens its store now and then. The coordinator
SIGKILLs a random worker every --kill-s seconds and starts it again. At the end a fresh process
view re-reads every page the index lists, and `tutti-hicache fsck` checks the directory.

    python bench/soak.py --minutes 30 --dir /dev/shm/tutti-soak --json out.json

Prints progress every --progress-s seconds and a summary; --json writes everything (totals,
per worker, progress samples, the final check). Exit status 0 only when no page was ever
served with wrong bytes, no operation raised, the final check and fsck are clean and the files
never exceeded the cap. Checksum failures: with one process (--procs 1) every one is damage and
fails the run; with several, a reader's entry for a slot that another process has since reused
fails its checksum and is served as a miss (a benign race), so they are reported, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback

import numpy as np

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.identity import make_identity
from tutti_hicache.layout import PageGeometry
from tutti_hicache.testing.linker_soak import FIELDS as LINKER_FIELDS
from tutti_hicache.testing.pagedata import page_content

# cumulative counters, one row per worker in shared memory
FIELDS = ("write_ops", "write_pages", "write_refused", "write_bytes", "read_ops", "read_pages",
          "read_hits", "read_bytes", "wrong_pages", "errors", "checksum_failures", "stale_foreign", "read_errors",
          "evictions", "reopens", "rescans", "dedup_skips", "cross_read_pages", "cross_read_hits",
          "log_errors", "log_warnings") + LINKER_FIELDS
F = {name: i for i, name in enumerate(FIELDS)}




def geometry(a) -> PageGeometry:
    return PageGeometry("mha", a.layers, a.page_size, a.token_bytes, a.token_bytes)


def identity(a) -> dict:
    g = geometry(a)
    return make_identity(TuttiConfig(), model="tutti-soak", geometry=g, dtype="bfloat16",
                         pp=(0, 1), cp=(0, 1), tp=(0, 1), heads=[1, a.token_bytes // 2, a.token_bytes // 2])


def store_config(a) -> TuttiConfig:
    return TuttiConfig.from_sources(
        {"tutti_dirs": [os.path.join(a.dir, f"d{i}") for i in range(a.dirs)],
         "tutti_capacity_gb": a.capacity_mb / 1024, "tutti_segment_gb": a.segment_mb / 1024,
         "tutti_rescan_interval_s": a.rescan_s, "tutti_verify": not a.no_verify,
         "tutti_engine": a.engine, "tutti_host_gb": getattr(a, "host_mb", 0) / 1024}, env={})


def key_of(worker: int, gen: int, n: int) -> str:
    return f"w{worker}g{gen}-{n:012d}"


class LogCounter(logging.Handler):
    """Counts the store's log records by level (the soak reports them; they do not fail it)."""

    def __init__(self, add):
        super().__init__(logging.WARNING)
        self.add = add

    def emit(self, record):
        self.add("log_errors" if record.levelno >= logging.ERROR else "log_warnings", 1)


class RWLock:
    """Many operations at once (shared), or one re-open alone (exclusive)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class Buffers:
    """Host memory for a batch of pages: 4 KiB-aligned (zero copy) or shifted (bounce path)."""

    def __init__(self, n: int, g: PageGeometry, shift: int):
        self.m, self.obj = len(g.object_nbytes), g.object_nbytes[0]
        self.page = self.m * self.obj
        self.buf = extension().AlignedBuffer(n * self.page + 8192)
        self.a = np.frombuffer(self.buf, dtype=np.uint8)
        self.shift = shift
        self.addrs = (self.buf.address + shift
                      + np.arange(n * self.m, dtype=np.uint64) * np.uint64(self.obj)).reshape(n, self.m)

    def view(self, i: int) -> np.ndarray:
        s = self.shift + i * self.page
        return self.a[s:s + self.page]


# ------------------------------------------------------------------------------ the worker
class Worker:
    def __init__(self, wid: int, gen: int, a, counters, heads, stop):
        from tutti_hicache.store import ObjectStore
        self.ObjectStore = ObjectStore
        self.wid, self.gen, self.a = wid, gen, a
        self.counters, self.heads, self.stop = counters, heads, stop
        self.g, self.cfg, self.ident = geometry(a), store_config(a), identity(a)
        base = wid * len(FIELDS)
        self.base = [counters[base + i] for i in range(len(FIELDS))]  # earlier incarnations
        self.local = [0.0] * len(FIELDS)
        self.closed_stats = {"checksum_failures": 0, "stale_foreign": 0, "read_errors": 0, "evictions": 0,
                             "rescans": 0, "dedup_skips": 0}
        self.lock = threading.Lock()
        self.gate = RWLock()
        logging.getLogger("tutti_hicache").addHandler(LogCounter(self.add))
        if os.environ.get("TUTTI_SOAK_LOG"):  # show the store's warnings (debugging a soak)
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter(f"[worker {wid}.{gen} %(asctime)s] %(message)s"))
            h.setLevel(logging.WARNING)
            logging.getLogger("tutti_hicache").addHandler(h)
        self.store = ObjectStore(self.cfg, self.g, self.ident)
        self.rng = random.Random(f"{a.seed}-{wid}-{gen}")
        self.errors_logged = 0

    def add(self, name: str, v: float) -> None:
        with self.lock:
            self.local[F[name]] += v

    def error(self, what: str) -> None:
        self.add("errors", 1)
        if self.errors_logged < 5:
            self.errors_logged += 1
            sys.stderr.write(f"[worker {self.wid}] {what}:\n{traceback.format_exc()}\n")

    def publish(self) -> None:
        """Write this incarnation's totals (plus the earlier ones) into shared memory."""
        try:
            with self.gate.shared():
                st = self.store.stats()
        except Exception:
            st = {}
        with self.lock:
            vals = list(self.local)
        for name, v in self.closed_stats.items():
            vals[F[name]] += v + st.get(name, 0)
        row = self.wid * len(FIELDS)
        for i, v in enumerate(vals):
            self.counters[row + i] = self.base[i] + v

    def writer(self, tid: int) -> None:
        a = self.a
        rng = random.Random(f"{a.seed}-{self.wid}-{self.gen}-w{tid}")
        bufs = {True: Buffers(a.batch, self.g, 0), False: Buffers(a.batch, self.g, 8)}
        while not self.stop.value:
            try:
                n = rng.randint(1, a.batch)
                with self.lock:
                    start = int(self.heads[2 * self.wid + 1])
                    self.heads[2 * self.wid + 1] = start + n
                keys = [key_of(self.wid, self.gen, start + i) for i in range(n)]
                if start and rng.random() < 0.1:  # a recent key again: dedupe or rewrite
                    keys[0] = key_of(self.wid, self.gen, rng.randrange(max(0, start - 64), start))
                aligned = rng.random() >= a.unaligned
                b = bufs[aligned]
                for i, k in enumerate(keys):
                    b.view(i)[:] = page_content(k, b.page)
                with self.gate.shared():
                    ok = self.store.write_pages(keys, b.addrs[:n], aligned)
                good = int(ok.sum())
                self.add("write_ops", 1)
                self.add("write_pages", good)
                self.add("write_refused", n - good)
                self.add("write_bytes", good * b.page)
            except Exception:
                self.error("write")

    def reader(self, tid: int) -> None:
        a = self.a
        rng = random.Random(f"{a.seed}-{self.wid}-{self.gen}-r{tid}")
        bufs = {True: Buffers(a.batch, self.g, 0), False: Buffers(a.batch, self.g, 24)}
        window = 2 * self.cfg.capacity_bytes // (self.g.page_nbytes + 4096)
        while not self.stop.value:
            try:
                w = rng.randrange(self.a.procs)
                gen, head = int(self.heads[2 * w]), int(self.heads[2 * w + 1])
                if head == 0:
                    time.sleep(0.01)
                    continue
                n = rng.randint(1, a.batch)
                first = max(0, head - rng.randrange(1, window + 1))
                keys = [key_of(w, gen, first + i) for i in range(n)]
                aligned = rng.random() >= a.unaligned
                b = bufs[aligned]
                b.a[:] = 0
                with self.gate.shared():
                    self.store.prefix_len(keys)  # as SGLang's prefetch does; asks for re-scans
                    ok = self.store.read_pages(keys, b.addrs[:n], aligned)
                hits = int(ok.sum())
                wrong = sum(1 for i in np.flatnonzero(ok)
                            if not np.array_equal(b.view(i), page_content(keys[i], b.page)))
                if wrong:
                    sys.stderr.write(f"[worker {self.wid}] WRONG BYTES in {wrong} page(s) of "
                                     f"{keys[0]}..{keys[-1]}\n")
                self.add("read_ops", 1)
                self.add("read_pages", n)
                self.add("read_hits", hits)
                if w != self.wid:  # pages another process wrote (found through re-scans)
                    self.add("cross_read_pages", n)
                    self.add("cross_read_hits", hits)
                self.add("read_bytes", hits * b.page)
                self.add("wrong_pages", wrong)
            except Exception:
                self.error("read")

    def linker_keys(self, kind: str, n: int):
        """The linker's own key number n, or n recent keys of a random worker's host-tier writers."""
        if kind == "linker":
            return f"w{self.wid}g{self.gen}L-{n:012d}"
        w = self.rng.randrange(self.a.procs)
        gen, head = int(self.heads[2 * w]), int(self.heads[2 * w + 1])
        first = max(0, head - self.rng.randrange(1, 4 * self.a.batch + 1))
        return [key_of(w, gen, first + i) for i in range(n)] if head else []

    def linker(self, tid: int) -> None:
        """The layer-wise path (LayerwiseKV on CPU pools) beside the host tier's threads."""
        from tutti_hicache.testing.linker_soak import LinkerChurn
        rng = random.Random(f"{self.a.seed}-{self.wid}-{self.gen}-l{tid}")
        churn = LinkerChurn(self.cfg, self.g, self.ident, self.a.batch, self.linker_keys, self.add, rng)
        next_reopen = time.monotonic() + self.a.reopen_s * (0.5 + rng.random())
        try:
            while not self.stop.value:
                try:
                    churn.step()
                    if self.a.reopen_s > 0 and time.monotonic() >= next_reopen:
                        churn.reopen()
                        next_reopen = time.monotonic() + self.a.reopen_s
                except Exception:
                    self.error("linker")
        finally:
            churn.close()

    def reopen(self) -> None:
        with self.gate.exclusive():
            st = self.store.stats()
            for name in self.closed_stats:
                self.closed_stats[name] += st.get(name, 0)
            self.store.close()
            self.store = self.ObjectStore(self.cfg, self.g, self.ident)
        self.add("reopens", 1)

    def _guard(self, fn, *args) -> None:
        """A thread that dies is an error (and the soak goes on without it)."""
        try:
            fn(*args)
        except BaseException:
            self.error(f"thread {fn.__name__} died")

    def run(self) -> None:
        self.heads[2 * self.wid] = self.gen
        self.heads[2 * self.wid + 1] = 0
        threads = [threading.Thread(target=self._guard, args=(self.writer, i), daemon=True)
                   for i in range(self.a.writers)]
        threads += [threading.Thread(target=self._guard, args=(self.reader, i), daemon=True)
                    for i in range(self.a.readers)]
        threads += [threading.Thread(target=self._guard, args=(self.linker, i), daemon=True)
                    for i in range(self.a.linker)]
        for t in threads:
            t.start()
        next_reopen = time.monotonic() + self.a.reopen_s * (0.5 + self.rng.random())
        while not self.stop.value:
            time.sleep(0.5)
            self.publish()
            if self.a.reopen_s > 0 and time.monotonic() >= next_reopen:
                try:
                    self.reopen()
                except Exception:
                    self.error("reopen")
                next_reopen = time.monotonic() + self.a.reopen_s
        for t in threads:
            t.join(60)
        self.publish()
        self.store.close()


def worker_main(wid, gen, a, counters, heads, stop) -> None:
    logging.basicConfig(level=logging.ERROR, format=f"[worker {wid}] %(levelname)s %(message)s")
    for h in logging.getLogger().handlers:  # stderr gets errors only ...
        h.setLevel(logging.ERROR)
    logging.getLogger("tutti_hicache").setLevel(logging.WARNING)  # ... LogCounter sees warnings
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us through `stop`
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where is it?
    try:
        Worker(wid, gen, a, counters, heads, stop).run()
    except Exception:
        traceback.print_exc()
        row = wid * len(FIELDS)
        counters[row + F["errors"]] += 1
        sys.exit(1)


# ----------------------------------------------------------------------------- coordinator
def dat_bytes(a) -> int:
    total = 0
    for i in range(a.dirs):
        for r, _, fs in os.walk(os.path.join(a.dir, f"d{i}")):
            total += sum(os.path.getsize(os.path.join(r, f)) for f in fs if f.endswith(".dat"))
    return total


def totals(counters, n_workers) -> dict:
    out = {name: 0.0 for name in FIELDS}
    for w in range(n_workers):
        for i, name in enumerate(FIELDS):
            out[name] += counters[w * len(FIELDS) + i]
    return {k: int(v) for k, v in out.items()}


def final_check(a) -> dict:
    """Open the store afresh, read back every page its index lists, and run fsck."""
    from tutti_hicache.cli import main as cli_main
    from tutti_hicache.store import ObjectStore
    g = geometry(a)
    s = ObjectStore(store_config(a), g, identity(a))
    out = {"pages": len(s), "capacity_slots": s.capacity_slots, "failed": 0, "wrong": 0}
    try:
        keys = sorted(s.entries())
        b = Buffers(a.batch, g, 0)
        for i in range(0, len(keys), a.batch):
            part = keys[i:i + a.batch]
            ok = s.read_pages(part, b.addrs[:len(part)], True)
            out["failed"] += int((~ok).sum())
            out["wrong"] += sum(1 for j in np.flatnonzero(ok)
                                if not np.array_equal(b.view(j), page_content(part[j], b.page)))
    finally:
        s.close()
    out["fsck_exit"] = cli_main(["fsck"] + [os.path.join(a.dir, f"d{i}") for i in range(a.dirs)])
    return out


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--dir", default="/dev/shm/tutti-soak", help="store directory (created)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dirs", type=int, default=2, help="stripe over this many subdirectories")
    ap.add_argument("--capacity-mb", type=float, default=256.0)
    ap.add_argument("--segment-mb", type=float, default=16.0)
    ap.add_argument("--procs", type=int, default=2, help="worker processes sharing the store")
    ap.add_argument("--writers", type=int, default=1, help="writer threads per process")
    ap.add_argument("--readers", type=int, default=1, help="reader threads per process")
    ap.add_argument("--linker", type=int, default=0,
                    help="layer-wise threads per process (LayerwiseKV loads and offloads on CPU pools)")
    ap.add_argument("--host-mb", type=float, default=0,
                    help="the linker threads' DRAM tier (tutti_host_gb), MiB per LayerwiseKV")
    ap.add_argument("--batch", type=int, default=32, help="max pages per operation")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-bytes", type=int, default=512, help="K (and V) bytes per token, layer")
    ap.add_argument("--unaligned", type=float, default=0.25,
                    help="fraction of operations through the bounce path")
    ap.add_argument("--reopen-s", type=float, default=20.0, help="close and re-open every (0: never)")
    ap.add_argument("--kill-s", type=float, default=45.0, help="SIGKILL a worker every (0: never)")
    ap.add_argument("--rescan-s", type=float, default=1.0)
    ap.add_argument("--progress-s", type=float, default=10.0)
    ap.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    ap.add_argument("--no-verify", action="store_true",
                    help="tutti_verify=false (byte comparison still catches wrong pages)")
    ap.add_argument("--fresh", action="store_true", help="remove the store's subdirectories first")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    faulthandler.enable()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    if a.fresh:
        for i in range(a.dirs):
            shutil.rmtree(os.path.join(a.dir, f"d{i}"), ignore_errors=True)
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    cap = int(a.capacity_mb * 2**20)
    print(f"soak: {a.minutes} min on {a.dir} ({a.dirs} dirs), cap {fmt_bytes(cap)}, {a.procs} "
          f"processes x ({a.writers} writers + {a.readers} readers), page "
          f"{fmt_bytes(geometry(a).page_nbytes)}, reopen every {a.reopen_s} s, kill every "
          f"{a.kill_s} s, seed {a.seed}", flush=True)

    ctx = mp.get_context("spawn")
    counters = ctx.Array("d", a.procs * len(FIELDS), lock=False)
    heads = ctx.Array("d", 2 * a.procs, lock=False)  # per worker: generation, next key number
    stop = ctx.RawValue("i", 0)  # no lock: a SIGKILLed worker must not be able to hold it
    gens = [0] * a.procs
    procs = [None] * a.procs

    def start(w):
        p = ctx.Process(target=worker_main, args=(w, gens[w], a, counters, heads, stop),
                        name=f"soak-worker-{w}")
        p.start()
        procs[w] = p

    for w in range(a.procs):
        start(w)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    next_progress, next_kill = t0 + a.progress_s, t0 + a.kill_s
    samples, kills, restarts_after_crash = [], 0, 0
    max_fill = 0.0
    last = totals(counters, a.procs)
    last_t = t0
    interrupted = False
    try:
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            now = time.monotonic()
            max_fill = max(max_fill, dat_bytes(a) / cap)
            for w, p in enumerate(procs):  # a worker that died by itself is restarted, and counted
                if not p.is_alive() and p.exitcode not in (None, -signal.SIGKILL):
                    restarts_after_crash += 1
                    counters[w * len(FIELDS) + F["errors"]] += 1
                    gens[w] += 1
                    start(w)
            if a.kill_s > 0 and now >= next_kill and a.procs:
                w = rng.randrange(a.procs)
                os.kill(procs[w].pid, signal.SIGKILL)
                procs[w].join(30)
                kills += 1
                gens[w] += 1
                start(w)
                next_kill = now + a.kill_s
            if now >= next_progress or now >= end:
                tot = totals(counters, a.procs)
                dt = max(now - last_t, 1e-9)
                s = {"t_s": round(now - t0, 1), **tot, "fill": round(dat_bytes(a) / cap, 4),
                     "kills": kills,
                     "write_MBps": round((tot["write_bytes"] - last["write_bytes"]) / dt / 1e6, 1),
                     "read_MBps": round((tot["read_bytes"] - last["read_bytes"]) / dt / 1e6, 1)}
                samples.append(s)
                hit = tot["read_hits"] / max(1, tot["read_pages"])
                print(f"[{s['t_s']:7.1f} s] ops w {tot['write_ops']} r {tot['read_ops']}  "
                      f"written {fmt_bytes(tot['write_bytes'])} ({s['write_MBps']} MB/s)  read "
                      f"{fmt_bytes(tot['read_bytes'])} ({s['read_MBps']} MB/s)  hit {hit:.0%}  "
                      f"evictions {tot['evictions']}  fill {s['fill']:.0%}  refused "
                      f"{tot['write_refused']}  reopens {tot['reopens']}  kills {kills}  "
                      f"WRONG {tot['wrong_pages']}  errors {tot['errors']}  checksum failures "
                      f"{tot['checksum_failures']}" + (f"  linker: offloaded {tot['lk_offload_pages']} loaded "
          f"{tot['lk_load_pages']} failed {tot['lk_load_failed']} WRONG {tot['lk_wrong_pages']}"
          if a.linker else ""), flush=True)
                last, last_t = tot, now
                next_progress = now + a.progress_s
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the workers", flush=True)
    stop.value = 1
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    elapsed = time.monotonic() - t0
    tot = totals(counters, a.procs)
    print("final check: re-reading every page the index lists, then fsck", flush=True)
    check = final_check(a)
    per_worker = [{name: int(counters[w * len(FIELDS) + i]) for i, name in enumerate(FIELDS)}
                  for w in range(a.procs)]
    # A checksum failure is damage; a reader's entry for a slot another process has since reused
    # fails its checksum too, but the store counts that benign race as stale_foreign (a miss).
    ok = (tot["wrong_pages"] == 0 and tot["errors"] == 0 and check["wrong"] == 0
          and check["failed"] == 0 and check["fsck_exit"] == 0 and tot["read_ops"] > 0
          and tot["write_pages"] > 0 and max_fill <= 1.0 and tot["checksum_failures"] == 0
          and tot["lk_wrong_pages"] == 0 and (a.linker == 0 or tot["lk_load_pages"] > 0))
    result = {
        "ok": ok, "interrupted": interrupted, "duration_s": round(elapsed, 1),
        "args": vars(a), "totals": tot, "kills": kills,
        "worker_crashes": restarts_after_crash, "max_fill": round(max_fill, 4),
        "capacity_bytes": cap, "dat_bytes_end": dat_bytes(a),
        "write_GBps_avg": round(tot["write_bytes"] / elapsed / 1e9, 3),
        "read_GBps_avg": round(tot["read_bytes"] / elapsed / 1e9, 3),
        "hit_rate": round(tot["read_hits"] / max(1, tot["read_pages"]), 4),
        "cross_hit_rate": round(tot["cross_read_hits"] / max(1, tot["cross_read_pages"]), 4),
        "final_check": check, "per_worker": per_worker, "progress": samples,
    }
    print(f"\nsoak {'PASSED' if ok else 'FAILED'} after {elapsed / 60:.1f} min: "
          f"{tot['write_ops'] + tot['read_ops']} operations, {fmt_bytes(tot['write_bytes'])} "
          f"written, {fmt_bytes(tot['read_bytes'])} read (hit rate {result['hit_rate']:.0%}), "
          f"{tot['evictions']} evictions, {tot['write_refused']} pages refused, {tot['reopens']} "
          f"re-opens, {kills} kills, {tot['errors']} errors, {tot['wrong_pages']} wrong pages, "
          f"{tot['checksum_failures']} checksum failures, {tot['stale_foreign']} stale "
          f"cross-process entries (cross-process hit rate "
          f"{result['cross_hit_rate']:.0%}), {tot['log_errors']} error log records, max fill "
          f"{max_fill:.1%}; final check "
          f"{check['pages']} pages, {check['failed']} failed, {check['wrong']} wrong, fsck exit "
          f"{check['fsck_exit']}" + (f"; linker: {tot['lk_offload_pages']} pages offloaded "
          f"({tot['lk_offload_refused']} refused), {tot['lk_load_ops']} layer-wise loads of "
          f"{tot['lk_load_pages']} pages ({tot['lk_load_refused']} refused at pin, "
          f"{tot['lk_load_failed']} failed), {tot['lk_wrong_pages']} wrong pages, "
          f"{tot['lk_reopens']} re-opens" if a.linker else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON written to {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
