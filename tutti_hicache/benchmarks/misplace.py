"""The output check's negative control, in the harness and never in the product: a page of one
warmed document served under the key of the same page of another, with a valid checksum.

At a glance:
    page_keys(ids, page_size=64) -> [key]        SGLang's storage keys of a prompt's whole pages
    swap_pages(dirs, key_a, key_b, capacity_gb) -> dict
        in every namespace under dirs holding both keys: the two pages read (checksums
        verified), their keys forgotten, each payload written back through the store's own
        write path under the other's key (new checksummed headers, newer sequence numbers, so
        a server attaching later indexes them and not the old slots), then read back and
        compared: {"namespaces", "swapped", "verified"}
    misplace(wl, tutti_dirs, capacity_gb, requests) -> dict
        what a +misplace configuration (configs.split_config) gets between the warm phase
        and the restart (bench/e2e_sglang.py): misplace_docs on two Workload documents
    misplace_docs(docs, page, tutti_dirs, capacity_gb, requests) -> dict
        the same for any two documents (bench_serving's, --client bench-serving)

Why two documents and not two pages of one: a request that restores both pages of a swapped
pair holds the same set of K/V vectors, only in other slots; attention sums over its keys
without regard to their order, so the output moves by float rounding only and the check would
rightly pass it. A page of document 0 answered with the same page of document 1 (the same
positions, other tokens) is what a wrong key->slot mapping serves; every request that restores
either document's page then holds KV it never computed.

The store must be closed (no server attached) while this runs: it opens the namespace as a
writer with the server's capacity, so it sees and does what that server would.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .e2e import PAGE, SYSTEM_TOKENS


def page_keys(ids: list, page_size: int = PAGE) -> list:
    """The keys SGLang 0.5.23 gives a prompt's whole pages in a storage tier or an external
    linker (get_storage_hash_str: a SHA-256 chain from the first page; no extra key or salt)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    n = len(ids) // page_size * page_size
    return list(get_storage_hash_str(list(ids[:n]), None, page_size=page_size)) if n else []


def _open(ns_dirs: list, capacity_gb: float):
    """The namespace of ns_dirs (<dir>/tutti-<fingerprint>) as an ObjectStore writer with the
    identity and geometry recorded in its identity.json."""
    from ..config import TuttiConfig
    from ..layout import PageGeometry
    from ..store import ObjectStore
    with open(os.path.join(ns_dirs[0], "identity.json")) as f:
        ident = json.load(f)
    cfg = TuttiConfig.from_sources({"tutti_dirs": [os.path.dirname(d) for d in ns_dirs],
                                    "tutti_capacity_gb": capacity_gb}, env={})
    store = ObjectStore(cfg, PageGeometry(*ident["geometry"]), ident)
    if "tutti-" + store.fingerprint.hex() != os.path.basename(ns_dirs[0]):
        store.close()
        raise ValueError(f"{ns_dirs[0]}: identity.json does not give this namespace's fingerprint")
    return store


def _read(store, keys: list):
    """(bool per key, the pages' payloads: a uint8 [n, payload] array) read through the store."""
    from ..engine import extension
    from ..layout import strided
    lay = store.layout
    buf = extension().AlignedBuffer(len(keys) * lay.payload_nbytes)
    addrs = lay.staged_objects(strided(buf.address, len(keys), lay.payload_nbytes))
    ok = store.read_pages(list(keys), addrs, aligned=not lay.padded)
    data = np.frombuffer(buf, dtype=np.uint8).reshape(len(keys), lay.payload_nbytes).copy()
    return ok, data, buf, addrs


def _payload(data: np.ndarray, lay) -> np.ndarray:
    """The objects' bytes of each staged payload (the padding between objects left out)."""
    offs = lay.object_offsets - lay.payload_offset
    return np.concatenate([data[:, o:o + n] for o, n in zip(offs, lay.object_nbytes)], axis=1)


def swap_pages(dirs: list, key_a: str, key_b: str, capacity_gb: float) -> dict:
    """Rewrite key_a's page under key_b and key_b's under key_a (module docstring)."""
    from ..store.repair.fsck import namespaces
    out = {"namespaces": [], "swapped": 0, "verified": 0}
    for name, ns_dirs in namespaces(list(dirs)).items():
        store = _open([os.path.join(d, name) for d in ns_dirs], capacity_gb)
        try:
            if not store.present([key_a, key_b]).all():
                continue
            out["namespaces"].append(name)
            ok, data, buf, addrs = _read(store, [key_a, key_b])
            if not ok.all():
                raise RuntimeError(f"{name}: the pages to swap did not read back valid ({ok.tolist()})")
            store.forget([key_a, key_b])
            if not store.write_pages([key_b, key_a], addrs, aligned=not store.layout.padded).all():
                raise RuntimeError(f"{name}: rewriting the swapped pages failed")
            out["swapped"] += 1
        finally:
            store.close()
        store = _open([os.path.join(d, name) for d in ns_dirs], capacity_gb)
        try:
            ok2, back, _, _ = _read(store, [key_a, key_b])
            lay = store.layout
            if ok2.all() and (_payload(back, lay) == _payload(data[::-1], lay)).all():
                out["verified"] += 1
        finally:
            store.close()
    return out


def misplace(wl, tutti_dirs: list, capacity_gb: float, requests: list, keys=page_keys) -> dict:
    """Swap the first document page (after the shared system prompt) of the smallest context's
    documents 0 and 1 in the tutti store of tutti_dirs (misplace_docs)."""
    if wl.docs < 2:
        raise ValueError("--misplace-page swaps a page between two documents: --docs 2 or more")
    c = min(wl.contexts)
    out = misplace_docs([wl.document(c, d) for d in (0, 1)], SYSTEM_TOKENS // wl.page, tutti_dirs,
                        capacity_gb, requests, keys, page_size=wl.page)
    return {"context": c, "documents": [0, 1], **out}


def misplace_docs(docs: list, page: int, tutti_dirs: list, capacity_gb: float, requests: list,
                  keys=page_keys, page_size: int = PAGE) -> dict:
    """Swap page `page` of two documents (token id lists that differ within their first
    page+1 pages) in the tutti store of tutti_dirs; "affected": the ids of `requests` whose
    cached prefix holds that page of either document (each must come out different from its
    recomputed twin). keys: page_keys (a stand-in for tests without SGLang's hash module);
    page_size: tokens per page (the server's --page-size)."""
    end = (page + 1) * page_size
    heads = [list(d[:end]) for d in docs]
    if len(heads) != 2 or min(map(len, heads)) < end or heads[0] == heads[1]:
        raise ValueError(f"misplace needs two documents of at least {end} tokens that differ there")
    ka, kb = (keys(h, page_size)[page] for h in heads)
    affected = [r.id for r in requests
                if r.cached >= end and any(list(r.ids[:end]) == h for h in heads)]
    info = swap_pages(tutti_dirs, ka, kb, capacity_gb)
    return {"page": page, "keys": [ka, kb], "affected": affected, **info}
