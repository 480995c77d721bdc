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
    sf = StatsFile(str(path), min_interval_s=0.2)
    assert sf.dump({"loads": 1})  # written now
    assert not sf.dump({"loads": 2}) and not sf.dump({"loads": 3})  # inside the interval: later
    assert json.loads(path.read_text()) == {"loads": 1}
    t0 = time.monotonic()
    while json.loads(path.read_text()) != {"loads": 3} and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert json.loads(path.read_text()) == {"loads": 3}  # the latest, not the one between
    # a forced write (close) is newer than what the timer holds: the timer must not undo it
    assert not sf.dump({"loads": 4})
    assert sf.dump({"loads": 5}, force=True)
    time.sleep(0.4)
    assert json.loads(path.read_text()) == {"loads": 5}


def test_a_forked_child_catches_up_without_its_parents_timer(tmp_path):
    """A process forked while the parent's timer was pending has the pending state but not the
    timer's thread: its own later change must still reach its file."""
    import json
    import os
    import time
    path = tmp_path / "stats.json"
    sf = StatsFile(str(path), min_interval_s=0.3)
    assert sf.dump({"who": "parent"}) and not sf.dump({"who": "parent, pending"})
    pid = os.fork()
    if pid == 0:  # the child: one more change inside the interval, then wait for it to land
        try:
            sf.path = str(tmp_path / "child.json")
            sf.dump({"who": "child"})
            t0 = time.monotonic()
            while not os.path.exists(sf.path) and time.monotonic() - t0 < 5:
                time.sleep(0.02)
            os._exit(0 if json.loads(open(sf.path).read()) == {"who": "child"} else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


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
