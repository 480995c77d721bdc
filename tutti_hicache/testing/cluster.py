"""A Mooncake cluster on loopback for tests and the benchmark: a master subprocess and node
processes, each holding real SGLang host pools and tiered backends (tutti_hicache.tiered).

    free_port() -> int
    listening(pid) -> {(address, port)}                     what a process listens on (/proc)
    Master(rpc_port=None, lease_ms=None).start() / .stop() / .address
                                                            mooncake_master, stopped by pid
    master.pause() / .resume()                              SIGSTOP / SIGCONT: a hung master
                                                            (the kernel still accepts connections)
    mooncake_extra(master, **kw) -> dict                    SGLang's Mooncake keys for extra_config
    Node.spawn() -> Node; node.call(verb, *args); node.pause() / .resume(); node.exit()

Every listener the master has is bound to 127.0.0.1 (RPC, metrics; the transfer metadata goes
through P2PHANDSHAKE, so no HTTP metadata server runs: 0.3.13's ignores its host flag and binds
all interfaces). A client advertises 127.0.0.1 (local_hostname, MC_TCP_BIND_ADDRESS); Mooncake
0.3.13 binds its transfer-engine listeners to all interfaces whatever the flags (hard-coded
INADDR_ANY), so these ports are reachable from the host's network while a test runs.

A node runs in its own process (spawned, so it imports SGLang and Mooncake itself) and answers
verbs over a pipe: open, write, exists, read, forget, clear, stats, warnings, wait_state, close.
Pages are written and read through SGLang's own controller methods (testing/sglang.py), and
read pages come back as SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import time
import traceback
from typing import Any, Optional

from . import controller as HC

PAGE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                if width == 8:
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:  # four little-endian 32-bit words
                    ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1]
                                                                    for i in range(0, 16, 4)))
                out.add((ip, int(port, 16)))
    return out


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until each of its threads shows state T in /proc: kill() returns
    once the signal is queued, and a thread stops only when it next leaves the kernel."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
            except OSError:  # the thread exited meanwhile
                continue
        if all(st in ("T", "t", "Z", "X") for st in states):  # stopped, or an exited thread
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout} s: {states}")
        time.sleep(0.005)


def master_binary() -> str:
    import mooncake

    return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")


class Master:
    """mooncake_master on loopback; start() waits until its RPC port accepts connections.
    lease_ms: the master's object lease (default 10 s: an object read or queried cannot be removed
    for that long)."""

    def __init__(self, rpc_port: Optional[int] = None, log_path: Optional[str] = None,
                 lease_ms: Optional[int] = None):
        self._fixed_port = rpc_port is not None
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = free_port()
        self.log_path = log_path or os.devnull
        self.lease_ms = lease_ms
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self, timeout: float = 20.0) -> "Master":
        """Ports it chose itself were free when chosen, not when the master binds them (another
        process may take one meanwhile): a master that exits at start, or one whose port
        another process answers on, is started again on fresh ports, up to 3 times."""
        for _ in range(3):
            why = self._start_once(timeout)
            if why is None:
                return self
            if self._fixed_port:
                break
            self.rpc_port, self.metrics_port = free_port(), free_port()
        raise RuntimeError(why)

    def _start_once(self, timeout: float) -> Optional[str]:
        args = [master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--enable_metric_reporting=false", "--rpc_thread_num=2"]
        if self.lease_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ms}")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"mooncake_master exited with {self.proc.returncode}"
            try:
                if ("127.0.0.1", self.rpc_port) in listening(self.proc.pid):
                    return None
            except OSError:  # it exited meanwhile: the poll above says so next
                pass
            time.sleep(0.05)
        self.stop()
        return f"mooncake_master did not listen on {self.address} in {timeout} s"

    def pause(self) -> None:
        """SIGSTOP: a hung master. Its listening socket stays: connects still succeed. Returns
        once every thread of it has stopped."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a paused master dies at once too
            os.kill(proc.pid, 9)
        if proc is not None:
            proc.wait(timeout=10)


def mooncake_extra(master: Master, segment_mb: int = 64, **kw: Any) -> dict:
    """SGLang MooncakeStore keys for a loopback TCP client of `master`."""
    return {"master_server_address": master.address, "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
            "global_segment_size": segment_mb << 20, **kw}


# ------------------------------------------------------------------ the node process

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class _Node:
    """What one node process holds: named backends over real host pools."""

    def __init__(self):
        from . import sglang as h

        h.ensure_sglang()
        self.h = h
        self.backends: dict[str, tuple] = {}
        self.records = _Records()
        logging.getLogger("tutti_hicache").addHandler(self.records)

    def open(self, name, dirs, extra, model="test-model", layout="page_first", tp=(0, 1),
             n_pages=160, layers=2, heads=2, head_dim=64, page=PAGE, pin=False, capacity_gb=0.1,
             metrics=False):
        import torch

        from ..tiered import TieredStorage

        pool = self.h.make_mha_host_pool(layout, layers, heads, head_dim, page, torch.bfloat16,
                                         n_pages, pin_memory=pin)
        cfg = {"tutti_dirs": list(dirs), "tutti_capacity_gb": capacity_gb,
               "tutti_rescan_interval_s": 0.0, "tutti_cluster_retry_s": 0.3, **extra}
        sc = self.h.make_storage_config(tp_rank=tp[0], tp_size=tp[1], model_name=model,
                                        is_page_first_layout=layout == "page_first",
                                        extra_config=cfg, enable_storage_metrics=metrics)
        backend = TieredStorage(sc, {})
        ctrl = HC.make_controller(backend, pool, page, sc, zero_copy=True)
        self.backends[name] = (backend, pool, ctrl)

    def wait_state(self, name, state="up", timeout=30.0):
        backend = self.backends[name][0]
        deadline = time.monotonic() + timeout
        while backend.tutti_stats().get("cluster_state") != state and time.monotonic() < deadline:
            time.sleep(0.05)
        return backend.tutti_stats().get("cluster_state")

    def _digests(self, pool, idx) -> list[str]:
        return [hashlib.sha256(b).hexdigest() for b in self.h.page_bytes(pool, idx)]

    def write(self, name, keys, seed):
        """Fill fresh pages with random bytes, back them up through SGLang's controller."""
        _, pool, ctrl = self.backends[name]
        idx = pool.alloc(len(keys) * pool.page_size)
        try:
            self.h.fill_random(pool, idx, seed)
            done = HC.controller_backup(ctrl, keys, idx)
            return done, self._digests(pool, idx)
        finally:
            pool.free(idx)

    def exists(self, name, keys):
        return HC.controller_hit_query(self.backends[name][2], keys)

    def read(self, name, keys):
        """Restore into fresh (zeroed) pages through SGLang's _page_transfer: (pages, digests)."""
        out = self.timed_read(name, keys)
        return out["pages"], out["digests"]

    def timed_read(self, name, keys, device=None):
        """read(), timed: the transfer into the host pool, then (with `device`) one H2D copy of
        the restored pages into a device tensor. {pages, digests, transfer_s, h2d_s}."""
        import torch

        _, pool, ctrl = self.backends[name]
        page = pool.page_size
        idx = pool.alloc(len(keys) * page)
        try:
            zero = torch.zeros_like(pool.get_dummy_flat_data_page())
            for start in range(0, len(idx), page):  # no stale bytes can pass for a restore
                pool.set_from_flat_data_page(int(idx[start]), zero)
            t0 = time.perf_counter()
            done = HC.controller_transfer(ctrl, keys, idx) // page
            t1 = time.perf_counter()
            h2d = 0.0
            if device is not None and done:
                h2d = _h2d_seconds(pool, idx[: done * page], device)
            return {"pages": done, "digests": self._digests(pool, idx[: done * page]),
                    "transfer_s": t1 - t0, "h2d_s": h2d}
        finally:
            pool.free(idx)

    def drain(self, name):
        """Wait until the backend's queued promotions are written; the seconds it took."""
        t0 = time.perf_counter()
        self.backends[name][0].drain_promotions()
        return time.perf_counter() - t0

    def forget(self, name, keys):
        return self.backends[name][0].store.forget(list(keys))

    def clear(self, name, wait_s=0.0):
        """The backend's clear(); with wait_s, then until its Mooncake objects are gone (True)."""
        backend = self.backends[name][0]
        backend.clear()
        return backend.cluster.wait_retired(wait_s) if wait_s else None

    def stats(self, name):
        return self.backends[name][0].tutti_stats()

    def locate(self, name, key):
        """(segment file, byte offset) of a page in the backend's local tier."""
        return self.backends[name][0].store.locate(key)

    def prefetch_pgs(self, name):
        """SGLang's prefetch metric since the last call (get_stats drains it): pages per get."""
        m = self.backends[name][0].get_stats()
        return list(m.prefetch_pgs) if m is not None else []

    def inner_metrics(self, name):
        """How many entries the cluster tier's own MooncakeStore holds in SGLang's metric lists
        (its prefetch_pgs and backup_pgs)."""
        store = self.backends[name][0].cluster._store
        return sum(len(getattr(store, m, ())) for m in ("prefetch_pgs", "backup_pgs"))

    def warnings(self):
        out, self.records.messages = self.records.messages, []
        return out

    def close(self, name):
        self.backends.pop(name)[0].close()


def _h2d_seconds(pool, idx, device: str) -> float:
    """Copies of the tokens `idx` of a page_first host pool (pinned) into a device tensor, one per
    contiguous run of indices (the pool's free list need not hand out one range): the bytes
    SGLang's load_to_device moves for these pages."""
    import numpy as np
    import torch

    kv = pool.kv_buffer  # page_first: [2, size, layers, heads, dim]
    rows = np.asarray(idx.cpu() if hasattr(idx, "cpu") else idx, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    runs = [(int(r[0]), len(r)) for r in np.split(rows, cuts)]
    dst = torch.empty((2, len(rows)) + tuple(kv.shape[2:]), dtype=kv.dtype, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(2):
        at = 0
        for first, n in runs:
            dst[i, at:at + n].copy_(kv[i, first:first + n], non_blocking=True)
            at += n
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _node_main(conn, env: dict) -> None:
    os.environ.update(env)
    try:
        node = _Node()
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        verb, args, kwargs = conn.recv()
        if verb == "exit":
            for name in list(node.backends):
                node.close(name)
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(node, verb)(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Node:
    """The parent's handle on a node process."""

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @classmethod
    def spawn(cls, method: str = "forkserver") -> "Node":
        """A fresh process. forkserver: forked from a server that has imported SGLang and Mooncake
        once (and started nothing), so that nodes do not each pay the imports; spawn: a new
        interpreter, for nodes that use CUDA (an import may initialize CUDA in the fork server)."""
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["tutti_hicache.testing.node_preload"])
        parent, child = ctx.Pipe()
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        proc = ctx.Process(target=_node_main, args=(child, env), daemon=True)
        proc.start()
        return cls(proc, parent)

    def pause(self) -> None:
        """SIGSTOP the node process: a frozen node (its segment stays mounted for a while).
        Returns once every thread of it has stopped."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def ready(self, timeout: float = 180.0) -> "Node":
        self._answer(timeout)
        return self

    def _answer(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("node process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"node process failed:\n{value}")
        return value

    def call(self, verb: str, *args, timeout: float = 120.0, **kwargs):
        self.conn.send((verb, args, kwargs))
        return self._answer(timeout)

    def exit(self, timeout: float = 60.0) -> None:
        """A graceful exit: backends closed, the process joined (killed by pid if it hangs)."""
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=timeout)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, 9)
            self.proc.join(10)
