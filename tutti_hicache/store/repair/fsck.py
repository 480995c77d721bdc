"""Namespaces as found on disk, for `tutti-hicache inspect` and `fsck`: nothing created or resized.

At a glance:
    namespaces(dirs) -> {name: [dir, ...]}      tutti-<fingerprint> namespaces under dirs, each
                                                with its directories in placement.json's order
    quarantined(dirs) -> [line]                 namespaces attach set aside (heal.py): path,
                                                reason, segment bytes awaiting reclaim
    ns = ExistingNamespace(dirs, name, writer=False)
        the namespace as it is: geometry and placement from its metadata files, capacity from
        the segment files it has; headers scanned once into an index. writer (fsck --repair):
        flock the rows no live process holds, so their bad slots may be cleared
    ns.identity, ns.capacity_slots, ns.layout, len(ns), ns.entries() -> {key: PageInfo}
    ns.check(repair=False) -> {"checked", "bad", "bad_keys", "bad_headers"}
                                                read and checksum every indexed page; repair
                                                tombstones the bad slots of rows it holds
    ns.wear() -> [counters | {"error": why} | None]   each directory's wear.json (wear.py)
    ns.close()

Unlike ObjectStore it never makes directories or metadata, grows, fits or removes segment files,
registers as a writer, or runs a re-scan thread. Raises ValueError (unreadable metadata, a
namespace striped over more directories than given) or OSError.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from .. import header
from ...config import TuttiConfig
from ...engine import engine_for, extension
from .heal import QUARANTINE, quarantines
from ..index import SlotIndex
from ...layout import PageGeometry, Placement, SlotLayout, strided
from ..namespace import FileTable, Namespace, existing_capacity, namespace_dirs
from ..rows import Rows
from ..scan import Scanner
from ..scheduler import Gate
from ..slot_io import SlotIO
from ...identity import with_geometry
from ..objectstore import PageInfo, drop_entries, log_damaged
from ..wear import FILE_NAME as WEAR_FILE, read_counters


def namespaces(dirs: list[str]) -> dict[str, list[str]]:
    """fingerprint dir name -> its namespace dirs ordered by placement.json's dir_index."""
    found: dict[str, list] = {}
    for d in dirs:
        for name in sorted(os.listdir(d)):
            ns = os.path.join(d, name)
            pj = os.path.join(ns, "placement.json")
            if name.startswith("tutti-") and QUARANTINE not in name and os.path.exists(pj):
                try:
                    with open(pj) as f:
                        index = int(json.load(f)["dir_index"])
                except (OSError, ValueError, KeyError, TypeError):
                    index = None  # damaged: takes a free position, in the order given
                found.setdefault(name, []).append((index, d))
    out = {}
    for name, entries in found.items():
        order: list = [None] * len(entries)
        rest = []
        for index, d in entries:
            if index is not None and 0 <= index < len(order) and order[index] is None:
                order[index] = d
            else:
                rest.append(d)
        out[name] = [o if o is not None else rest.pop(0) for o in order]
    return out


def quarantined(dirs: list[str]) -> list[str]:
    """One line per quarantined namespace under dirs (what attach set aside, and why)."""
    return [f"quarantined: {q} ({reason}); {nbytes / 2**20:.1f} MiB of segments, reclaimed as "
            f"the store grows" for q, reason, nbytes in quarantines(dirs)]


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable or damaged: {e}") from None


class ExistingNamespace:
    def __init__(self, dirs: list[str], name: str, writer: bool = False):
        ns0 = os.path.join(dirs[0], name)
        ident = _read_json(os.path.join(ns0, "identity.json"))
        place = _read_json(os.path.join(ns0, "placement.json"))
        if place.get("n_dirs") != len(dirs):
            raise ValueError(f"{name} is striped over {place.get('n_dirs')} directories; "
                             f"found {len(dirs)}: pass all of them")
        try:
            geometry = PageGeometry(*ident["geometry"])
            seg_gb = place["slots_per_segment"] * place["slot_nbytes"] / (1 << 30)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: identity.json/placement.json lack a field ({e})") from None
        cfg = TuttiConfig(dirs=tuple(dirs), segment_gb=seg_gb)
        self.identity = ident
        self.layout = SlotLayout(geometry)
        fingerprint = header.fingerprint(with_geometry(ident, geometry))  # as the store has it
        placement = Placement(len(dirs), self.layout.slot_nbytes, cfg.segment_bytes)
        self.capacity_slots = existing_capacity(namespace_dirs(dirs, fingerprint), placement)
        self._ns = Namespace(cfg, fingerprint, placement, self.capacity_slots)
        self._engine = engine_for(cfg)
        self._lock = threading.Lock()
        self._index = SlotIndex()
        self._files = FileTable(self._engine, self._ns, writable=writer)
        self._io = SlotIO(self._engine, self._files, self.layout, placement, cfg,
                          Gate(enabled=False), fingerprint)
        self._rows = Rows(self._ns, self._files, writer)
        self._scan = Scanner(self._ns, self._files, self._rows, self._engine, self.layout,
                             fingerprint, self._index, self._lock, rescan_interval_s=-1.0)
        rows = [r for r in self._ns.existing_rows() if r < self._ns.n_rows]
        for r in rows:
            if self._files.open_row(r, create=False) and writer:
                self._rows.try_lock(r)
        self._scan.scan_rows(rows, grant=True)

    def __len__(self) -> int:
        return len(self._index)

    def entries(self) -> dict[str, PageInfo]:
        return {k: PageInfo(e.slot, e.seq, e.checksum, e.owned)
                for k, e in self._index.entries.items()}

    def check(self, repair: bool = False, chunk: int = 256, progress: bool = False) -> dict:
        """Verify every indexed page's payload checksum. With repair, bad pages in rows held
        here are dropped and their headers (and damaged headers there) tombstoned."""
        from tqdm import tqdm
        items = list(self._index.entries.items())
        bad, checked = [], 0
        lay = self.layout
        m = len(lay.object_nbytes)
        for i in tqdm(range(0, len(items), chunk), desc="fsck", unit="chunk", leave=False,
                      disable=not progress):
            part = items[i:i + chunk]
            stage = extension().AlignedBuffer(len(part) * lay.payload_nbytes)
            addrs = lay.staged_objects(strided(stage.address, len(part), lay.payload_nbytes))
            slots = np.array([e.slot for _, e in part], dtype=np.int64)
            ok, _ = self._io.read(slots, addrs, aligned=False, checksum=False)
            sums = self._io.checksums(addrs.reshape(len(part), m))[0]
            for (k, e), good, c in zip(part, ok, sums):
                if not good or int(c) != e.checksum:
                    bad.append((k, e))
            checked += len(part)
        bad_headers = sorted(self._scan.bad_header_slots)
        if repair:
            log_damaged(drop_entries(self._index, [e for _, e in bad])[0])
            held = self._rows.owned
            own = [e.slot for _, e in bad if e.owned] + \
                [s for s in bad_headers if int(self._ns.placement.locate([s])[1][0]) in held]
            if own:
                self._io.tombstones(*self._files.slot_files(np.array(own, dtype=np.int64)))
        return {"checked": checked, "bad": len(bad), "bad_keys": [k for k, _ in bad][:20],
                "bad_headers": len(bad_headers)}

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

