"""Attach-time healing: the store never refuses to start because of its own files.

At a glance:
    resolve(cfg, fingerprint, identity, layout) -> Resolved
        .dirs          namespace dirs in stripe order (by each directory's slot headers, else
                       its placement.json marker)
        .placement     the Placement the namespace uses (a recorded segment size is kept)
        .quarantined   namespace dirs set aside this time (renamed <ns>.quarantine-<stamp>)
        .notes         what was healed (also logged as one warning naming the namespace)
        .meta_bytes    metadata bytes written per directory (wear.py counts them)
    reclaim(ns_dirs, need, capacity_bytes, where, floor, slack) -> bytes freed
                   delete quarantined segment files (newest first: rehome.py reads them oldest
                   first) until this namespace's live and quarantined files plus `need` fit in
                   the capacity (+ slack, one segment row, while a re-home runs) and `where`
                   has room for `need`
    quarantines(dirs, name=None) -> [(path, reason, segment bytes)]   for fsck and inspect

A cache's contents are disposable, the server is not: damaged, truncated, foreign or missing
metadata, a changed directory list or segment size never fail attach. Rules (docs/design.md 3.1):
  - identity.json is rebuilt from the identity (the directory name is its fingerprint);
  - a directory's own slot headers (witness.py) tell its stripe, the directory count and the
    segment size, and outrank placement.json; markers that agree with the directory count and
    slot size map the remaining directories to their stripes (a reordered tutti_dirs keeps every
    page); a missing, damaged, self-contradicting or outvoted marker is rebuilt (its own position
    if free, else the first free stripe); a recorded segment size wins over tutti_segment_gb;
  - a directory count or slot size that differs (a directory added or removed, another layout)
    cannot locate any page: every namespace dir is renamed aside, the namespace starts fresh, and
    a writer re-homes the set-aside pages by key in the background (rehome.py);
  - non-files where files belong (a segment, metadata or the namespace itself a directory or the
    reverse, `writers` not a directory) are removed; stale *.tmp files too.
Nothing here can serve wrong KV: every slot header names its slot number, key and checksum, so a
slot found at a position its placement does not predict reads as "no page" (scan.py).
Concurrent attaches of one namespace (MLA ranks) run one at a time under an flock on
<the alphabetically first dir>/tutti-<fingerprint>.lock.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

from ...config import PREFIX, TuttiConfig
from ...layout import Placement, SlotLayout
from .witness import NONE, witness

logger = logging.getLogger("tutti_hicache.store")
QUARANTINE = ".quarantine-"
_FIELDS = ("n_dirs", "slot_nbytes", "slots_per_segment", "dir_index")


@dataclass
class Resolved:
    dirs: list[str]
    placement: Placement
    quarantined: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta_bytes: list[int] = field(default_factory=list)  # written per directory, in .dirs order


def resolve(cfg: TuttiConfig, fingerprint: bytes, identity: dict, layout: SlotLayout) -> Resolved:
    """Check (and heal) the namespace's metadata in every directory; see the module docstring."""
    name = "tutti-" + fingerprint.hex()
    paths = [os.path.join(d, name) for d in cfg.dirs]
    try:
        fd = _lock(os.path.join(min(cfg.dirs), name + ".lock"))  # whatever the list's order
        try:
            r = _resolve(paths, identity, layout, fingerprint, cfg.segment_bytes)
        finally:
            os.close(fd)
    except OSError as e:  # permissions changed under the store dirs: the operator's to fix
        raise ValueError(f"{PREFIX}dirs: cannot repair the namespace {name} in "
                         f"{e.filename or list(cfg.dirs)}: {e.strerror}") from None
    if r.notes:
        logger.warning("tutti: namespace %s: %s", name, "; ".join(r.notes))
    return r


def _resolve(paths: list[str], identity: dict, layout: SlotLayout, fingerprint: bytes,
             segment_bytes: int) -> Resolved:
    n, slot_nbytes = len(paths), layout.slot_nbytes
    want = Placement(n, slot_nbytes, segment_bytes)
    notes: list[str] = []
    for ns in paths:
        if os.path.lexists(ns) and (os.path.islink(ns) or not os.path.isdir(ns)):
            _remove(ns)
            notes.append(f"{ns} was not a directory: removed")
    present = [ns for ns in paths if os.path.isdir(ns)]
    markers = [_marker(ns) if ns in present else (None, "new") for ns in paths]
    wit = [witness(ns, layout, fingerprint, n) if ns in present else NONE for ns in paths]
    groups = collections.Counter((m["n_dirs"], m["slot_nbytes"], m["slots_per_segment"])
                                 for m, _ in markers if m is not None)
    ours = (n, slot_nbytes, want.slots_per_segment)
    top = max(groups.values(), default=0)
    best = [g for g, c in groups.items() if c == top]
    chosen = ours if not groups or ours in best else (best[0] if len(best) == 1 else None)
    told_n = {w.n_dirs for w in wit if w.n_dirs}
    told_sps = {w.slots_per_segment for w in wit if w.slots_per_segment}
    if len(told_n) == 1 or len(told_sps) == 1 or any(w != NONE for w in wit):
        base = chosen or ours  # valid headers at our slot size: the slot size is ours
        chosen = (told_n.pop() if len(told_n) == 1 else base[0], slot_nbytes,
                  told_sps.pop() if len(told_sps) == 1 else base[2])
    quarantined: list[str] = []
    if chosen is None or chosen[:2] != ours[:2]:
        why = (f"its directories disagree on their placement ({sorted(groups)})" if chosen is None
               else f"it was written over {chosen[0]} directories with {chosen[1]}-byte slots, "
                    f"now {n} directories with {slot_nbytes}-byte slots")
        quarantined = [_quarantine(ns, why) for ns in present]
        notes.append(f"{why}: its pages cannot be located in place, so it was set aside as "
                     f"{', '.join(quarantined)} and starts empty; a writer re-homes the set-aside "
                     f"pages by key in the background (what is left is reclaimed as the store "
                     f"grows)")
        markers, wit, chosen = [(None, "new")] * n, [NONE] * n, ours
    elif present:
        notes += [f"{ns} was missing: recreated empty" for ns in paths if ns not in present]
    placement = Placement(n, slot_nbytes, chosen[2] * slot_nbytes)
    # the configuration the markers last saw: a kept order or segment size is said once
    seen = _seen(paths, segment_bytes)
    news = any(m is not None and {k: m.get(k) for k in seen} != seen for m, _ in markers)
    if chosen[2] != want.slots_per_segment and news:
        notes.append(f"keeps its segment size of {chosen[2]} slots ({PREFIX}segment_gb applies "
                     f"to new namespaces)")
    order = _stripe_order(markers, [w.stripe for w in wit], chosen, notes, paths)
    dirs = [paths[i] for i in order]
    if order != list(range(n)) and not quarantined and news:
        notes.append(f"{PREFIX}dirs order changed: directories mapped by their placement.json")
    wrote = []
    for j, ns in enumerate(dirs):
        wrote.append(_heal_files(ns, identity, _new_marker(n, slot_nbytes, chosen[2], j, seen),
                                 markers[order[j]], notes))
    return Resolved(dirs, placement, quarantined, notes, wrote)


def rewrite(paths: list[str], identity: dict, placement: Placement,
            markers: bool = True) -> list[str]:
    """fsck --repair: make the namespace dirs `paths` (in stripe order, as fsck found them) hold
    what attach would write for that placement: identity.json, each placement.json, no
    non-regular segment or `writers` entry, no stale *.tmp (a missing dir is made). Under
    attach's lock. A marker keeps the configuration record its directories agree on, so the next
    attach says nothing new (with none to keep, fsck's directories and the recorded segment
    size make one, which a server listing its directories in another order notes once).
    markers=False: the placement.json files are left as they are. Returns what was healed, one
    line each."""
    notes: list[str] = []
    sps = placement.slots_per_segment
    fd = _lock(os.path.join(min(os.path.dirname(p) for p in paths),
                            os.path.basename(paths[0]) + ".lock"))
    try:
        old = [_marker(ns) if os.path.isdir(ns) else (None, "new") for ns in paths]
        records = {m["configured"] for m, _ in old
                   if m is not None and isinstance(m.get("configured"), str)}
        seen = ({"configured": records.pop()} if len(records) == 1
                else _seen(paths, placement.segment_file_nbytes))
        for j, ns in enumerate(paths):
            if not os.path.isdir(ns):
                notes.append(f"{ns} was missing: recreated empty")
            marker = _new_marker(len(paths), placement.slot_nbytes, sps, j, seen)
            if not markers:
                marker = old[j][0]
            elif old[j][0] is not None and old[j][0] != marker:
                notes.append(f"{ns}/placement.json rebuilt (stripe {j})")
            elif old[j][1] not in ("", "new"):
                notes.append(f"{ns}/placement.json {old[j][1]}: rebuilt")
            _heal_files(ns, identity, marker, old[j], notes)
    finally:
        os.close(fd)
    return notes


def _new_marker(n_dirs: int, slot_nbytes: int, slots_per_segment: int, dir_index: int,
                seen: dict) -> dict:
    """placement.json as attach writes it: the four numbers, their check copy, and the record
    of the configuration that wrote it (_seen)."""
    m = {"n_dirs": n_dirs, "slot_nbytes": slot_nbytes, "slots_per_segment": slots_per_segment,
         "dir_index": dir_index}
    return {**m, "check": list(m.values()), **seen}


def _stripe_order(markers, stripes, chosen, notes: list[str], paths: list[str]) -> list[int]:
    """order[stripe] = config position of the directory holding that stripe. What a directory's
    slot headers say comes first (witness.py), then markers of the chosen placement (one whose
    claim is its own position first); the rest take their own position if free, else the first
    free stripe (headers check every slot, so a wrong guess costs misses, never wrong bytes)."""
    n = len(markers)
    order: list = [None] * n
    claims = [(stripes[i], i, "headers") for i in range(n) if stripes[i] is not None]
    claims += [(m["dir_index"], i, "marker") for i, (m, _) in enumerate(markers)
               if m is not None and stripes[i] is None and
               (m["n_dirs"], m["slot_nbytes"], m["slots_per_segment"]) == chosen]
    for j, i, _ in sorted(claims, key=lambda c: (c[2] != "headers", c[0] != c[1], c[1])):
        if j < n and order[j] is None and i not in order:
            order[j] = i
    for j, i in enumerate(order):
        m, why = markers[i] if i is not None else (None, "")
        if i is not None and why not in ("", "new"):
            notes.append(f"{paths[i]}/placement.json {why}: rebuilt")
        elif i is not None and m is not None and m["dir_index"] != j:
            notes.append(f"{paths[i]}/placement.json disagreed with its slot headers: rebuilt")
    rest = [i for i in range(n) if i not in order]
    for i in rest:
        m, why = markers[i]
        if why != "new":
            notes.append(f"{paths[i]}/placement.json "
                         f"{'disagreed with the others' if m is not None else why}: rebuilt")
        if order[i] is None:
            order[i] = i
    for i in [i for i in rest if i not in order]:
        order[order.index(None)] = i
    return order


def _seen(paths: list[str], segment_bytes: int) -> dict:
    """What a marker records of the configuration that wrote it (tutti_dirs, segment size), so
    a kept order or segment size is reported once, not at every attach."""
    listed = json.dumps([[os.path.dirname(p) for p in paths], segment_bytes]).encode()
    return {"configured": hashlib.sha256(listed).hexdigest()[:16]}


def _marker(ns: str):
    """(placement.json as a dict, "") when it is well-formed and agrees with itself, else
    (None, what is wrong). A marker holds its four numbers twice ("check"), so a flipped digit
    reads as damage, not as another placement."""
    m, why = _read(os.path.join(ns, "placement.json"))
    if m is None:
        return None, why
    if not isinstance(m, dict) or any(type(m.get(k)) is not int for k in _FIELDS):
        return None, "lacks a field"
    if min(m["n_dirs"], m["slot_nbytes"], m["slots_per_segment"]) < 1 or \
            not 0 <= m["dir_index"] < m["n_dirs"]:
        return None, "holds an impossible value"
    if "check" in m and m["check"] != [m[k] for k in _FIELDS]:  # older markers have none
        return None, "disagrees with itself"
    if "check" not in m and set(m) - set(_FIELDS):  # a flipped bit in the key's name must not
        return None, "lacks its check"  # switch the check off (older markers hold the 4 alone)
    return m, ""


def _read(path: str):
    if not os.path.lexists(path):
        return None, "missing"
    try:
        with open(path) as f:
            return json.load(f), ""
    except (OSError, ValueError) as e:
        return None, f"damaged ({type(e).__name__})"


def _heal_files(ns: str, identity: dict, marker: dict, old_marker, notes: list[str]) -> int:
    """Make ns hold exactly this identity.json and placement.json; remove what cannot be ours.
    Returns the metadata bytes written."""
    os.makedirs(ns, mode=0o700, exist_ok=True)
    wrote = 0
    have, why = _read(os.path.join(ns, "identity.json"))
    identity = json.loads(json.dumps(identity))  # as JSON reads it back (tuples are lists)
    if have != identity:
        if why != "missing" or os.listdir(ns):  # a new namespace dir is no news
            notes.append(f"{ns}/identity.json {why or 'foreign'}: rebuilt")
        wrote += _write(os.path.join(ns, "identity.json"), identity)
    if old_marker[0] != marker:
        wrote += _write(os.path.join(ns, "placement.json"), marker)
    for entry in os.listdir(ns):
        path = os.path.join(ns, entry)
        if entry.endswith(".tmp"):
            _remove(path)
        elif entry.startswith("seg-") and entry.endswith(".dat") and \
                (os.path.islink(path) or not os.path.isfile(path)):
            _remove(path)
            notes.append(f"{path} was not a regular file: removed")
        elif entry == "writers" and (os.path.islink(path) or not os.path.isdir(path)):
            _remove(path)
            notes.append(f"{path} was not a directory: removed (writers re-register)")
    return wrote


def _write(path: str, obj: dict) -> int:
    """Replace path atomically with obj as JSON (0600). Returns the bytes written (SSD wear)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    data = json.dumps(obj, sort_keys=True, indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _lock(path: str) -> int:
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
        _remove(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _quarantine(ns: str, reason: str) -> str:
    """Rename ns aside (<ns>.quarantine-<stamp>) with a quarantine.json saying why."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}-{time.monotonic_ns()}"
    dst = ns + QUARANTINE + stamp
    try:
        os.rename(ns, dst)
    except OSError as e:
        raise ValueError(f"{PREFIX}dirs: cannot set aside the damaged namespace {ns}: "
                         f"{e.strerror}") from None
    with contextlib.suppress(OSError):
        _write(os.path.join(dst, "quarantine.json"), {"reason": reason, "time": time.time()})
    return dst


# ----------------------------------------------------------------------------- reclaim
def _segments(d: str) -> list[tuple[str, int]]:
    out = []
    with contextlib.suppress(OSError):
        for e in os.listdir(d):
            if e.startswith("seg-") and e.endswith(".dat"):
                with contextlib.suppress(OSError):
                    out.append((os.path.join(d, e), os.path.getsize(os.path.join(d, e))))
    return sorted(out)


def quarantines(dirs, name: str | None = None) -> list[tuple[str, str, int]]:
    """(path, reason, bytes of segment files) of each quarantined namespace under dirs (of
    namespace `name` only, when given), oldest first."""
    out = []
    for d in dirs:
        with contextlib.suppress(OSError):
            for e in sorted(os.listdir(d)):
                base, sep, _ = e.partition(QUARANTINE)
                if not sep or not base.startswith("tutti-") or (name and base != name):
                    continue
                q = os.path.join(d, e)
                info, why = _read(os.path.join(q, "quarantine.json"))
                reason = info.get("reason", "?") if isinstance(info, dict) else why
                out.append((q, str(reason), sum(s for _, s in _segments(q))))
    return sorted(out, key=lambda t: os.path.basename(t[0]))


def _rehoming(q: str) -> bool:
    """True while some process re-homes quarantine q (rehome.py holds an flock on it)."""
    try:
        fd = os.open(q, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def reclaim(ns_dirs: list[str], need: int, capacity_bytes: int, where: str = "",
            floor: int = 0, slack: int = 0) -> int:
    """Delete quarantined segment files of this namespace (those on `where`'s filesystem first,
    newest first) until live + quarantined + need <= capacity_bytes (+ slack while one of them is
    being re-homed: the file in flight is still on disk while its pages land in new segments)
    and `where` has need + floor bytes free; empty quarantine dirs are removed. Returns the
    bytes freed."""
    parents = [os.path.dirname(ns) for ns in ns_dirs]
    qs = quarantines(parents, os.path.basename(ns_dirs[0]))
    if not qs:
        return 0
    root = os.path.dirname(os.path.dirname(where)) + os.sep if where else None
    files = [(p, s) for q, _, _ in qs for p, s in _segments(q)][::-1]  # newest end first:
    files.sort(key=lambda f: not root or not f[0].startswith(root))  # re-homing reads from the front
    over = sum(s for ns in ns_dirs for _, s in _segments(ns)) + sum(s for _, s in files) + \
        need - capacity_bytes - (slack if any(_rehoming(q) for q, _, _ in qs) else 0)
    freed = 0
    for path, size in files:
        short = 0
        if root and path.startswith(root):
            st = os.statvfs(root)
            short = need + floor - st.f_bavail * st.f_frsize
        if over <= 0 and short <= 0:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            over -= size
            freed += size
    for q, _, _ in qs:
        if not _segments(q):
            shutil.rmtree(q, ignore_errors=True)
    return freed
