"""Damage to a store's own files (metadata, registry, directory list; not page payloads), for the
attach-healing tests of both SGLang paths and the store.

    CASES: {name: Case}     Case.inject(root, dirs, ns) -> (dirs to attach with, extra config)
                            Case.expect: "kept" (every page still served, in place or
                            re-homed), "partial" (the pages of the damaged or dropped directory
                            lost, the others served)
                            Case.warns: warnings attach must log (one, naming the namespace)
    namespace_dirs(dirs) -> [path]      each dir's live tutti-* namespace (not quarantines)
    store_files(dirs) -> [path]         every regular file the store wrote under dirs
    flip(path, pos, bit)                xor one bit of a file in place
    damage_every_file(rng, dirs, slot_nbytes) -> log
                                        flip 1-4 random bytes of every file under dirs

The store is written over two directories <root>/a and <root>/b; <root>/c is a spare one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def flip(path, pos: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def damage_every_file(rng: random.Random, dirs, slot_nbytes: int) -> list:
    """Flip 1-4 random bytes of every file under dirs: in segments half of them inside a slot
    header, in JSON files half of them in a number's first digit (the file stays JSON with
    another number: another directory count, stripe or segment size); an empty file gets 1-16
    random bytes. Returns what was done, for the failure message."""
    log = []
    for path in store_files(dirs):
        size = os.path.getsize(path)
        if size == 0:
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            Path(path).write_bytes(junk)
            log.append((path, "appended", junk))
            continue
        digits = [m.start() for m in re.finditer(rb"(?<=: )[0-9]", Path(path).read_bytes())] \
            if path.endswith(".json") else []
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(8)
            if path.endswith(".dat") and rng.random() < 0.5 and size >= slot_nbytes:
                pos = rng.randrange(size // slot_nbytes) * slot_nbytes + rng.randrange(4096)
            elif digits and rng.random() < 0.5:
                pos, bit = rng.choice(digits), 0
            else:
                pos = rng.randrange(size)
            flip(path, pos, bit)
            log.append((os.path.relpath(path, os.path.dirname(dirs[0])), pos, bit))
    return log


def namespace_dirs(dirs) -> list[str]:
    out = []
    for d in dirs:
        out += [os.path.join(d, e) for e in sorted(os.listdir(d))
                if e.startswith("tutti-") and ".quarantine-" not in e
                and os.path.isdir(os.path.join(d, e))]
    return out


def store_files(dirs) -> list[str]:
    return sorted(os.path.join(r, f) for d in dirs for r, _, fs in os.walk(d) for f in fs)


def _json(path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _edit_placement(path, **changes) -> None:
    with open(path) as f:
        m = json.load(f)
    _json(path, {**m, **changes})


def _rm(path) -> None:
    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def _identity_is_a_directory(ns):
    _rm(os.path.join(ns[0], "identity.json"))
    os.mkdir(os.path.join(ns[0], "identity.json"))


def _writers_not_a_directory(ns):
    w = os.path.join(ns[0], "writers")
    if os.path.exists(w):
        _rm(w)
    Path(w).write_bytes(b"\x00junk")


def _writers_garbage(ns):
    w = os.path.join(ns[0], "writers")
    os.makedirs(w, exist_ok=True)
    Path(w, "4242.99.lock").write_bytes(os.urandom(100))  # a dead writer's, with garbage
    Path(w, "not-a-lock").write_bytes(b"x")
    os.mkdir(os.path.join(w, "a-directory"))


def _segment_is_a_directory(ns):
    seg = os.path.join(ns[1], "seg-000000.dat")
    os.unlink(seg)
    os.mkdir(seg)


def _namespace_is_a_file(ns):
    shutil.rmtree(ns[1])
    Path(ns[1]).write_bytes(b"not a namespace")


def _slot_size(ns):
    for n in ns:
        p = os.path.join(n, "placement.json")
        with open(p) as f:
            m = json.load(f)
        _edit_placement(p, slot_nbytes=m["slot_nbytes"] + 4096)


@dataclass(frozen=True)
class Case:
    inject: Callable  # (root, [a, b], [ns_a, ns_b]) -> (dirs, extra) | None (same dirs)
    expect: str = "kept"
    warns: int = 1


def _on_ns(fn):
    return lambda root, dirs, ns: fn(ns)


CASES = {
    "identity_flipped": Case(_on_ns(lambda ns: flip(os.path.join(ns[0], "identity.json"), 0))),
    "identity_truncated": Case(_on_ns(lambda ns: os.truncate(os.path.join(ns[1], "identity.json"), 7))),
    "identity_foreign": Case(_on_ns(lambda ns: _json(os.path.join(ns[0], "identity.json"),
                                                     {"format": 1, "model": "someone-else"}))),
    "identity_missing": Case(_on_ns(lambda ns: [os.unlink(os.path.join(n, "identity.json")) for n in ns])),
    "identity_is_a_directory": Case(_on_ns(_identity_is_a_directory)),
    "placement_flipped": Case(_on_ns(lambda ns: flip(os.path.join(ns[1], "placement.json"), 0))),
    "placement_truncated": Case(_on_ns(lambda ns: os.truncate(os.path.join(ns[0], "placement.json"), 0))),
    "placement_duplicate_index": Case(_on_ns(lambda ns: _edit_placement(
        os.path.join(ns[1], "placement.json"), dir_index=0))),
    "placement_foreign": Case(_on_ns(lambda ns: _edit_placement(
        os.path.join(ns[1], "placement.json"), slot_nbytes=12288, n_dirs=5, dir_index=4))),
    "placement_missing_everywhere": Case(_on_ns(lambda ns: [os.unlink(os.path.join(n, "placement.json"))
                                                            for n in ns])),
    "wear_counters_truncated": Case(_on_ns(lambda ns: os.truncate(os.path.join(ns[0], "wear.json"), 5))),
    "writers_not_a_directory": Case(_on_ns(_writers_not_a_directory)),
    "writers_garbage": Case(_on_ns(_writers_garbage), warns=0),  # stale entries are routine
    "tmp_leftover": Case(_on_ns(lambda ns: Path(ns[0], "identity.json.1.2.tmp").write_bytes(b"{")),
                         warns=0),
    "segment_is_a_directory": Case(_on_ns(_segment_is_a_directory), expect="partial"),
    "namespace_is_a_file": Case(_on_ns(_namespace_is_a_file), expect="partial"),
    "namespace_missing": Case(_on_ns(lambda ns: shutil.rmtree(ns[1])), expect="partial"),
    "dirs_reordered": Case(lambda root, dirs, ns: ([dirs[1], dirs[0]], {})),
    "segment_size_changed": Case(lambda root, dirs, ns: (dirs, {"tutti_segment_gb": 2 / 1024})),
    "dir_appended": Case(lambda root, dirs, ns: (dirs + [root / "c"], {})),  # re-homed
    "dir_removed": Case(lambda root, dirs, ns: (dirs[:1], {}), expect="partial"),
    "slot_size_changed": Case(_on_ns(_slot_size)),  # set aside, and its pages re-homed
}


def inject(name: str, root: Path, dirs: list) -> tuple[list, dict]:
    """Apply CASES[name] to the store written over dirs; returns (dirs, extra config) to attach."""
    out = CASES[name].inject(root, dirs, namespace_dirs(dirs))
    return out if isinstance(out, tuple) else (dirs, {})
