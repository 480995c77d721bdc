"""Namespaces as found on disk, for `tutti-hicache inspect` and `fsck`: nothing created or resized.

At a glance:
    namespaces(dirs) -> {name: [dir, ...]}      tutti-<fingerprint> namespace directories under
                                                dirs, each with the dirs holding it in stripe order
                                                (found as attach finds it, below)
    quarantined(dirs) -> [line]                 namespaces attach set aside (heal.py): path,
                                                reason, segment bytes awaiting reclaim
    ns = ExistingNamespace(dirs, name, writer=False, given=None)
        the namespace as it is. Geometry: an identity.json whose fingerprint is the directory's
        name. Placement as attach finds it (heal.py): a directory's own slot headers
        (witness.py) outrank placement.json, whose markers count only when heal._marker accepts
        them (all four numbers, held twice). Capacity: the segment files' sizes
        (namespace.segment_census; a stray file name sizes nothing). Headers scanned once into
        an index. given: every store directory the operator named, so that one lacking the
        namespace is named (its pages are lost) instead of "pass all of them". writer (fsck
        --repair): flock the rows no live process holds, so their bad slots may be cleared.
        Raises ValueError (one line: why the namespace cannot be checked) or OSError.
    ns.identity, ns.dirs (stripe order), ns.capacity_slots, ns.layout, len(ns), ns.entries()
    ns.notes                                    metadata a server's attach heals (placement.json,
                                                identity.json, a missing namespace directory)
    ns.issues                                   segment files missing, short, cut or stray
    ns.live_writers                             writers registered now (writers/, flock'd)
    ns.check(repair=False) -> dict              read and checksum every indexed page; see check()
    ns.heal() -> (healed, failed, notes, issues)   --repair, after check(): what attach heals
    ns.wear() -> [counters | {"error": why} | None]   each directory's wear.json (wear.py)
    ns.close()

Unlike ObjectStore it never grows the store, removes segment rows, registers as a writer, or
runs a re-scan thread; without --repair it writes nothing. Repair writes tombstones: over a
header that fails its own checksum or magic, or over the header of a page whose payload fails
its checksum, and only in rows it holds. A header that verifies but names another slot or
namespace means the placement found is wrong (or files were moved): it is reported and nothing
is repaired. Otherwise ns.heal() then does what attach would for the placement found: the
metadata (heal.rewrite), and in the rows it holds, segment files made or sized to their row.
"""

from __future__ import annotations

import collections
import os
import re
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import header
from ...config import TuttiConfig
from ...engine import engine_for, extension
from .heal import _marker as heal_marker, _read as read_json, _stripe_order, \
    quarantines, rewrite
from .witness import NONE, witness
from ..index import SlotIndex
from ...layout import HEADER_NBYTES, PageGeometry, Placement, SlotLayout, strided
from ..namespace import FileTable, Namespace, lock_paths, registry_entry, segment_census, segment_name
from ..rows import Rows
from ..scan import Scanner
from ..scheduler import Gate
from ..slot_io import SlotIO
from ...identity import with_geometry
from ..objectstore import PageInfo, drop_entries, log_damaged
from ..wear import FILE_NAME as WEAR_FILE, drive_capacity, read_counters

NAME = re.compile(r"tutti-[0-9a-f]{32}")  # tutti-<fingerprint>, 16 bytes in hex
ATTACH_HEALS = "a server's attach rebuilds it"
MAX_SEGMENT_BYTES = 1 << 50  # where a filesystem's size cannot be read
CHECK_BYTES = 256 << 20  # page bytes read per step of check(), at most (2 GiB of 8 MiB pages before)


def namespaces(dirs: list[str]) -> dict[str, list[str]]:
    """fingerprint dir name -> the dirs holding that namespace, in stripe order where it can be
    found (else in the order given: ExistingNamespace then says why it cannot be checked)."""
    found: dict[str, list] = {}
    for d in dirs:
        for name in sorted(os.listdir(d)):
            ns = os.path.join(d, name)
            if NAME.fullmatch(name) and os.path.isdir(ns) and not os.path.islink(ns):
                found.setdefault(name, []).append(d)
    out = {}
    for name, held in found.items():
        try:
            out[name] = _find(held, name).dirs
        except (ValueError, OSError):
            out[name] = held
    return out


def quarantined(dirs: list[str]) -> list[str]:
    """One line per quarantined namespace under dirs (what attach set aside, and why)."""
    return [f"quarantined: {q} ({reason}); {nbytes / 2**20:.1f} MiB of segments, reclaimed as "
            f"the store grows" for q, reason, nbytes in quarantines(dirs)]


# ------------------------------------------------------------------ finding the placement
@dataclass
class _Found:
    dirs: list  # store directories in stripe order
    identity: dict
    geometry: PageGeometry
    fingerprint: bytes
    placement: Placement
    notes: list = field(default_factory=list)
    sized: bool = True  # the segment size was told by slot headers or markers, not guessed


def _find(held: list[str], name: str, given=None) -> _Found:
    """Identity and placement of namespace `name`, held by the store directories `held`, as
    attach would find them (heal._resolve), without writing anything. ValueError: it cannot
    be checked (why, in one line)."""
    fp = bytes.fromhex(name[len("tutti-"):])
    notes: list[str] = []
    identity, geometry = _identity([os.path.join(d, name) for d in held], fp, name, notes)
    layout = SlotLayout(geometry)
    slot = layout.slot_nbytes
    markers = [_marker(os.path.join(d, name), slot) for d in held]
    wit = [witness(os.path.join(d, name), layout, fp, len(held)) for d in held]
    told_n = {w.n_dirs for w in wit if w.n_dirs}
    n = (next(iter(told_n)) if len(told_n) == 1 else
         _majority(m["n_dirs"] for m, _ in markers if m is not None) or len(held))
    dirs = list(held)
    if n != len(held):
        lacking = [d for d in dict.fromkeys(given or ()) if d not in held]
        source = "slot headers" if len(told_n) == 1 else "placement.json"
        if lacking and n == len(held) + len(lacking):  # every directory given, some lost it
            dirs = [d for d in dict.fromkeys(given) if d in held or d in lacking]
            for d in lacking:
                notes.append(f"{d} has no {name} (removed?): the pages of its stripe are lost; "
                             f"a server's attach recreates it empty")
        elif n > len(held):
            also = f"; {', '.join(lacking)} {'lacks' if len(lacking) == 1 else 'lack'} it" \
                if lacking else ""
            raise ValueError(f"{name} is striped over {n} directories (its {source}); found in "
                             f"{len(held)} ({', '.join(held)}){also}: pass all of them (the "
                             f"server's tutti_dirs)")
        else:
            raise ValueError(f"{name} is striped over {n} directories (its {source}) but is in "
                             f"{len(held)} ({', '.join(held)}): a server with these directories "
                             f"sets it aside at attach and re-homes its pages")
        markers = [_marker(os.path.join(d, name), slot) if d in held else (None, "new")
                   for d in dirs]
    paths = [os.path.join(d, name) for d in dirs]
    wit = [witness(p, layout, fp, n) if d in held else NONE for d, p in zip(dirs, paths)]
    bound = _segment_bound(paths)
    told_sps = {w.slots_per_segment for w in wit
                if w.slots_per_segment and w.slots_per_segment * slot <= bound}
    sps = (next(iter(told_sps)) if len(told_sps) == 1 else
           _majority(m["slots_per_segment"] for m, _ in markers
                     if m is not None and m["n_dirs"] == n))
    sized = sps is not None
    sps = sps or _sps_from_files(paths, slot)
    chosen = (n, slot, sps)
    stripes = [w.stripe for w in wit]
    order = _stripe_order(markers, stripes, chosen, [], paths)  # attach's rules, its notes unused
    for j, i in enumerate(order):
        m, why = markers[i]
        where = f"{paths[i]}/placement.json"
        if why == "new":
            continue
        if m is None:
            notes.append(f"{where} {why}: {ATTACH_HEALS}")
        elif (m["n_dirs"], m["slot_nbytes"], m["slots_per_segment"]) != chosen:
            notes.append(f"{where} says {m['n_dirs']} directories and {m['slots_per_segment']} "
                         f"slots per segment, the slot headers and other markers {n} and {sps}: "
                         f"{ATTACH_HEALS}")
        elif m["dir_index"] != j:
            by = "its slot headers" if stripes[i] is not None else "the other directories"
            notes.append(f"{where} says stripe {m['dir_index']}, {by} {j}: {ATTACH_HEALS}")
    return _Found([dirs[i] for i in order], identity, geometry, fp,
                  Placement(n, slot, sps * slot), notes, sized)


def _identity(paths: list[str], fp: bytes, name: str, notes: list[str]):
    """(identity, geometry) from the first identity.json whose fingerprint is the namespace's
    name; the others are noted. ValueError when none is."""
    found, foreign, whys = None, [], []
    for p in paths:
        obj, why = read_json(os.path.join(p, "identity.json"))
        got, why = None, why or "lacks a usable page geometry"
        if obj is not None:
            try:
                geometry = PageGeometry(*obj["geometry"])
                got = header.fingerprint(with_geometry(obj, geometry))
            except (KeyError, TypeError, ValueError):
                why = "lacks a usable page geometry"
        if got == fp:
            found = found or (obj, geometry)
            continue
        if got is not None:
            why = f"describes another namespace (fingerprint {got.hex()}: edited or copied)"
            foreign.append(p)
        whys.append(f"{p}/identity.json {why}")
        notes.append(f"{p}/identity.json {why}: a server's attach rewrites it")
    if found is None:
        raise ValueError(f"no identity.json of {name} gives its fingerprint ({'; '.join(whys)}): "
                         f"its page geometry is unknown; a server with this identity rewrites it "
                         f"at attach")
    return found


def _marker(ns: str, slot_nbytes: int):
    """heal._marker, and a marker of another slot size or of a segment larger than its
    filesystem counts as damaged too: (marker, "") or (None, why)."""
    m, why = heal_marker(ns)
    if m is None:
        return m, why or "is null, not a marker"
    if m["slot_nbytes"] != slot_nbytes:
        return None, f"records {m['slot_nbytes']}-byte slots, its identity {slot_nbytes}-byte ones"
    if m["slots_per_segment"] * slot_nbytes > _segment_bound([ns]):
        return None, "holds an impossible value (a segment larger than its filesystem)"
    return m, ""


def _segment_bound(paths: list[str]) -> int:
    """The largest segment a namespace in these directories can have: its largest filesystem."""
    return max((drive_capacity(os.path.dirname(p)) for p in paths), default=0) or MAX_SEGMENT_BYTES


def _majority(values) -> int | None:
    """The most common value, None when there is none or a tie."""
    top = collections.Counter(values).most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return top[0][0]


def _sps_from_files(paths: list[str], slot_nbytes: int) -> int:
    """Slots per segment where no header or marker says: the first row's files are whole
    segments when a later row exists, and any size at least theirs places one row alike."""
    sizes = []
    for p in paths:
        try:
            sizes.append(os.path.getsize(os.path.join(p, segment_name(0))))
        except OSError:
            pass
    return max(1, max(sizes, default=0) // slot_nbytes)


def _live_writers(ns_dirs: list[str]) -> int:
    """Writers registered now: files in a namespace directory's writers/ that a process holds
    flock'd (Rows.register). Nothing is removed."""
    live = 0
    for ns in ns_dirs:
        d = os.path.join(ns, "writers")
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            state, fd = registry_entry(os.path.join(d, name))
            live += state == "live"
            if state == "taken":
                os.close(fd)
    return live


class ExistingNamespace:
    def __init__(self, dirs: list[str], name: str, writer: bool = False, given=None):
        found = _find(list(dirs), name, given)
        self._name, self._given, self._writer = name, given, writer
        self._sized = found.sized
        placement = found.placement
        self.identity = found.identity
        self.dirs = found.dirs
        self.notes = found.notes
        self.layout = SlotLayout(found.geometry)
        self._fingerprint = fingerprint = found.fingerprint
        cfg = TuttiConfig(dirs=tuple(self.dirs),
                          segment_gb=placement.segment_file_nbytes / (1 << 30))
        ns_dirs = [os.path.join(d, name) for d in self.dirs]
        census = segment_census(ns_dirs, placement)
        self.capacity_slots = census.slots
        self.issues = census.issues
        self.live_writers = _live_writers(ns_dirs)
        self._ns = Namespace(cfg, fingerprint, placement, census.span, dirs=ns_dirs)
        self._engine = engine_for(cfg)
        self._lock = threading.Lock()
        self._index = SlotIndex()
        self._files = FileTable(self._engine, self._ns, writable=writer)
        self._io = SlotIO(self._engine, self._files, self.layout, placement, cfg,
                          Gate(enabled=False), fingerprint)
        self._rows = Rows(self._ns, self._files, writer)
        self._scan = Scanner(self._ns, self._files, self._rows, self._engine, self.layout,
                             fingerprint, self._index, self._lock, rescan_interval_s=-1.0)
        self._held_fds: list[int] = []  # flocks on the files of incomplete rows held here
        self._held: set[int] = set()  # rows held here whose files are not all there
        rows = list(range(self._ns.n_rows))
        for r in rows:
            complete = self._files.open_row(r, create=False)
            if writer and complete:
                self._rows.try_lock(r)
            elif writer:  # a file missing: hold the ones there, so no writer re-makes the row
                paths = [p for p in (self._ns.segment_path(d, r) for d in self._ns.row_dirs(r))
                         if os.path.exists(p)]
                fds = lock_paths(paths)
                if fds is not None:
                    self._held_fds += fds
                    self._held.add(r)
        self._scan.scan_rows(rows, grant=True)

    def __len__(self) -> int:
        return len(self._index)

    def entries(self) -> dict[str, PageInfo]:
        return {k: PageInfo(e.slot, e.seq, e.checksum, e.owned)
                for k, e in self._index.entries.items()}

    def check(self, repair: bool = False, chunk: int = 256, progress: bool = False) -> dict:
        """Verify every indexed page's payload checksum; classify the damaged headers the scan
        found. A page or header that a live writer rewrote since the scan (its header, read
        again, changed) is counted as `changed`, not as damage.

        With repair: tombstone the bad pages and the headers that fail their own checksum or
        magic, in rows held here; refused (`refused` says why) when a header verifies but names
        another slot or namespace, or when most headers are unreadable. Returns
        {"checked", "changed", "bad", "bad_keys", "bad_headers", "foreign_headers", "dropped",
         "cleared", "refused", "not_repaired": [why], "issues", "notes", "live_writers"}."""
        from tqdm import tqdm
        items = list(self._index.entries.items())
        bad, checked, changed = [], 0, 0
        lay = self.layout
        chunk = max(1, min(chunk, CHECK_BYTES // lay.payload_nbytes))  # bounds the stage's memory
        m = len(lay.object_nbytes)
        for i in tqdm(range(0, len(items), chunk), desc="fsck", unit="chunk", leave=False,
                      disable=not progress):
            part = items[i:i + chunk]
            stage = extension().AlignedBuffer(len(part) * lay.payload_nbytes)
            addrs = lay.staged_objects(strided(stage.address, len(part), lay.payload_nbytes))
            slots = np.array([e.slot for _, e in part], dtype=np.int64)
            ok, _ = self._io.read(slots, addrs, aligned=False, checksum=False)
            sums = self._io.checksums(addrs.reshape(len(part), m))[0]
            suspect = [j for j, ((_, e), good, c) in enumerate(zip(part, ok, sums))
                       if not good or int(c) != e.checksum]
            moved = 0
            if suspect:
                now = self._parse(slots[suspect])
                for j, s in enumerate(suspect):
                    k, e = part[s]
                    if now.valid[j] and now.keys[j] == k and int(now.seq[j]) == e.seq and \
                            int(now.checksum[j]) == e.checksum:
                        bad.append((k, e))
                    else:  # rewritten or cleared by a live writer since the scan
                        moved += 1
            checked += len(part) - moved
            changed += moved
        damaged, foreign, rewritten = self._headers(sorted(self._scan.bad_header_slots))
        changed += rewritten
        refused = None
        if foreign:
            refused = (f"{len(foreign)} slot headers verify but name another slot or namespace: "
                       f"the placement found may be wrong (or segment files were moved), so "
                       f"nothing is repaired")
        elif len(damaged) > len(items):
            refused = (f"most slot headers are unreadable ({len(damaged)} of "
                       f"{len(damaged) + len(items)}): the files may not be this namespace's, "
                       f"so nothing is repaired")
        dropped = cleared = 0
        not_repaired: list[str] = []
        if repair and not refused:
            held = set(self._rows.owned) | self._held
            pages = [e for _, e in bad if self._row(e.slot) in held]
            heads = [s for s in damaged if self._row(s) in held]
            if pages or heads:
                done = self._io.tombstones(*self._files.slot_files(
                    np.array([e.slot for e in pages] + heads, dtype=np.int64)))
                gone = [e for e, ok in zip(pages, done) if ok]
                log_damaged(drop_entries(self._index, gone)[0])
                dropped, cleared = len(gone), int(done[len(pages):].sum())
                if not done.all():
                    not_repaired.append(f"{int((~done).sum())} tombstone writes failed (see "
                                        f"the warning above)")
            away = (len(bad) - len(pages), len(damaged) - len(heads))
            if any(away):
                not_repaired.append(
                    f"{away[0]} bad payloads and {away[1]} unreadable headers lie in rows fsck "
                    f"could not hold: a running server holds them (it drops a bad page when it "
                    f"reads it; stop it and run fsck --repair again to clear them now)")
        elif repair:
            not_repaired.append(refused)
        # a file that changed between the two looks (a live writer growing the store) is no
        # finding; one that looks the same both times is
        now_issues = set(segment_census(self._ns.dirs, self._ns.placement).issues)
        return {"checked": checked, "changed": changed, "bad": len(bad),
                "bad_keys": [k for k, _ in bad][:20], "bad_headers": len(damaged),
                "foreign_headers": len(foreign), "dropped": dropped, "cleared": cleared,
                "refused": refused, "not_repaired": not_repaired,
                "issues": [x for x in self.issues if x in now_issues], "notes": list(self.notes),
                "live_writers": max(self.live_writers, _live_writers(self._ns.dirs))}

    def heal(self) -> tuple[list[str], list[str], list[str], list[str]]:
        """fsck --repair, after check(): what a server's attach would heal, done now (writer
        only). The metadata of every directory (heal.rewrite, for the placement found here),
        and the segment files of the rows held here: a missing one made, a short, cut or
        overlong one sized as its row needs (the slots it gains are empty: their pages were
        already lost, and check() dropped a page cut mid-slot). Rows a live writer holds and
        stray files are left. Returns (what was healed, what could not be, the metadata notes
        left, the segment issues left), one line each."""
        assert self._writer, "heal() needs writer=True"
        # a segment size guessed from the files is not written into the markers (attach
        # writes the configured one): they stay noted, and fsck exits 1 until it runs
        healed = rewrite(self._ns.dirs, self.identity, self._ns.placement, markers=self._sized)
        failed: list[str] = []
        slot_nbytes = self._ns.placement.slot_nbytes
        for r in sorted(set(self._rows.owned) | self._held):
            cut = []  # slots a file ended inside: their zero-filled rest must not read as a header
            for d in self._ns.row_dirs(r):
                path, slots = self._ns.segment_path(d, r), self._ns.file_slots(d, r)
                try:
                    if not os.path.exists(path):
                        self._ns.create_segment(path, len(slots), reclaim_space=False)
                        healed.append(f"{path} was missing: recreated empty")
                    elif (size := os.path.getsize(path)) != len(slots) * slot_nbytes:
                        healed.append(f"{path} sized to its row")
                        if size % slot_nbytes and size // slot_nbytes < len(slots):
                            cut.append(slots[size // slot_nbytes])
                except OSError as e:
                    failed.append(f"{path}: cannot be made ({e.strerror or e})")
                    break
            else:
                try:
                    self._ns.fit_row(r)
                except OSError as e:
                    failed.append(f"row {r}: cannot be sized ({e.strerror or e})")
                    continue
                if cut and not self._io.tombstones(*self._files.slot_files(
                        np.array(cut, dtype=np.int64))).all():
                    failed.append(f"row {r}: a slot header cut in two could not be cleared")
        rows = segment_census(self._ns.dirs, self._ns.placement).rows
        for r in range(self._ns.n_rows, rows):  # past the capacity the files show: no row held
            paths = [p for p in (self._ns.segment_path(d, r) for d in range(len(self._ns.dirs)))
                     if os.path.isfile(p) and os.path.getsize(p) % slot_nbytes]
            fds = lock_paths(paths) if paths else None
            for p in paths if fds is not None else ():  # a slot cut mid-way holds no page
                os.truncate(p, os.path.getsize(p) // slot_nbytes * slot_nbytes)
                healed.append(f"{p} cut back to whole slots")
            for fd in fds or ():
                os.close(fd)
        found = _find([os.path.dirname(p) for p in self._ns.dirs], self._name, self._given)
        issues = segment_census(self._ns.dirs, self._ns.placement).issues
        return healed, failed, found.notes, issues

    def _row(self, slot: int) -> int:
        return int(self._ns.placement.locate([slot])[1][0])

    def _parse(self, slots: np.ndarray):
        """The headers at `slots` now, read again and parsed as the scan parses them."""
        return header.parse(self._read_headers(slots), self._fingerprint, slots,
                            int(self.layout.object_nbytes.sum()), self.layout.geometry.units)

    def _read_headers(self, slots) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        buf = extension().AlignedBuffer(max(1, len(slots)) * HEADER_NBYTES)
        files, offsets = self._files.slot_files(slots)
        res = self._engine.submit("read", files, offsets,
                                  np.full(len(slots), HEADER_NBYTES, np.int64),
                                  strided(buf.address, len(slots), HEADER_NBYTES))
        raw = np.frombuffer(buf, dtype=np.uint8).reshape(-1, HEADER_NBYTES)[:len(slots)].copy()
        raw[res != HEADER_NBYTES] = 0
        return raw

    def _headers(self, slots: list[int]) -> tuple[list[int], list[int], int]:
        """The scan's damaged headers, read again: (damaged: they fail their own magic or
        checksum; foreign: they verify but name another slot or namespace; how many are valid
        or empty now: rewritten since the scan)."""
        if not slots:
            return [], [], 0
        slots_a = np.asarray(slots, dtype=np.int64)
        raw = self._read_headers(slots_a)
        p = header.parse(raw, self._fingerprint, slots_a, int(self.layout.object_nbytes.sum()),
                         self.layout.geometry.units)
        rec = raw.reshape(-1).view(header.DTYPE)
        intact = np.zeros(len(slots), dtype=bool)  # a header pack() wrote, for some slot
        groups: dict = {}
        for i in np.flatnonzero(~p.valid & ~p.empty & (rec["magic"] == header.MAGIC)):
            what = (rec["fingerprint"][i].tobytes(), int(rec["payload_nbytes"][i]),
                    int(rec["n_units"][i]))
            groups.setdefault(what, []).append(int(i))
        for (fp, payload, units), idx in groups.items():
            idx_a = np.array(idx, dtype=np.int64)
            intact[idx_a] = header.parse(raw[idx_a], fp, rec["slot"][idx_a], payload, units).valid
        now = p.valid | p.empty
        damaged = [s for s, x, ok in zip(slots, intact, now) if not x and not ok]
        foreign = [s for s, x, ok in zip(slots, intact, now) if x and not ok]
        return damaged, foreign, int(now.sum())

    def wear(self) -> list:
        """Each directory's lifetime wear counters: a dict, {"error": why} when the file is
        damaged, None when there is none."""
        out = []
        for ns in self._ns.dirs:
            try:
                out.append(read_counters(os.path.join(ns, WEAR_FILE)))
            except (OSError, ValueError) as e:
                out.append({"error": str(e)})
        return out

    def close(self) -> None:
        self._io.wear.flush()  # the tombstones of a repair
        self._engine.close()
        self._rows.close()
        for fd in self._held_fds:
            os.close(fd)
        self._held_fds = []
