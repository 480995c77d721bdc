"""`tutti-hicache fsck` and `inspect` on damaged, odd or live stores: they find the namespace's
placement as attach does, never clear a header that belongs to another slot, say truthfully what
--repair did and did not do, and size nothing from a file name.

A store of 60 pages over two directories, <tmp>/a and <tmp>/b, with room for 64 slots of 36 KiB
(28 slots per segment file: row 0 holds 56 slots, row 1 the last 8, 4 per directory). Every
damage is made by hand to the closed store's files; the store is then attached again (a real
ObjectStore) to see which pages a repair kept, byte for byte.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest

from test_corruption import GEOM, IDENT, SLOT, cfg_for, flip, keys_of, read_all, write
from tutti_hicache.cli import main as cli_main
from tutti_hicache.store import ObjectStore
from tutti_hicache.store.repair.fsck import ExistingNamespace

N = 60


@pytest.fixture
def two(tmp_path):
    """(dirs [a, b], keys, {key: (segment path, slot offset)}, namespace dirs [a's, b's])."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    ks = keys_of(N)
    write(s, ks)
    loc = {k: s.locate(k) for k in ks}
    ns = [next(p for p in s.ns_dirs if p.startswith(str(d) + os.sep)) for d in dirs]
    s.close()
    return [str(d) for d in dirs], ks, loc, ns


def fsck(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(list(args))
    return rc, capsys.readouterr().out


def served(dirs) -> int:
    """Pages a real attach serves, every byte checked."""
    s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        ok, wrong = read_all(s, keys_of(N))
        assert not wrong
        return int(ok.sum())
    finally:
        s.close()


def segments(dirs) -> dict:
    """Every segment file's bytes: to show a repair wrote nothing."""
    out = {}
    for p in sorted(p for d in dirs for p in glob.glob(f"{d}/tutti-*/seg-*")):
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def edit_marker(ns_dir, keep_check=False, **values):
    """Change placement.json's numbers; keep_check: its "check" copy too (the marker stays
    self-consistent, so only the slot headers can tell it is wrong)."""
    path = os.path.join(ns_dir, "placement.json")
    with open(path) as f:
        m = json.load(f)
    m.update(values)
    if keep_check:
        m["check"] = [m[k] for k in ("n_dirs", "slot_nbytes", "slots_per_segment", "dir_index")]
    with open(path, "w") as f:
        json.dump(m, f)


# ------------------------------------------------------------ the placement, as attach finds it
@pytest.mark.parametrize("field, value", [("dir_index", 1), ("slots_per_segment", 20)])
def test_repair_keeps_every_page_when_a_marker_digit_flips(two, capsys, field, value):
    dirs, ks, loc, ns = two
    edit_marker(ns[0], **{field: value})  # its "check" copy now disagrees: damage, not placement
    before = segments(dirs)
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and f"metadata: {ns[0]}/placement.json disagrees with itself" in out
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")  # rebuilds the marker, as attach would
    assert rc == 0 and f"{N} pages checked, 0 bad payloads, 0 unreadable headers" in out
    assert f"healed: {ns[0]}/placement.json disagrees with itself: rebuilt" in out
    assert "metadata:" not in out and fsck(capsys, "fsck", *dirs)[0] == 0
    assert served(dirs) == N and segments(dirs) == before


def test_stripes_come_from_the_slot_headers_not_the_markers(two, capsys):
    dirs, ks, loc, ns = two
    edit_marker(ns[0], keep_check=True, dir_index=1)  # both markers valid, stripes swapped
    edit_marker(ns[1], keep_check=True, dir_index=0)
    before = segments(dirs)
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and out.count("its slot headers") == 2  # both markers named
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")  # both rebuilt from the headers
    assert rc == 0 and f"{N} pages checked, 0 bad payloads, 0 unreadable headers" in out
    assert out.count("placement.json rebuilt (stripe ") == 2
    assert fsck(capsys, "fsck", *dirs)[0] == 0
    assert segments(dirs) == before and served(dirs) == N


def test_a_header_that_verifies_for_another_slot_is_never_cleared(two, capsys):
    dirs, ks, loc, ns = two
    shutil.copyfile(os.path.join(ns[0], "seg-000001.dat"), os.path.join(ns[1], "seg-000001.dat"))
    before = segments(dirs)
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert segments(dirs) == before  # nothing written
    assert rc == 1 and "2 headers of another slot or namespace" in out
    assert "not repaired: 2 slot headers verify but name another slot" in out


def test_repair_refuses_when_most_headers_are_unreadable(two, capsys):
    dirs, ks, loc, ns = two
    for k in ks[:40]:
        path, off = loc[k]
        flip(path, off + 90, 1)  # inside the checksummed header: unreadable
    before = segments(dirs)
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert segments(dirs) == before
    assert rc == 1 and "40 unreadable headers (not repaired)" in out
    assert "most slot headers are unreadable (40 of 60)" in out


# ------------------------------------------------------------ what --repair did, exit codes
def test_repair_beside_a_live_server_claims_nothing_it_did_not_do(two, capsys):
    dirs, ks, loc, ns = two
    server = ObjectStore(cfg_for(dirs), GEOM, IDENT)  # a live writer: it holds every row
    try:
        for k in ks[:3]:
            path, off = loc[k]
            flip(path, off + 4096 + 100, 0)  # payload
        flip(loc[ks[10]][0], loc[ks[10]][1] + 90, 1)  # header
        before = segments(dirs)
        rc, out = fsck(capsys, "fsck", *dirs, "--repair")
        assert rc == 1 and segments(dirs) == before
        assert "3 bad payloads (not repaired), 1 unreadable headers (not repaired)" in out
        assert "dropped" not in out and "cleared" not in out
        assert "not repaired: 3 bad payloads and 1 unreadable headers lie in rows fsck could " \
               "not hold" in out
    finally:
        server.close()
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert rc == 0 and "3 bad payloads dropped, 1 unreadable headers cleared" in out


def test_repair_exits_1_when_a_namespace_cannot_be_checked(two, capsys):
    dirs, ks, loc, ns = two
    for p in ns:
        with open(os.path.join(p, "identity.json"), "w") as f:
            f.write("{damaged")
    runs = [fsck(capsys, *args, *dirs) for args in (["fsck"], ["fsck", "--repair"])]
    assert [rc for rc, _ in runs] == [1, 1]
    assert all("cannot check: no identity.json" in out for _, out in runs)


def test_a_segment_file_that_is_a_directory_leaves_the_other_rows_checked(two, capsys):
    """A segment file of row 1 replaced by a directory: fsck names it and checks the pages of
    the other rows (opening the row used to raise, and nothing of the namespace was checked)."""
    dirs, ks, loc, ns = two
    path = sorted(p for p in glob.glob(f"{ns[0]}/seg-*"))[1]
    os.unlink(path)
    os.mkdir(path)
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and "not a regular file" in out and "cannot check" not in out
    assert " pages checked" in out and not out.startswith(f"{os.path.basename(ns[0])}: 0 pages checked")


# ------------------------------------------------------------ a live writer
def test_pages_rewritten_after_the_scan_are_not_bad(two):
    dirs, ks, loc, ns = two
    name = os.path.basename(ns[0])
    found = ExistingNamespace(dirs, name)  # the index as the scan read it
    try:
        s = ObjectStore(cfg_for(dirs), GEOM, IDENT)  # a writer then evicts and rewrites slots
        write(s, keys_of(30, "new"))
        s.close()
        r = found.check()
    finally:
        found.close()
    assert r["bad"] == 0 and r["bad_headers"] == 0
    assert r["changed"] == 26 and r["checked"] == N - 26  # 4 free slots taken first, then 26 reused


def test_fsck_says_when_writers_are_live(two, capsys):
    dirs, ks, loc, ns = two
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 0 and "live:" not in out
    server = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        rc, out = fsck(capsys, "fsck", *dirs)
    finally:
        server.close()
    assert rc == 0 and "live: 1 writer process(es) registered" in out


# ------------------------------------------------------------ metadata of the wrong type
@pytest.mark.parametrize("text", ["[]", "null", "7", '"x"', '{"n_dirs": 1e308}'])
@pytest.mark.parametrize("where", ["a", "both"])
def test_placement_json_that_is_not_a_marker(two, capsys, text, where):
    dirs, ks, loc, ns = two
    for p in ns if where == "both" else ns[:1]:
        with open(os.path.join(p, "placement.json"), "w") as f:
            f.write(text)
    rc, out = fsck(capsys, "fsck", *dirs)  # no AttributeError / OverflowError
    assert rc == 1 and f"{N} pages checked, 0 bad payloads" in out  # the headers place them
    assert f"metadata: {ns[0]}/placement.json " in out and ("lacks a field" in out or "null" in out)
    rc, out = fsck(capsys, "inspect", *dirs)
    assert rc == 0 and f"pages: {N}" in out


@pytest.mark.parametrize("values", [{"slots_per_segment": 10**15}, {"slots_per_segment": 2**62},
                                    {"n_dirs": 10**15}])
def test_huge_marker_numbers_size_nothing(two, capsys, values):
    dirs, ks, loc, ns = two
    for p in ns:  # self-consistent markers: only their size gives them away
        edit_marker(p, keep_check=True, **values)
    rc, out = fsck(capsys, "fsck", *dirs)  # no MemoryError, no allocation of petabytes
    assert rc == 1 and f"{N} pages checked, 0 bad payloads" in out and out.count("metadata:") == 2
    assert served(dirs) == N


def test_an_identity_that_is_not_an_object_in_one_directory(two, capsys):
    dirs, ks, loc, ns = two
    with open(os.path.join(ns[1], "identity.json"), "w") as f:
        f.write("[]")
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and f"{N} pages checked" in out
    assert f"metadata: {ns[1]}/identity.json lacks a usable page geometry" in out


# ------------------------------------------------------------ capacity from the files
@pytest.mark.parametrize("stray", ["seg-001000000.dat", "seg-99999999999.dat", "seg-000005.dat"])
def test_a_stray_segment_file_sizes_nothing(two, capsys, stray):
    dirs, ks, loc, ns = two
    open(os.path.join(ns[0], stray), "w").close()
    rc, out = fsck(capsys, "inspect", *dirs)
    assert rc == 0 and "slots: 64 x 36864 B" in out and stray in out
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and f"{N} pages checked, 0 bad payloads" in out
    assert f"segments: {ns[0]}/{stray}" in out
    if stray != "seg-001000000.dat":  # a name the store uses: attach deletes the row, as before
        assert served(dirs) == N and not os.path.exists(os.path.join(ns[0], stray))
        assert fsck(capsys, "fsck", *dirs)[0] == 0


def test_inspect_counts_the_slots_in_the_files(two, capsys):
    dirs, ks, loc, ns = two
    rc, out = fsck(capsys, "inspect", *dirs)
    assert rc == 0 and f"slots: 64 x {SLOT} B = 0.00 GiB" in out and f"pages: {N}" in out


# ------------------------------------------------------------ lost segment files
@pytest.mark.parametrize("row, how, lost", [(0, "delete", 28), (0, "truncate", 28),
                                            (1, "delete", 2), (1, "truncate", 2)])
def test_a_lost_segment_file_is_reported(two, capsys, row, how, lost):
    dirs, ks, loc, ns = two
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 0 and "segments:" not in out  # the capacity-trimmed last row is no finding
    seg = os.path.join(ns[1], f"seg-{row:06d}.dat")
    os.unlink(seg) if how == "delete" else os.truncate(seg, 0)
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and f"{N - lost} pages checked" in out
    need = 28 if row == 0 else 3  # the last row: at least what b's half of it must hold
    want = "missing (deleted?)" if how == "delete" else f"holds 0 of the {need} slots"
    assert f"segments: {seg}: {want}" in out


# ------------------------------------------------------------ messages name the cause
def test_messages_name_the_real_cause(two, capsys, tmp_path):
    dirs, ks, loc, ns = two
    name = os.path.basename(ns[0])
    os.unlink(os.path.join(ns[1], "placement.json"))
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and "pass all of them" not in out and f"{N} pages checked" in out
    assert f"metadata: {ns[1]}/placement.json missing" in out

    with open(os.path.join(ns[0], "identity.json")) as f:
        text = f.read()
    with open(os.path.join(ns[0], "identity.json"), "w") as f:
        f.write(text.replace('"corruption"', '"corruptiox"'))  # valid JSON, another fingerprint
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and "No such file" not in out and f"{N} pages checked" in out
    assert f"{ns[0]}/identity.json describes another namespace" in out

    with open(os.path.join(ns[0], "identity.json"), "w") as f:
        f.write(text)
    rc, out = fsck(capsys, "fsck", dirs[0])  # one of the two directories given
    assert rc == 1 and f"{name}: cannot check: {name} is striped over 2 directories" in out
    assert "pass all of them" in out

    shutil.rmtree(ns[1])  # b lost the namespace: both given
    rc, out = fsck(capsys, "fsck", *dirs)
    assert rc == 1 and "pass all of them" not in out
    assert f"metadata: {dirs[1]} has no {name} (removed?)" in out and "pages checked" in out


# ------------------------------------------------------------ --repair heals what attach heals
@pytest.mark.parametrize("row, how, lost", [(0, "delete", 28), (0, "truncate", 28),
                                            (1, "delete", 2), (0, "cut", 1),
                                            (0, "cut-header", 1)])
def test_repair_remakes_a_lost_or_cut_segment_file(two, capsys, row, how, lost):
    """A segment file deleted, emptied or cut mid-slot: --repair makes it its row's size again
    (the slots it gains are empty; a header cut in two is cleared, not left half zeros), so
    fsck passes afterwards; the pages elsewhere are kept, every byte checked, and the page cut
    in half is dropped, never served."""
    dirs, ks, loc, ns = two
    seg = os.path.join(ns[1], f"seg-{row:06d}.dat")
    size = os.path.getsize(seg)
    if how == "delete":
        os.unlink(seg)
    else:
        os.truncate(seg, {"truncate": 0, "cut": size - SLOT // 2,
                          "cut-header": size - SLOT + 100}[how])  # the last slot's header cut
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert rc == 0 and f"healed: {seg}" in out and "segments:" not in out, out
    # the last row: as far as the other files show the capacity (a server's attach grows it on)
    assert os.path.getsize(seg) == (size if row == 0 else 3 * SLOT)
    assert fsck(capsys, "fsck", *dirs)[0] == 0
    assert served(dirs) == N - lost


def test_repair_rebuilds_metadata_and_a_lost_namespace_directory(two, capsys):
    dirs, ks, loc, ns = two
    with open(os.path.join(ns[0], "identity.json"), "w") as f:
        f.write("{")  # damaged
    os.unlink(os.path.join(ns[1], "placement.json"))
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert rc == 0 and "metadata:" not in out and out.count("healed:") == 2, out
    assert fsck(capsys, "fsck", *dirs)[0] == 0 and served(dirs) == N

    shutil.rmtree(ns[1])  # b lost the namespace: its stripe's pages are gone
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert rc == 0 and f"healed: {ns[1]} was missing: recreated empty" in out, out
    assert fsck(capsys, "fsck", *dirs)[0] == 0
    assert served(dirs) == N // 2


def test_repair_leaves_the_rows_a_live_server_holds(two, capsys):
    """A server holds its rows: --repair rebuilds the metadata but sizes none of its files,
    says what is left, and exits 1."""
    dirs, ks, loc, ns = two
    server = ObjectStore(cfg_for(dirs), GEOM, IDENT)
    try:
        seg = os.path.join(ns[1], "seg-000000.dat")
        size = os.path.getsize(seg)
        os.truncate(seg, size - SLOT)
        rc, out = fsck(capsys, "fsck", *dirs, "--repair")
        assert rc == 1 and f"segments: {seg}: holds 27 of the 28 slots" in out, out
        assert os.path.getsize(seg) == size - SLOT
    finally:
        server.close()


def test_repair_then_fsck_passes_after_random_damage(tmp_path, capsys):
    """1-3 random damages (a bit flipped, a file cut, a file deleted) to any file the store
    wrote, then `fsck --repair`: the next `fsck` passes unless the damage took what only a
    server knows (every identity.json: the geometry) or a whole row from every directory; no
    trial serves a wrong byte."""
    import random
    from tutti_hicache.testing.damage import store_files, flip as flip_bit
    for t in range(40):
        rng = random.Random(f"fsck-random-{t}")
        dirs = [str(tmp_path / f"{t}" / "a"), str(tmp_path / f"{t}" / "b")]
        s = ObjectStore(cfg_for(dirs), GEOM, IDENT)
        write(s, keys_of(N))
        s.close()
        files = store_files(dirs)
        for _ in range(rng.randint(1, 3)):
            p = rng.choice(files)
            if not os.path.exists(p):
                continue
            size, k = os.path.getsize(p), rng.random()
            if k < 0.5 and size:
                flip_bit(p, rng.randrange(size), rng.randrange(8))
            elif k < 0.8:
                os.truncate(p, rng.randrange(size + 1))
            else:
                os.unlink(p)
        _, repaired = fsck(capsys, "fsck", *dirs, "--repair")
        rc, out = fsck(capsys, "fsck", *dirs)
        assert rc == 0 or "cannot check: no identity.json" in repaired or \
            "seg-000000.dat is in no directory" in repaired, (t, repaired, out)
        served(dirs)  # every byte checked
        shutil.rmtree(tmp_path / f"{t}")



def test_repair_keeps_the_pages_a_writer_has_yet_to_rehome(tmp_path, capsys, monkeypatch):
    """A namespace set aside at attach (tutti_dirs grew) waits for a writer to re-home its pages
    by key. fsck --repair remaking a lost segment file must not reclaim those files: fsck
    knows only the capacity the files show, not the server's (it deleted them all, and the
    next attach served none of the 60 old pages)."""
    from tutti_hicache.store.repair import rehome
    a, b = tmp_path / "a", tmp_path / "b"
    cap = {"tutti_capacity_gb": 256 * SLOT / 2**30}
    s = ObjectStore(cfg_for([a], **cap), GEOM, IDENT)
    write(s, keys_of(60, "old"))
    s.close()

    def stopped(self):  # the server stops before its re-home ran
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()
        self._done.set()
    with monkeypatch.context() as m:
        m.setattr(rehome.Rehome, "_run", stopped)
        s = ObjectStore(cfg_for([a, b], **cap), GEOM, IDENT)
        write(s, keys_of(40, "new"))
        s.close()
    set_aside = glob.glob(f"{a}/*quarantine*/seg-*")
    assert set_aside
    os.unlink(sorted(glob.glob(f"{b}/tutti-*/seg-*"))[-1])
    rc, out = fsck(capsys, "fsck", str(a), str(b), "--repair")
    assert rc == 0 and "was missing: recreated empty" in out
    assert glob.glob(f"{a}/*quarantine*/seg-*") == set_aside
    s = ObjectStore(cfg_for([a, b], **cap), GEOM, IDENT)  # re-homes them
    try:
        assert s.rehome_wait(60)
        ok, wrong = read_all(s, keys_of(60, "old"))
        assert ok.all() and not wrong
    finally:
        s.close()


def test_a_segment_size_fsck_can_only_guess_is_not_written(tmp_path, capsys):
    """One directory, a capacity of 20 slots inside a 28-slot segment, placement.json damaged:
    neither slot headers nor a marker tell the segment size, and the file's 20 slots are only a
    guess. --repair leaves the marker to attach (exit 1, noted) rather than writing 20, which
    the next attach would have kept as the namespace's segment size."""
    a = tmp_path / "a"
    cap = {"tutti_capacity_gb": 20 * SLOT / 2**30}
    s = ObjectStore(cfg_for([a], **cap), GEOM, IDENT)
    write(s, keys_of(20))
    s.close()
    marker = glob.glob(f"{a}/tutti-*/placement.json")[0]
    with open(marker, "w") as f:
        f.write("{")
    rc, out = fsck(capsys, "fsck", str(a), "--repair")
    assert rc == 1 and "placement.json damaged" in out and "attach rebuilds it" in out
    s = ObjectStore(cfg_for([a], **cap), GEOM, IDENT)
    try:
        assert s.placement.slots_per_segment == 28
        ok, wrong = read_all(s, keys_of(20))
        assert ok.all() and not wrong
    finally:
        s.close()
    assert fsck(capsys, "fsck", str(a))[0] == 0


def test_repair_takes_attachs_lock_however_the_directories_are_spelled(two, capsys, monkeypatch):
    """Attach locks <min(tutti_dirs)>/<namespace>.lock; fsck given relative paths locked
    another file and rewrote metadata beside a running attach."""
    import fcntl
    dirs, ks, loc, ns = two
    edit_marker(ns[0], dir_index=1)  # something to heal
    name = os.path.basename(ns[0])
    fd = os.open(os.path.join(min(dirs), name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    seen = []
    real = fcntl.flock

    def flock(f, op):  # fsck reaching attach's lock while it is held: proven, then let go
        if op == fcntl.LOCK_EX and os.fstat(f).st_ino == os.fstat(fd).st_ino:
            seen.append(True)
            real(fd, fcntl.LOCK_UN)
        return real(f, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.chdir(dirs[1])
    rc, out = fsck(capsys, "fsck", os.path.relpath(dirs[0]), ".", "--repair")
    os.close(fd)
    assert rc == 0 and seen == [True]


def test_a_file_repair_cannot_make_is_left_and_exits_1(two, capsys, monkeypatch):
    """A missing segment file that cannot be made (a full disk): --repair says so under "not
    repaired", never under "healed", and exits 1."""
    import errno
    from tutti_hicache.store.namespace import Namespace
    dirs, ks, loc, ns = two
    seg = os.path.join(ns[1], "seg-000000.dat")
    os.unlink(seg)

    def full(self, path, n_slots, reclaim_space=True):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(Namespace, "create_segment", full)
    rc, out = fsck(capsys, "fsck", *dirs, "--repair")
    assert rc == 1 and f"not repaired: {seg}: cannot be made (No space left on device)" in out
    assert "healed: " + seg not in out and not os.path.exists(seg)
