"""The layer-wise path under churn, for bench/soak.py --linker: a LayerwiseKV on CPU pools in each
soak worker, offloading fresh pages and restoring recent ones layer by layer the way SGLang's
forward does (load, start, set_consumer, wait_until per layer, finish), every restored page
compared byte for byte with what its key must hold.

    churn = LinkerChurn(cfg, geometry, identity, batch, keys_of, add, rng)
    churn.step()     one offload of fresh pages, then one layer-wise load of recent pages (the
                     linker's own, and pages the host-tier writers of any worker stored)
    churn.close()

Pool rows hold page bytes object by object (canonical order: K0 V0 K1 V1 ...), so a page the
linker offloads is byte-identical to the host tier's page of the same key, and either path can
verify the other's pages. Counters go through `add(name, value)`: lk_offload_pages,
lk_offload_refused, lk_load_ops, lk_load_pages, lk_load_refused, lk_load_failed, lk_wrong_pages.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..layerwise import LayerwiseKV
from .pagedata import page_content

FIELDS = ("lk_offload_pages", "lk_offload_refused", "lk_load_ops", "lk_load_pages", "lk_load_refused",
          "lk_load_failed", "lk_wrong_pages", "lk_reopens")


class LinkerChurn:
    def __init__(self, cfg, geometry, identity: dict, batch: int, keys_of, add, rng):
        self.cfg, self.g, self.ident = cfg, geometry, identity
        self.batch, self.keys_of, self.add, self.rng = batch, keys_of, add, rng
        ps = self.ps = geometry.page_size
        dim = geometry.k_token_bytes // 4  # [rows, 2 heads, dim] in bf16 = k_token_bytes a row
        rows = (2 * batch + 1) * ps  # row block 0 unused, then the offload source, then the load target
        self.k = [torch.zeros(rows, 2, dim, dtype=torch.bfloat16) for _ in range(geometry.num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.src = torch.arange(ps, ps * (batch + 1))
        self.dst = torch.arange(ps * (batch + 1), ps * (2 * batch + 1))
        self.serial = 0
        self.mine: list = []  # keys this linker offloaded, newest last
        self.lw = self._open()

    def _open(self) -> LayerwiseKV:
        return LayerwiseKV(self.cfg, self.g, self.ident, self.k, self.v, self.ps)

    def reopen(self) -> None:
        self.lw.close()
        self.lw = self._open()
        self.add("lk_reopens", 1)

    def _objects(self, key: str) -> np.ndarray:
        return page_content(key, self.g.page_nbytes).reshape(len(self.g.object_nbytes), -1)

    def _fill(self, rows: torch.Tensor, keys: list) -> None:
        for i, key in enumerate(keys):
            objs = torch.from_numpy(self._objects(key).copy())
            r = slice(int(rows[i * self.ps]), int(rows[i * self.ps]) + self.ps)  # a view, not a copy
            for layer in range(self.g.num_layers):
                self.k[layer][r].view(torch.uint8).view(-1)[:] = objs[2 * layer]
                self.v[layer][r].view(torch.uint8).view(-1)[:] = objs[2 * layer + 1]

    def _wrong(self, rows: torch.Tensor, keys: list) -> int:
        wrong = 0
        for i, key in enumerate(keys):
            objs = self._objects(key)
            r = slice(int(rows[i * self.ps]), int(rows[i * self.ps]) + self.ps)
            if any(not np.array_equal(self.k[l][r].contiguous().view(torch.uint8).numpy().ravel(), objs[2 * l])
                   or not np.array_equal(self.v[l][r].contiguous().view(torch.uint8).numpy().ravel(),
                                         objs[2 * l + 1]) for l in range(self.g.num_layers)):
                wrong += 1
        return wrong

    def offload(self) -> None:
        n = self.rng.randint(1, self.batch)
        keys = [self.keys_of("linker", self.serial + i) for i in range(n)]
        self.serial += n
        self._fill(self.src, keys)
        if not self.lw.offload(keys, self.src[: n * self.ps], []):
            self.add("lk_offload_refused", n)
            return
        while self.lw.num_completed() < 1:
            time.sleep(0.001)
        if self.lw.pop_completed():
            self.add("lk_offload_pages", n)
            self.mine = (self.mine + keys)[-8 * self.batch:]
        else:
            self.add("lk_offload_refused", n)

    def load(self) -> None:
        if self.rng.random() < 0.5 and self.mine:
            first = self.rng.randrange(len(self.mine))
            keys = self.mine[first:first + self.batch]
        else:
            keys = self.keys_of("writers", self.rng.randint(1, self.batch))
        if not keys:
            return
        n = self.lw.lookup(keys)
        if n == 0:
            return
        keys = keys[:n]
        lo, hi = int(self.dst[0]), int(self.dst[-1]) + 1
        for t in self.k + self.v:
            t[lo:hi].zero_()  # a restore that wrote nothing cannot pass the comparison
        rid = f"r{self.serial}"
        if not self.lw.load(rid, keys, self.dst[: n * self.ps]):
            self.add("lk_load_refused", n)  # evicted between lookup and pin: SGLang recomputes
            return
        idx = self.lw.start()
        self.lw.counter.set_consumer(idx)
        for layer in range(self.g.num_layers):
            self.lw.counter.wait_until(layer)
        ok = self.lw.finish(idx)
        self.lw.counter.set_consumer(-1)
        self.add("lk_load_ops", 1)
        if not ok:
            self.add("lk_load_failed", 1)  # SGLang aborts the batch's requests; no KV is used
            return
        self.add("lk_load_pages", n)
        self.add("lk_wrong_pages", self._wrong(self.dst, keys))

    def step(self) -> None:
        self.offload()
        self.load()

    def close(self) -> None:
        self.lw.close()
