"""The benchmarks' host-memory guard (tutti_hicache/benchmarks/hostmem.py): a real process group
started the way the harness starts servers, a /proc/meminfo stand-in whose MemAvailable the test
lowers, and the kill, the record and the report that follow. Then the groups an earlier call left
running (server.reap_left_over): killed, and a recycled pid never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tutti_hicache.benchmarks import e2e_report, e2e_sglang, hostmem, server

KB = 1024


def write_meminfo(path, total_gib: float, avail_gib: float, shmem_gib: float = 0.0) -> None:
    kib = lambda g: int(g * 2**30 / KB)  # noqa: E731
    path.write_text(f"MemTotal:       {kib(total_gib)} kB\nMemFree:        {kib(avail_gib)} kB\n"
                    f"MemAvailable:   {kib(avail_gib)} kB\nShmem:          {kib(shmem_gib)} kB\n"
                    "HugePages_Total:       0\n")


def test_meminfo_reads_bytes(tmp_path):
    p = tmp_path / "meminfo"
    write_meminfo(p, 128, 100, 40)
    info = hostmem.meminfo(str(p))
    assert info["MemTotal"] == 128 * 2**30 and info["MemAvailable"] == 100 * 2**30
    assert info["Shmem"] == 40 * 2**30 and info["HugePages_Total"] == 0
    assert hostmem.meminfo(str(tmp_path / "none")) == {}


def test_default_floor_is_four_percent_or_two_gib(tmp_path):
    p = tmp_path / "meminfo"
    write_meminfo(p, 128, 100)
    g = hostmem.Guard(str(p)).start()
    try:
        assert g.floor == 128 * 2**30 // 25
    finally:
        g.stop()
    write_meminfo(p, 24, 20)
    g = hostmem.Guard(str(p)).start()
    try:
        assert g.floor == 2 * 2**30
    finally:
        g.stop()


def test_guard_kills_a_server_group_under_the_floor_and_says_why(tmp_path, monkeypatch):
    p = tmp_path / "meminfo"
    write_meminfo(p, 128, 60, shmem_gib=70)
    g = hostmem.Guard(str(p), interval_s=0.05)
    monkeypatch.setattr(server, "GUARD", g)
    # a group like a server's: a parent and a child it starts, both must go
    cmd = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    proc, log = server.start_group(cmd, None, str(tmp_path / "server.log"))
    try:
        with open(f"/proc/{proc.pid}/oom_score_adj") as f:
            assert f.read().strip() == "1000"  # the OOM killer's first choice
        g.start(floor_gb=5)
        time.sleep(0.3)
        assert proc.poll() is None and not g.trips  # 60 GiB available: left alone
        write_meminfo(p, 128, 4.5, shmem_gib=70)
        proc.wait(10)  # killed by the guard
        assert proc.returncode == -9
        t0 = time.time()
        while time.time() - t0 < 5 and not (  # the guard's thread records the kill after it
                g.trips and g.trips[0]["killed_groups"] and proc.pid not in g.groups):
            time.sleep(0.01)
        assert len(g.trips) == 1
        trip = g.trips[0]
        assert trip["killed_groups"] == [proc.pid] and trip["available_gb"] == 4.5
        assert trip["reason"].startswith("host memory: 4.5 GiB available of 128 (floor 5)")
        assert "shared memory (tmpfs, /dev/shm) 70 GiB" in trip["reason"]
        assert trip["largest"] and all(len(x) == 3 for x in trip["largest"])
        assert g.take_low() == 4.5 and g.take_low() is None  # the low point, once
        assert proc.pid not in g.groups  # forgotten: a later kill does not reach a reused pid
    finally:
        g.stop()
        server.stop_group(proc, 5)
        log.close()


def test_stopped_groups_are_forgotten(tmp_path, monkeypatch):
    g = hostmem.Guard(str(tmp_path / "none"))
    monkeypatch.setattr(server, "GUARD", g)
    proc, log = server.start_group(["sleep", "30"], None, str(tmp_path / "s.log"))
    assert g.groups == {proc.pid}
    server.stop_group(proc, 5)
    log.close()
    assert g.groups == set()
    assert g.check() is None  # no /proc/meminfo stand-in: no sample, no kill


def test_the_run_and_the_report_lead_with_the_guards_reason(monkeypatch):
    g = hostmem.Guard()
    g.trips = [{"reason": "host memory: 3 GiB available of 125 (floor 5); ..."}]
    monkeypatch.setattr(e2e_sglang, "GUARD", g)
    run = {"config": "lmcache-dram", "medium": "array-8", "error": "RuntimeError('server died')",
           "host_available_low_gb": {"capwarm": 40.2, "capacity0.8": 3.1, "capacity1": None}}
    e2e_sglang.host_memory_into(run)
    assert run["error"].startswith("host memory: 3 GiB available") and run["error"].endswith(
        "; then RuntimeError('server died')")
    assert run["host_memory_trips"] == g.trips
    rows = e2e_report.ended_early_rows([run, {"config": "tutti-linker", "medium": "array-8"}])
    assert rows == [{"medium": "array-8", "config": "lmcache-dram", "error": run["error"],
                     "host_low": "3.1 (capacity0.8)"}]
    md = e2e_report.report_markdown([run], 4096)
    assert "### Configurations that ended early" in md and "3.1 (capacity0.8)" in md


def _alive(pid: int) -> bool:
    return server.proc_stat(pid)[:1] not in ([], ["Z"])  # gone, or a zombie


def test_a_group_left_running_is_reaped_and_a_stopped_one_is_not_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "GUARD", hostmem.Guard(str(tmp_path / "none")))
    stopped, log1 = server.start_group(["sleep", "30"], None, str(tmp_path / "a.log"))
    server.stop_group(stopped, 5)
    log1.close()
    # a harness killed at its time limit: its server (here a leader that started a child, then
    # exited, so the group lives on without its leader) is never stopped
    code = "import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True)"
    left, log2 = server.start_group([sys.executable, "-c", code], None, str(tmp_path / "b.log"))
    left.wait(10)
    log2.close()
    child = int((tmp_path / "b.log").read_text().split()[-1])
    assert _alive(child) and os.getpgid(child) == left.pid
    assert [g[0] for g in server._read_groups()] == [left.pid]  # the stopped one is gone from the list
    reaped = server.reap_left_over()
    assert reaped == [(left.pid, [child])]
    t0 = time.time()
    while _alive(child) and time.time() - t0 < 5:
        time.sleep(0.02)
    assert not _alive(child)
    assert server._read_groups() == [] and server.reap_left_over() == []


def test_a_recycled_pid_is_never_reaped(tmp_path):
    # a listed group whose id is now another live process's pid (another start time): left alone
    me = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = server._start_time(me.pid)
        (tmp_path / "groups").write_text(f"{me.pid} {started - 1}\n")
        assert server.reap_left_over() == []
        assert me.poll() is None
        (tmp_path / "groups").write_text(f"{me.pid} {started}\n")  # the listed process itself
        assert server.reap_left_over() == [(me.pid, [me.pid])]
        assert me.wait(5) == -signal.SIGKILL
    finally:
        if me.poll() is None:
            me.kill()
            me.wait()


def _daemon_child(env=None) -> tuple:
    """A leader that starts a child in its own new session and exits (a double-forking daemon):
    (the group id, the child's pid); the group lives on without its leader."""
    code = ("import os, subprocess; os.setsid(); p = subprocess.Popen(['sleep', '60'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(os.getpid(), p.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    pgid, child = (int(x) for x in out.stdout.split())
    assert _alive(child) and os.getpgid(child) == pgid and not _alive(pgid)
    return pgid, child


def test_a_leaderless_group_another_program_made_under_a_listed_id_is_not_reaped(tmp_path):
    """The listed leader is gone and a daemon of another program now holds a group under its id
    (pid reuse, simulated by listing the daemon's group): without the mark its processes carry,
    it is left alone; with it, it is ours and reaped."""
    pgid, child = _daemon_child()
    try:
        (tmp_path / "groups").write_text(f"{pgid} 12345 {os.getpid()}.1\n")
        assert server.reap_left_over() == [] and _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)
    pgid, child = _daemon_child(env={**os.environ, server.MARK: "7.7"})
    try:
        (tmp_path / "groups").write_text(f"{pgid} 12345 7.7\n")
        assert server.reap_left_over() == [(pgid, [child])]
        t0 = time.time()
        while _alive(child) and time.time() - t0 < 5:
            time.sleep(0.02)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_stopping_a_group_whose_leader_died_kills_what_it_left(tmp_path, monkeypatch):
    """A launcher that exited before stop_group leaves its workers in the group: they are killed,
    not forgotten, and the group leaves the list."""
    monkeypatch.setattr(server, "GUARD", hostmem.Guard(str(tmp_path / "none")))
    code = "import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True)"
    proc, log = server.start_group([sys.executable, "-c", code], None, str(tmp_path / "c.log"))
    proc.wait(10)
    log.close()
    child = int((tmp_path / "c.log").read_text().split()[-1])
    assert _alive(child) and server._marked(child, server._read_groups()[0][2])
    server.stop_group(proc, 5)
    t0 = time.time()
    while _alive(child) and time.time() - t0 < 5:
        time.sleep(0.02)
    assert not _alive(child) and server._read_groups() == []


def test_the_list_survives_harnesses_registering_at_once(tmp_path):
    """Two processes listing groups at the same time lose none (an flock around each change)."""
    code = ("import sys; from tutti_hicache.benchmarks import server as s; s.GROUPS_FILE = sys.argv[1]; "
            "s._start_time = lambda pid: 1; [s._register(int(sys.argv[2]) + i, 't') for i in range(60)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "groups"), str(base)])
             for base in (1_000_000, 2_000_000)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert len(server._read_groups()) == 120


def test_reap_from_the_command_line(tmp_path):
    env = {**os.environ, "TUTTI_BENCH_GROUPS": str(tmp_path / "groups")}
    out = subprocess.run([sys.executable, "-P", "-m", "tutti_hicache.benchmarks.server", "--reap"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stderr
    bad = subprocess.run([sys.executable, "-P", "-m", "tutti_hicache.benchmarks.server"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--reap" in bad.stderr
