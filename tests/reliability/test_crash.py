"""Crash consistency: SIGKILL a writer at a random moment, reopen, every present page is exact.

A writer process (forked from this one after every import, so a trial costs milliseconds)
stores pages continuously into a small store that evicts all the time:
  - mode "store":   ObjectStore.write_pages, zero-copy and bounce-path batches mixed, two
                    directories, now and then a clear();
  - mode "storage": TuttiStorage.batch_set_v1 from a real SGLang MHA host pool (layer_first,
                    page_first_direct, page_first, page_head, and an unaligned head_dim that
                    takes the bounce path), like SGLang's backup thread;
  - mode "linker":  LayerwiseKV.offload (gather, begin/land/publish) from a CPU pool, with the
                    DRAM tier on (offloads complete before their SSD writes end).
The parent kills it with SIGKILL 1-200 ms after it started writing, reopens the store over
the same directories with the same identity, and reads back every key the index reports
present. A page's bytes are a function of its key (page_content), so the parent knows what
each page must hold. Odd trials reopen with tutti_verify=false: a torn slot would then be
served as wrong bytes and caught by the comparison, not hidden by the checksum.

Per trial: pages acknowledged before the kill, pages present after, failed reads, mismatches.
Invariants, every trial: failed reads == 0, mismatches == 0, and no header the reopen scan
could not trust (bad headers == 0: no torn header either).

    TUTTI_CRASH_TRIALS=200 pytest -q tests/reliability/test_crash.py      # more trials in the suite
    python tests/reliability/test_crash.py --trials 1000 [--mode store|storage|both] [--dir D] [--seed S]
                               [--json trials.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import random
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np

try:
    import pytest
except ImportError:  # standalone runs do not need pytest
    pytest = None

from tutti_hicache.testing.pagedata import page_content
from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import engine_for, extension
from tutti_hicache.layout import PageGeometry
from tutti_hicache.store import ObjectStore

E = extension()
TRIALS = int(os.environ.get("TUTTI_CRASH_TRIALS", "50"))
SEED = int(os.environ.get("TUTTI_CRASH_SEED", "20240611"))
DELAY_MS = (1, 200)

# mode "store": 4 layers x (K, V) of 4 KiB per page, 36 KiB slots, 40 slots over two dirs
GEOM = PageGeometry("mha", 4, 16, 256, 256)
STORE_SLOTS = 40
# mode "storage": (layout, head_dim); head_dim 48 makes 3 KiB objects (bounce path)
POOLS = [("layer_first", 64), ("page_first_direct", 64), ("page_first", 64), ("page_head", 64),
         ("layer_first", 48)]
PAGE, LAYERS, HEADS, POOL_PAGES, STORAGE_SLOTS = 16, 2, 2, 32, 40




@dataclass
class Trial:
    mode: str
    trial: int
    delay_ms: float
    written: int = 0  # pages acknowledged (True) before the kill
    batches: int = 0
    present: int = 0  # pages the reopened index reports
    failed_reads: int = 0  # present but not readable (a torn slot would show here)
    mismatches: int = 0  # read as True with wrong bytes
    bad_headers: int = 0  # headers the reopen scan could not trust (a torn header would count)
    verify: bool = True
    killed: bool = True
    error: str = ""

    def line(self) -> str:
        return (f"{self.mode:7s} trial {self.trial:4d}  kill after {self.delay_ms:6.1f} ms  "
                f"written {self.written:5d}  present {self.present:3d}  failed reads "
                f"{self.failed_reads}  mismatches {self.mismatches}  bad headers "
                f"{self.bad_headers}  verify {int(self.verify)}"
                + (f"  ERROR {self.error}" if self.error else ""))


# ------------------------------------------------------------------------------ mode "store"
def _store_cfg(dirs, verify=True):
    return TuttiConfig.from_sources(
        {"tutti_dirs": [str(d) for d in dirs], "tutti_segment_gb": 1 / 1024,
         "tutti_capacity_gb": STORE_SLOTS * 36864 / 2**30, "tutti_rescan_interval_s": 0.0,
         "tutti_verify": verify}, env={})


STORE_IDENT = {"model": "crash-test", "tp": [0, 1]}


class _Buf:
    """Host memory for n pages of GEOM: aligned, or shifted by 8 bytes (bounce path)."""

    def __init__(self, n: int, shift: int):
        self.m, self.obj = len(GEOM.object_nbytes), GEOM.object_nbytes[0]
        self.page = self.m * self.obj
        self.buf = E.AlignedBuffer(n * self.page + 8192)
        self.a = np.frombuffer(self.buf, dtype=np.uint8)
        self.shift = shift
        self.addrs = (self.buf.address + shift
                      + np.arange(n * self.m, dtype=np.uint64) * self.obj).reshape(n, self.m)

    def view(self, i: int) -> np.ndarray:
        s = self.shift + i * self.page
        return self.a[s:s + self.page]


def _batch_keys(rng: random.Random, trial: int, n: int, older: range) -> tuple:
    """1-16 keys for one write: new ones (t<trial>-<n>, n counting up) and, when `older` trials exist,
    a fifth of them an older trial's key (present: dedupe; evicted: rewritten). Returns (keys, next n)."""
    keys = []
    for _ in range(rng.randint(1, 16)):
        if older and rng.random() < 0.2:
            keys.append(f"t{rng.randrange(older.start, older.stop, older.step)}-{rng.randrange(64)}")
        else:
            keys.append(f"t{trial}-{n}")
            n += 1
    return keys, n


def _store_child(dirs, trial: int, rng: random.Random, progress, started_w) -> None:
    store = ObjectStore(_store_cfg(dirs), GEOM, STORE_IDENT)
    bufs = {False: _Buf(16, 8), True: _Buf(16, 0)}
    os.write(started_w, b"s")
    batch, n = 0, 0
    while True:
        keys, n = _batch_keys(rng, trial, n, range(trial))
        k = len(keys)
        aligned = rng.random() < 0.6
        b = bufs[aligned]
        for i, key in enumerate(keys):
            b.view(i)[:] = page_content(key, b.page)
        ok = store.write_pages(keys, b.addrs[:k], aligned)
        batch += 1
        _report(progress, int(ok.sum()), batch)
        if rng.random() < 0.01:
            store.clear()


def _store_check(dirs, t: Trial) -> None:
    store = ObjectStore(_store_cfg(dirs, t.verify), GEOM, STORE_IDENT)
    try:
        keys = sorted(store.entries())
        t.present = len(keys)
        t.bad_headers = store.stats()["bad_headers"]
        assert t.present <= store.capacity_slots
        dst = _Buf(16, 0)
        for s in range(0, len(keys), 16):
            part = keys[s:s + 16]
            dst.a[:] = 0
            ok = store.read_pages(part, dst.addrs[:len(part)], True)
            for i, key in enumerate(part):
                if not ok[i]:
                    t.failed_reads += 1
                elif not np.array_equal(dst.view(i), page_content(key, dst.page)):
                    t.mismatches += 1
    finally:
        store.close()


# ---------------------------------------------------------------------------- mode "storage"
def _storage(h, dirs, layout: str, head_dim: int, verify=True):
    import torch

    from tutti_hicache.storage import TuttiStorage
    slot = 4096 * (1 + 2 * LAYERS * -(-PAGE * HEADS * head_dim * 2 // 4096))  # header + objects
    cfg = {"tutti_dirs": [str(d) for d in dirs], "tutti_capacity_gb": STORAGE_SLOTS * slot / 2**30,
           "tutti_segment_gb": 1 / 1024, "tutti_rescan_interval_s": 0.0, "tutti_verify": verify}
    pool = h.make_mha_host_pool(layout, LAYERS, HEADS, head_dim, PAGE, torch.bfloat16, POOL_PAGES)
    st = TuttiStorage(h.make_storage_config(extra_config=cfg), {})
    st.register_mem_pool_host(pool)
    return st, pool


def _set_page(pool, start: int, key: str) -> None:
    import torch
    tmpl = pool.get_dummy_flat_data_page()
    raw = torch.from_numpy(page_content(key, tmpl.numel() * tmpl.element_size()))
    pool.set_from_flat_data_page(start, raw.view(tmpl.dtype))


def _storage_child(dirs, trial: int, rng: random.Random, progress, started_w) -> None:
    import torch
    from tutti_hicache.testing import sglang as h
    torch.set_num_threads(1)
    st, pool = _storage(h, dirs, *POOLS[trial % len(POOLS)])
    idx = pool.alloc(POOL_PAGES * PAGE)
    os.write(started_w, b"s")
    batch, n = 0, 0
    while True:
        # older keys only from trials of the same pool geometry
        keys, n = _batch_keys(rng, trial, n, range(trial % len(POOLS), trial, len(POOLS)))
        k = len(keys)
        first = rng.randrange(POOL_PAGES - k + 1)
        pages = idx[first * PAGE:(first + k) * PAGE]
        for i, key in enumerate(keys):
            _set_page(pool, int(pages[i * PAGE]), key)
        ok = st.batch_set_v1(keys, pages)
        batch += 1
        _report(progress, sum(ok), batch)


def _storage_check(dirs, t: Trial) -> None:
    from tutti_hicache.testing import sglang as h
    st, pool = _storage(h, dirs, *POOLS[t.trial % len(POOLS)], verify=t.verify)
    try:
        keys = sorted(st.store.entries())
        t.present = len(keys)
        t.bad_headers = st.store.stats()["bad_headers"]
        assert t.present <= st.store.capacity_slots
        assert st.batch_exists(keys) == len(keys)
        idx = pool.alloc(16 * PAGE)
        tmpl = pool.get_dummy_flat_data_page()
        nbytes = tmpl.numel() * tmpl.element_size()
        for s in range(0, len(keys), 16):
            part = keys[s:s + 16]
            pages = idx[:len(part) * PAGE]
            for i in range(len(part)):
                pool.set_from_flat_data_page(int(pages[i * PAGE]), tmpl.zero_())
            ok = st.batch_get_v1(part, pages)
            got = h.page_bytes(pool, pages)
            for i, key in enumerate(part):
                if not ok[i]:
                    t.failed_reads += 1
                elif got[i] != page_content(key, nbytes).tobytes():
                    t.mismatches += 1
    finally:
        st.close()


# ----------------------------------------------------------------------------- mode "linker"
LINKER_PAGES = 16  # pool pages (and keys per offload at most)


def _linker(dirs):
    """A LayerwiseKV on CPU over mode "store"'s geometry, identity and store settings, with a
    DRAM tier (offloads complete once off the device, before their SSD writes end)."""
    import torch

    from tutti_hicache.layerwise import LayerwiseKV
    cfg = TuttiConfig.from_sources({**{f"tutti_{k}": v for k, v in dataclass_items(_store_cfg(dirs))},
                                    "tutti_host_gb": 64 * 36864 / 2**30, "tutti_stage_mb": 1}, env={})
    rows = (LINKER_PAGES + 1) * GEOM.page_size
    heads = 2
    k = [torch.zeros(rows, heads, 64, dtype=torch.bfloat16) for _ in range(GEOM.num_layers)]
    v = [torch.zeros_like(t) for t in k]
    return LayerwiseKV(cfg, GEOM, STORE_IDENT, k, v, GEOM.page_size), k, v


def dataclass_items(cfg):
    from tutti_hicache.config import SETTINGS
    return [(x.name, getattr(cfg, x.name)) for x in SETTINGS if getattr(cfg, x.name) != x.default]


def _linker_child(dirs, trial: int, rng: random.Random, progress, started_w) -> None:
    """Pool pages filled with each key's page_content (its objects in on-disk order: K and V of
    layer 0, then layer 1, ...), offloaded, the next batch once the offload completed."""
    import torch
    torch.set_num_threads(1)
    lw, k, v = _linker(dirs)
    obj, ps = GEOM.object_nbytes[0], GEOM.page_size
    os.write(started_w, b"s")
    batch, n = 0, 0
    while True:
        keys, n = _batch_keys(rng, trial, n, range(trial))
        keys = list(dict.fromkeys(keys))  # one page per key in a batch
        for i, key in enumerate(keys):
            data = torch.from_numpy(page_content(key, len(GEOM.object_nbytes) * obj))
            r = slice((i + 1) * ps, (i + 2) * ps)
            for layer in range(GEOM.num_layers):
                k[layer][r] = data[2 * layer * obj:(2 * layer + 1) * obj].view(torch.bfloat16).view(ps, 2, 64)
                v[layer][r] = data[(2 * layer + 1) * obj:(2 * layer + 2) * obj].view(torch.bfloat16).view(ps, 2, 64)
        rows = torch.arange(ps, (len(keys) + 1) * ps)
        while not lw.offload(keys, rows, []):
            time.sleep(0.001)
        while lw.num_completed() < 1:
            time.sleep(0.0005)
        ok = lw.pop_completed()
        batch += 1
        _report(progress, len(keys) if ok else 0, batch)


# ------------------------------------------------------------------------------ the harness
def _report(progress, pages: int, batch: int) -> None:
    written = struct.unpack_from("<q", progress, 0)[0]
    struct.pack_into("<qq", progress, 0, written + pages, batch)


def run_trial(mode: str, dirs, trial: int, seed: int, errdir: str) -> Trial:
    rng = random.Random(f"{seed}-{mode}-{trial}")
    t = Trial(mode, trial, round(rng.uniform(*DELAY_MS), 1), verify=trial % 2 == 0)
    progress = mmap.mmap(-1, 16)  # MAP_SHARED|MAP_ANONYMOUS: the child's counters
    r, w = os.pipe()
    errfile = os.path.join(errdir, f"child-{mode}-{trial}.txt")
    child = {"store": _store_child, "storage": _storage_child, "linker": _linker_child}[mode]
    pid = os.fork()
    if pid == 0:  # the writer: everything here, then os._exit, whatever happens
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            child(dirs, trial, random.Random(f"{seed}-{mode}-{trial}-child"), progress, w)
        except BaseException:
            with open(errfile, "w") as f:
                f.write(traceback.format_exc())
        finally:
            os._exit(code)
    os.close(w)
    started = False
    try:
        ready, _, _ = select.select([r], [], [], 30.0)
        started = bool(ready) and os.read(r, 1) == b"s"
        if started:
            time.sleep(t.delay_ms / 1000)
        os.kill(pid, signal.SIGKILL)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    t.killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    t.written, t.batches = struct.unpack_from("<qq", progress, 0)
    progress.close()
    if not t.killed or not started or os.path.exists(errfile):
        if os.path.exists(errfile):
            with open(errfile) as f:
                t.error = f.read().strip().splitlines()[-1]
        else:
            t.error = f"writer exited with status {status}" if started else \
                "writer did not start writing within 30 s"
        return t
    (_storage_check if mode == "storage" else _store_check)(dirs, t)  # linker: the store it wrote
    return t


def run_trials(mode: str, base: str, trials: int, seed: int, verbose=False) -> list[Trial]:
    dirs = [os.path.join(base, "a"), os.path.join(base, "b")] if mode != "storage" \
        else [os.path.join(base, "s")]
    if mode == "linker":  # the offload's gather imports the kernels (Triton: seconds) on first
        import tutti_kernels  # noqa: F401  use; imported here, every fork has them (else only
        # a suite that had imported them already, e.g. by collecting tests/gpu, gave the writer
        # time to write before its kill)
    out = []
    with tempfile.TemporaryDirectory(prefix="tutti-crash-err-") as errdir:
        for i in range(trials):
            t = run_trial(mode, dirs, i, seed, errdir)
            out.append(t)
            if verbose:
                print(t.line(), flush=True)
    return out


def summary(results: list[Trial]) -> str:
    by_mode = {}
    for t in results:
        by_mode.setdefault(t.mode, []).append(t)
    lines = []
    for mode, ts in by_mode.items():
        lines.append(
            f"{mode}: {len(ts)} trials, {sum(t.written for t in ts)} pages written, "
            f"present after kill {min(t.present for t in ts)}-{max(t.present for t in ts)} "
            f"(mean {sum(t.present for t in ts) / len(ts):.1f}), failed reads "
            f"{sum(t.failed_reads for t in ts)}, mismatches {sum(t.mismatches for t in ts)}, "
            f"bad headers {sum(t.bad_headers for t in ts)}, errors {sum(bool(t.error) for t in ts)}")
    return "\n".join(lines)


def _check(results: list[Trial], seed: int) -> None:
    bad = [t for t in results
           if t.error or t.mismatches or t.failed_reads or t.bad_headers or not t.killed]
    assert not bad, (f"seed {seed} (TUTTI_CRASH_SEED): " + "; ".join(t.line() for t in bad[:5])
                     + "\n" + summary(results))
    assert sum(t.written for t in results) > 0
    # the store was full and evicting: most trials end with pages present
    assert sum(t.present > 0 for t in results) >= len(results) // 2, summary(results)


# ------------------------------------------------------------------------------------ tests
if pytest is not None:
    @pytest.mark.slow
    def test_crash_store_write_pages(store_dirs):
        results = run_trials("store", str(store_dirs[0]), TRIALS, SEED)
        print("\n" + summary(results))
        _check(results, SEED)

    @pytest.mark.slow
    def test_crash_linker_offload_through_the_dram_tier(store_dirs):
        """The linker's offload path (begin/land/publish) with its DRAM tier, which completes
        offloads before their SSD writes end: a SIGKILL loses the pages not yet published, never
        a present page's bytes."""
        results = run_trials("linker", str(store_dirs[0]), max(10, TRIALS // 2), SEED)
        print("\n" + summary(results))
        _check(results, SEED)

    @pytest.mark.slow
    @pytest.mark.sglang
    def test_crash_storage_batch_set_v1(sglang, store_dirs):
        results = run_trials("storage", str(store_dirs[0]), TRIALS, SEED)
        print("\n" + summary(results))
        _check(results, SEED)
        # the store a writer was killed in leaves nothing fsck objects to
        from tutti_hicache.cli import main as cli_main
        assert cli_main(["fsck", os.path.join(str(store_dirs[0]), "s")]) == 0


    class _EngineProxy:
        """Forwards to the real engine; its close() also fires `on_close`; once `hold` is set,
        the next read (a re-scan's header read) runs it first."""

        def __init__(self, real, on_close):
            self._real, self._on_close = real, on_close
            self.hold = None

        def __getattr__(self, name):
            return getattr(self._real, name)

        def submit(self, op, *args):
            hold = self.hold if op == "read" else None
            if hold is not None:
                self.hold = None
                hold()
            return self._real.submit(op, *args)

        def close(self):
            self._real.close()
            self._on_close()

    @pytest.mark.slow  # the held re-scan waits out its 2 s hold
    def test_close_during_a_rescan_is_quiet(tmp_path, caplog):
        import threading
        dirs = [tmp_path / "a", tmp_path / "b"]
        entered, release = threading.Event(), threading.Event()
        w = ObjectStore(_store_cfg(dirs), GEOM, STORE_IDENT)
        r = ObjectStore(_store_cfg(dirs), GEOM, STORE_IDENT, writer=False,  # like an MLA rank
                        engine=_EngineProxy(engine_for(_store_cfg(dirs)), release.set))
        try:
            src = _Buf(4, 0)
            keys = [f"rescan-{i}" for i in range(4)]
            for i, k in enumerate(keys):
                src.view(i)[:] = page_content(k, src.page)
            assert w.write_pages(keys, src.addrs[:4], True).all()

            def held():  # the re-scan has started and is slow (a big store)
                entered.set()
                release.wait(2.0)

            r.engine.hold = held
            assert r.prefix_len(keys) == 0  # a miss asks for a re-scan
            assert entered.wait(10)
            r.close()  # joins the re-scan thread
            failed = [x for x in caplog.records if "re-scan failed" in x.getMessage()]
            assert not failed, failed[0].exc_text
        finally:
            r.close()
            w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=TRIALS, help="trials per mode")
    ap.add_argument("--mode", choices=["store", "storage", "linker", "both"], default="both")
    ap.add_argument("--dir", help="base directory (default: a temp dir under /tmp, removed)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--quiet", action="store_true", help="only the summary")
    ap.add_argument("--json", help="write every trial's record here")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the bounce-path notice would repeat per trial
    base = a.dir or tempfile.mkdtemp(prefix="tutti-crash-")
    modes = ["store", "storage"] if a.mode == "both" else [a.mode]
    if "storage" in modes:
        from tutti_hicache.testing import sglang
        sglang.ensure_sglang()
    results = []
    t0 = time.time()
    try:
        for mode in modes:
            results += run_trials(mode, os.path.join(base, mode), a.trials, a.seed, not a.quiet)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(summary(results))
    print(f"{len(results)} trials in {time.time() - t0:.1f} s, seed {a.seed}")
    bad = [t for t in results
           if t.error or t.mismatches or t.failed_reads or t.bad_headers or not t.killed]
    for t in bad:
        print("FAILED:", t.line())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seed": a.seed, "trials": [asdict(t) for t in results],
                       "summary": summary(results).splitlines(), "failed": len(bad)}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
