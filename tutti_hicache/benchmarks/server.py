"""A real SGLang server for the benchmarks (bench/e2e_sglang.py, bench/faults_sglang.py) and its
clients: every wait ends as soon as the server process is gone.

At a glance:
    srv = Server(cmd, env, log_path, port, top_logprobs=0); srv.wait_ready(timeout); srv.flush(); srv.stop()
    one_request(srv, req, max_new) -> record     one streamed greedy generation (TTFT, ITL, cached
                                                 tokens and SGLang's breakdown, output ids, with
                                                 top_logprobs > 0 each output position's top-k
                                                 logprobs, error)
    run_sequential(srv, reqs, max_new, flush) / run_rate(srv, reqs, rate, max_new)
    warm_batch_kernels(srv, page_size)           SGLang's multi-sequence kernels compiled before a
                                                 concurrent phase
    warm_extend_sizes(srv, sizes, page_size)     its kernels for the sweep's extend sizes, before it
    drop_caches() -> what happened
    tutti_stats(out_dir, config) -> [the stats files tutti's processes of that configuration wrote]
    reap_left_over() -> [groups killed]          what an earlier call left running (a harness
                                                 killed at a time limit cannot stop its servers:
                                                 they run in sessions of their own)

    python -P -m tutti_hicache.benchmarks.server --reap    (bench/gpu.sh, before every family)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import threading
import time

from . import e2e
from .hostmem import GUARD, raise_oom_score


# ------------------------------------------------------------------ the server
class Server:
    """One server process group; every wait on it ends as soon as the process is gone."""

    def __init__(self, cmd: list, env: dict, log_path: str, port: int, top_logprobs: int = 0):
        self.url = f"http://127.0.0.1:{port}"
        self.top_logprobs = top_logprobs  # k of the top-k logprobs each request asks for (0: none)
        self.proc, self.log = start_group(cmd, env, log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        import requests
        t0 = time.time()
        while time.time() - t0 < timeout:
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return time.time() - t0
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not up after {timeout:.0f} s")

    def flush(self) -> bool:
        """Empty the device (and host) caches; the storage tier keeps its pages."""
        import requests
        for _ in range(40):
            if not self.alive():
                raise RuntimeError("server died")
            try:
                if requests.post(self.url + "/flush_cache", timeout=10).ok:
                    time.sleep(0.3)
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        stop_group(self.proc, 60)
        self.log.close()


def start_group(cmd: list, env, log_path: str) -> tuple:
    """(process, log file): cmd in a process group of its own, its output appended to
    log_path after a header line, run in the log's directory (not the checkout, whose
    tutti_hicache/ would shadow the installed package). The group is the OOM killer's first
    choice and the host-memory guard's to kill (hostmem.py); its processes carry a mark in their
    environment (MARK) by which a later call's reap_left_over knows them."""
    log = open(log_path, "a")
    log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n")
    log.flush()
    token = f"{os.getpid()}.{time.time_ns()}"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**(os.environ if env is None else env), MARK: token},
                            cwd=os.path.dirname(log_path) or ".", start_new_session=True)
    raise_oom_score(proc.pid)
    GUARD.watch(proc.pid)
    _register(proc.pid, token)
    return proc, log


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT to a process group started with start_new_session, SIGKILL after grace_s; then
    SIGKILL to what is left of the group once its leader is gone (a launcher that died leaves
    its workers behind: the group's id is not reused while they live)."""
    GUARD.forget(proc.pid)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if _members(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass  # gone in between
    _unregister(proc.pid)


# ------------------------------------------------------------------ groups left by an earlier call
# Each group start_group starts is listed in GROUPS_FILE ("pgid start-time mark" lines: the leader's
# start time in clock ticks since boot, /proc/PID/stat field 22, and the MARK value its processes
# inherit) until stop_group has stopped it. A harness killed outright (a device call's time limit)
# leaves its servers running, with their GPU memory and pinned host pools; the next call's
# reap_left_over kills them before it starts its own. The file is shared by every harness on the
# machine: each change is made under an flock.
GROUPS_FILE = os.environ.get("TUTTI_BENCH_GROUPS", "/tmp/tutti-bench-groups")
MARK = "TUTTI_BENCH_GROUP"
_groups_lock = threading.Lock()


def proc_stat(pid) -> list:
    """/proc/PID/stat's fields after the command name, from field 3 (the state) on: index 2 is
    the process group, 19 the start time in clock ticks since boot; [] where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(pid: int):
    """The process's start time (clock ticks since boot), or None where it does not exist."""
    fields = proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 else None


def _marked(pid: int, token: str) -> bool:
    """Whether the process's environment carries MARK=token (a process start_group started, or
    one of its children)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARK}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


@contextlib.contextmanager
def _groups_file():
    """The registry's lines [(pgid, start time, mark)] to edit in place, written back at the end;
    held under an flock against other harnesses and this one's threads."""
    with _groups_lock:
        try:
            lock = open(GROUPS_FILE + ".lock", "a")
        except OSError:
            lock = None  # bookkeeping for the next call only: never a reason to fail this one
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            groups = _read_groups()
            yield groups
            _write_groups(groups)
        finally:
            if lock is not None:
                lock.close()


def _read_groups() -> list:
    out = []
    try:
        with open(GROUPS_FILE) as f:
            for line in f:
                parts = line.split()
                if len(parts) in (2, 3) and parts[0].isdigit() and parts[1].isdigit():
                    out.append((int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else ""))
    except OSError:
        pass
    return out


def _write_groups(groups: list) -> None:
    try:
        tmp = f"{GROUPS_FILE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.writelines(f"{g} {t} {m}\n" for g, t, m in groups)
        os.replace(tmp, GROUPS_FILE)
    except OSError:
        pass


def _register(pgid: int, token: str) -> None:
    t = _start_time(pgid)
    if t is not None:
        with _groups_file() as groups:
            groups[:] = [g for g in groups if g[0] != pgid] + [(pgid, t, token)]


def _unregister(pgid: int) -> None:
    with _groups_file() as groups:
        groups[:] = [g for g in groups if g[0] != pgid]


def _members(pgid: int) -> list:
    """Pids of the processes in process group pgid."""
    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and proc_stat(pid)[2:3] == [str(pgid)]]


def reap_left_over() -> list:
    """SIGKILL every listed group still running, and empty the list: [(pgid, pids killed)]. A group
    is ours while its leader is the process that was listed (same pid and start time) or, with the
    leader gone, while one of its members carries the mark the listed group's processes were
    started with (a group id is not reused while any member lives). A recycled pid, or a group
    another program made under it since, is never killed."""
    killed = []
    with _groups_file() as groups:
        for pgid, started, token in groups:
            now = _start_time(pgid)
            if now is not None and now != started:
                continue  # the pid belongs to another process now
            members = _members(pgid)
            if not members or (now is None and not any(_marked(p, token) for p in members if token)):
                continue
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed.append((pgid, members))
            except OSError:
                pass
        groups[:] = []
    return killed


# ------------------------------------------------------------------ clients
def one_request(srv: Server, req: e2e.Request, max_new: int) -> dict:
    """Stream one greedy generation: TTFT, inter-token gaps, SGLang's cached tokens, output ids;
    with srv.top_logprobs = k > 0, "top_logprobs": per output position [[logprob, token id]] *k
    (SGLang's meta_info output_top_logprobs, output positions only: logprob_start_len -1)."""
    import requests
    rec = {"id": req.id, "prompt_tokens": len(req.ids), "cached": req.cached, "ttft_s": None}
    body = {"input_ids": req.ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    k = getattr(srv, "top_logprobs", 0)
    if k:
        body.update(return_logprob=True, top_logprobs_num=k, logprob_start_len=-1)
    rec["sent_ns"] = time.monotonic_ns()  # CLOCK_MONOTONIC: the server's timeline file's clock
    t0 = time.perf_counter()
    stamps, chunks, tops, last = [], [], [], {}
    done = threading.Event()

    def watchdog(resp_box):
        while not done.wait(0.5):
            if not srv.alive() and resp_box:
                resp_box[0].close()  # unblocks the reader below
                return
    box: list = []
    threading.Thread(target=watchdog, args=(box,), daemon=True).start()
    try:
        with requests.post(srv.url + "/generate", json=body, stream=True, timeout=(5, 300)) as r:
            box.append(r)
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                stamps.append(time.perf_counter())
                if len(stamps) == 1:
                    rec["first_token_ns"] = time.monotonic_ns()
                last = json.loads(line[5:])
                chunks.append(list(last.get("output_ids") or []))
                tops.append([[[e[0], e[1]] for e in pos or []]
                             for pos in last.get("meta_info", {}).get("output_top_logprobs") or []])
    except Exception as e:  # a failed request is recorded, never hangs the run
        rec["error"] = repr(e)
    finally:
        done.set()
    meta = last.get("meta_info", {})
    if stamps and "error" not in rec:
        rec["ttft_s"] = stamps[0] - t0
    rec.update(itl_s=[b - a for a, b in zip(stamps, stamps[1:])], e2e_s=time.perf_counter() - t0,
               cached_tokens=meta.get("cached_tokens", 0), details=meta.get("cached_tokens_details"),
               finish_reason=meta.get("finish_reason"),
               output_ids=e2e.output_ids(chunks) if chunks else None)
    if k:
        rec["top_logprobs"] = e2e.output_ids(tops) if tops else None
    if "error" in last:
        rec["error"] = str(last["error"])
    return rec


def run_sequential(srv: Server, reqs: list, max_new: int, flush: bool = False) -> list:
    out = []
    for r in reqs:
        if flush and not r.id.endswith("/l1"):
            srv.flush()
        out.append(one_request(srv, r, max_new))
    return out


def run_rate(srv: Server, reqs: list, rate: float, max_new: int) -> tuple[list, float]:
    """Requests sent at `rate` per second (concurrent); (records, seconds from first send to last end)."""
    out: list = [None] * len(reqs)
    t0 = time.perf_counter()

    def send(i):
        out[i] = one_request(srv, reqs[i], max_new)
    ts = []
    for i in range(len(reqs)):
        ts.append(threading.Thread(target=send, args=(i,)))
        ts[-1].start()
        time.sleep(1.0 / rate)
        if not srv.alive():
            break
    for t in ts:
        t.join()
    return [r for r in out if r is not None], time.perf_counter() - t0


def warm_batch_kernels(srv: Server, page_size: int, seqs: int = 2, seed: int = 7) -> dict:
    """Compile SGLang's kernels for prefill batches of several sequences before a concurrent phase
    measures anything: Triton specializes a kernel on its integer arguments (a value of 1 among
    them), and SGLang logs its attention kernel compiling again for the first batch of two
    sequences, inside whichever measured request first shares a batch (1.2-1.4 s on the H200: one configuration's capacity p99 became 2.4 s while
    another's, whose pairs never met in one batch, did not). One /generate with `seqs` new
    prompts (a batch), then the same prompts with new suffixes (a batch extending cached
    prefixes), a few tokens each; {"seconds", "ok"}. The prompts are the harness's own random
    ids, two pages and a bit, so the tier stores a few pages of them and nothing else changes."""
    import random
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 30000) for _ in range(2 * page_size + 7)] for _ in range(seqs)]
    t0, ok = time.time(), True
    for tail in (0, page_size):
        ok = _generate(srv, [h + [rng.randrange(1000, 30000) for _ in range(tail)] for h in heads], 4, 120) and ok
    return {"seconds": round(time.time() - t0, 3), "ok": ok}


def warm_extend_sizes(srv: Server, sizes: list, page_size: int, seed: int = 11) -> dict:
    """Compile SGLang's kernels for the extends a sweep will measure before it measures one: per
    size M, a random prompt of exactly two pages, then the same prompt with M new tokens (an
    extend of exactly M tokens behind a cached, page-aligned prefix, as the sweep's are), one
    output token each. Triton kernels compile per batch shape, and per integer argument's
    divisibility by 16: on the MoE models SGLang's kernels took 0.66-1.7 s for a size it had not
    run (benchmarks.md 7.5), which fell on the sweep point's restore and not on its compute-only
    twin, run just after with the same size. A head of two pages and a bit left the bit to the
    extend (M + 7 tokens) and compiled the wrong variant. {"sizes", "seconds", "ok"}."""
    import random
    rng = random.Random(seed)
    t0, ok = time.time(), True
    for m in sizes:
        head = [rng.randrange(1000, 30000) for _ in range(2 * page_size)]  # whole pages: all cached
        for ids in (head, head + [rng.randrange(1000, 30000) for _ in range(m)]):
            ok = _generate(srv, ids, 1, 300) and ok
    return {"sizes": list(sizes), "seconds": round(time.time() - t0, 3), "ok": ok}


def _generate(srv: Server, ids: list, max_new: int, timeout_s: float) -> bool:
    """One greedy /generate of ids (one prompt, or a batch: a list of prompts), its answer unread;
    whether the server answered OK. Raises once the server process is gone."""
    import requests
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    try:
        with requests.post(srv.url + "/generate", json=body, timeout=(5, timeout_s)) as r:
            ok = r.ok
    except requests.RequestException:
        ok = False
    if not srv.alive():
        raise RuntimeError("server died")
    return ok


def drop_caches() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        return f"not dropped ({e.strerror})"


def config_files(out_dir: str, kind: str, config: str) -> list:
    """Paths of `KIND-CONFIG-PID.EXT` (and `KIND-CONFIG-NODE-PID.EXT`, NODE one letter: the
    cluster run's servers a and b) in out_dir, sorted; kind "stats" (.json) or "timeline"
    (.jsonl). Exact: tutti-linker's are not tutti-linker-copies' or a variant's."""
    ext = {"stats": "json", "timeline": "jsonl"}[kind]
    pat = re.compile(rf"{kind}-{re.escape(config)}-(?:[a-z]-)?\d+\.{ext}")
    return [os.path.join(out_dir, p) for p in sorted(os.listdir(out_dir)) if pat.fullmatch(p)]


def tutti_stats(out_dir: str, config: str) -> list:
    """The JSON of every stats file of `config` in out_dir (config_files; unreadable ones skipped)."""
    out = []
    for path in config_files(out_dir, "stats", config):
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            pass
    return out


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--reap"]:
        sys.exit("usage: python -P -m tutti_hicache.benchmarks.server --reap")
    for pgid, pids in reap_left_over():
        print(f"reaped process group {pgid} left running by an earlier call ({len(pids)} processes)")
