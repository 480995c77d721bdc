"""The observability files (tutti_stats_file, tutti_timeline_file) never raise: a write that fails
returns False, and only the first failure is logged."""

import logging

from tutti_hicache.layerwise.timeline import TimelineFile
from tutti_hicache.statsfile import StatsFile


def test_a_failing_file_is_logged_once_and_never_raises(tmp_path, caplog):
    missing = tmp_path / "no-such-dir"
    sf = StatsFile(str(missing / "stats-{pid}.json"), min_interval_s=0)
    tl = TimelineFile(str(missing / "timeline-{pid}.jsonl"))
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        for _ in range(3):
            assert sf.dump({"a": 1}, force=True) is False
            assert tl.write({"a": 1}) is False
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("cannot write tutti_stats_file" in m for m in msgs) == 1
    assert sum("cannot write tutti_timeline_file" in m for m in msgs) == 1
    ok = TimelineFile(str(tmp_path / "t.jsonl"))
    assert ok.write({"a": 1}) and ok.write({"b": 2})
    assert (tmp_path / "t.jsonl").read_text().splitlines() == ['{"a": 1}', '{"b": 2}']
    assert not TimelineFile("").write({"a": 1}) and not StatsFile("").dump({"a": 1})


def test_a_dump_inside_the_interval_is_written_when_it_ends(tmp_path):
    """The rate limit must not lose the last change: a load counted just after another write,
    with nothing after it (a server stopped without a close), still reaches the file."""
    import json
    import time
    path = tmp_path / "stats.json"
    sf = StatsFile(str(path), min_interval_s=1.0)  # the steps below each take far less
    assert sf.dump({"loads": 1})  # written now
    assert not sf.dump({"loads": 2}) and not sf.dump({"loads": 3})  # inside the interval: later
    assert json.loads(path.read_text()) == {"loads": 1}
    t0 = time.monotonic()
    while json.loads(path.read_text()) != {"loads": 3} and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert json.loads(path.read_text()) == {"loads": 3}  # the latest, not the one between
    # a forced write (close) is newer than what the timer holds: the timer must not undo it
    assert not sf.dump({"loads": 4})
    assert sf.dump({"loads": 5}, force=True)
    time.sleep(1.3)  # past the interval the timer would have fired in
    assert json.loads(path.read_text()) == {"loads": 5}


def test_a_forked_child_writes_its_own_file_and_never_the_parents(tmp_path):
    """A process forked while the parent's timer was pending: the parent's pending snapshot is not
    the child's, "{pid}" names the child's own file, and its own change inside the interval
    reaches that file without the parent's timer thread."""
    import json
    import os
    import time
    sf = StatsFile(str(tmp_path / "stats-{pid}.json"), min_interval_s=0.3)
    parent = tmp_path / f"stats-{os.getpid()}.json"
    assert sf.dump({"who": "parent"}) and not sf.dump({"who": "parent, later"})
    pid = os.fork()
    if pid == 0:  # the child: one change inside the interval, then wait for it to land
        try:
            sf.dump({"who": "child"})
            mine = tmp_path / f"stats-{os.getpid()}.json"
            t0 = time.monotonic()
            while not mine.exists() and time.monotonic() - t0 < 5:
                time.sleep(0.02)
            os._exit(0 if json.loads(mine.read_text()) == {"who": "child"} else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    t0 = time.monotonic()
    while json.loads(parent.read_text()) != {"who": "parent, later"} and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert json.loads(parent.read_text()) == {"who": "parent, later"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([parent.name, f"stats-{pid}.json"])


def test_a_fork_while_a_writer_holds_the_lock_leaves_the_child_a_working_file(tmp_path):
    """The parent's catch-up thread holds the file's lock, mid-write, at the fork: that thread does
    not exist in the child, which must still write (and close) its file instead of hanging."""
    import json
    import os
    import threading
    import time
    inside, release = threading.Event(), threading.Event()

    def slow():  # the parent's counters, gathered under the file's lock
        inside.set()
        release.wait(5)
        return {"who": "parent"}
    sf = StatsFile(str(tmp_path / "stats-{pid}.json"), min_interval_s=60)
    writer = threading.Thread(target=sf.dump, args=(slow, True))
    writer.start()
    assert inside.wait(5)
    pid = os.fork()
    if pid == 0:
        try:
            import signal
            signal.alarm(5)  # a hang ends the child with SIGALRM
            ok = sf.dump({"who": "child"}, force=True) and sf.close({"who": "child, closed"})
            mine = tmp_path / f"stats-{os.getpid()}.json"
            os._exit(0 if ok and json.loads(mine.read_text()) == {"who": "child, closed"} else 1)
        except BaseException:
            os._exit(2)
    release.set()
    writer.join(5)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert json.loads((tmp_path / f"stats-{os.getpid()}.json").read_text()) == {"who": "parent"}


def test_counters_gathered_as_the_file_is_written_never_go_back(tmp_path):
    """The linker's loader and offloader both count. The loader's counters take long to gather;
    the offloader counts meanwhile and dumps inside the interval. The file must end with both
    counts, never with the loader's older snapshot over the newer one."""
    import json
    import threading
    import time
    from tutti_hicache.layerwise.stats import LinkerStats

    class Store:  # store.stats(): slow for the loader, as under a busy store's lock
        def stats(self):
            if threading.current_thread().name == "loader":
                time.sleep(0.2)
            return {}
    path = tmp_path / "stats.json"
    stats = LinkerStats(Store(), str(path))
    stats._file.min_interval_s = 0.3
    loader = threading.Thread(target=lambda: stats.add(loads=1), name="loader")
    offloader = threading.Thread(target=lambda: (time.sleep(0.05), stats.add(offloads=1)), name="offloader")
    loader.start(), offloader.start()
    loader.join(), offloader.join()
    want = {"loads": 1, "offloads": 1}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # past any catch-up: the file stays at the latest counts
        time.sleep(0.05)
    got = json.loads(path.read_text())["linker"]
    assert {k: got[k] for k in want} == want
    stats.close()
    assert not stats._file.dump({"late": 1}, force=True)  # closed: later dumps write nothing
    assert json.loads(path.read_text())["linker"]["offloads"] == 1


def test_a_change_inside_the_interval_is_written_at_a_normal_exit(tmp_path):
    """No close, and the process exits before the interval ends: the exit hook writes the last
    snapshot the daemon timer would have."""
    import json
    import subprocess
    import sys
    path = tmp_path / "stats.json"
    code = ("import sys; from tutti_hicache.statsfile import StatsFile; sf = StatsFile(sys.argv[1], 60); "
            "sf.dump({'loads': 1}); sf.dump({'loads': 2})")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
    assert json.loads(path.read_text()) == {"loads": 2}


def test_no_thread_for_the_catch_up_is_not_an_error(tmp_path, monkeypatch):
    """dump never raises: where no thread can be started, the snapshot waits for the next dump."""
    import json
    import threading
    path = tmp_path / "stats.json"
    sf = StatsFile(str(path), min_interval_s=60)
    assert sf.dump({"n": 1})

    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Timer, "start", refuse)
    assert sf.dump({"n": 2}) is False and sf.dump({"n": 3}) is False
    monkeypatch.undo()
    assert sf.dump({"n": 4}, force=True) and json.loads(path.read_text()) == {"n": 4}
