"""Pure geometry: KV pages -> objects -> slots -> (directory, segment file, byte offset).

At a glance:
    PageGeometry(kind, num_layers, page_size, k_token_bytes, v_token_bytes, order)
        .object_nbytes        bytes of each object of a page, in on-disk order
    SlotLayout(geometry)      4 KiB header + objects, each padded to 4 KiB
        .slot_nbytes, .object_offsets (from the slot start), .payload_offset
        .staged_objects(slot_addrs) -> [n, objects] addresses of each object in slot payloads
                              staged back to back (payload = the slot minus its header)
    Placement(n_dirs, slot_nbytes, segment_nbytes)
        .locate(slots) -> (dir, segment, file_offset) arrays   (vectorized)
        .devices(slots) -> frozenset of directory indices the slots live in
    strided(base, n, stride) -> uint64 [..., n]   base + i * stride: the addresses of n equal
                              pieces laid out back to back (base an int or an array of them)

On-disk object order ("canonical"): K and V of layer 0, then layer 1, ... for MHA; one
object per layer for MLA. Layer l of many pages is then one contiguous run per page.
Host ``page_first`` (and MHA ``page_head``) pages cannot be split by layer without a
gather: they are stored as the host's own objects (MHA: K then V, each all layers; MLA: one)
under their own order name, so they serve the host tier only.
No I/O, no torch; all sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

ALIGN = 4096
HEADER_NBYTES = 4096
ORDERS = ("canonical", "page_first", "page_head")
KINDS = ("mha", "mla")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def runs(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of these sizes laid end to end: (their starts, len(sizes) + 1 with the total last;
    each element's index within its run), in a few numpy operations whatever the run count."""
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    starts[1:] = np.cumsum(sizes)
    return starts, np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], sizes)


def strided(base, n: int, stride: int) -> np.ndarray:
    """uint64 addresses base + i * stride for i < n; an array `base` gives shape base.shape + (n,)."""
    steps = np.arange(n, dtype=np.uint64) * np.uint64(stride)
    if isinstance(base, np.ndarray):
        return base.astype(np.uint64)[..., None] + steps
    return np.uint64(base) + steps


@dataclass(frozen=True)
class PageGeometry:
    """What one KV page of one rank holds.

    k_token_bytes: bytes of one token's K (MHA: heads*head_dim*itemsize) or latent (MLA) in one layer.
    v_token_bytes: same for V (MHA); 0 for MLA.
    """

    kind: str
    num_layers: int
    page_size: int
    k_token_bytes: int
    v_token_bytes: int
    order: str = "canonical"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if min(self.num_layers, self.page_size, self.k_token_bytes) <= 0:
            raise ValueError("num_layers, page_size and k_token_bytes must be positive")
        if (self.kind == "mla") != (self.v_token_bytes == 0):
            raise ValueError("MLA pages have no V object (v_token_bytes == 0); MHA pages need one")

    @cached_property
    def object_nbytes(self) -> tuple[int, ...]:
        p, n_l = self.page_size, self.num_layers
        kb, vb = p * self.k_token_bytes, p * self.v_token_bytes
        if self.order != "canonical":
            return (kb * n_l,) if self.kind == "mla" else (kb * n_l, vb * n_l)
        if self.kind == "mla":
            return (kb,) * n_l
        return (kb, vb) * n_l

    @property
    def objects_per_layer(self) -> int:
        return 1 if self.kind == "mla" else 2

    @property
    def objects_per_unit(self) -> int:
        """Objects per checksum unit: one layer's objects (canonical), else the whole page."""
        return self.objects_per_layer if self.order == "canonical" else len(self.object_nbytes)

    @property
    def units(self) -> int:
        """Checksum units per page: one per layer (canonical), else one."""
        return len(self.object_nbytes) // self.objects_per_unit

    @property
    def page_nbytes(self) -> int:
        return sum(self.object_nbytes)

    def layer_objects(self, layer: int) -> range:
        """Indices (into object_nbytes) of layer `layer`'s objects; canonical order only."""
        if self.order != "canonical":
            raise ValueError("page_first pages cannot be split by layer")
        k = self.objects_per_layer
        return range(layer * k, layer * k + k)


@dataclass(frozen=True)
class SlotLayout:
    """One slot = one page: a 4 KiB header, then each object at a 4 KiB-aligned offset."""

    geometry: PageGeometry

    @cached_property
    def object_offsets(self) -> np.ndarray:
        sizes = np.array([align_up(n) for n in self.geometry.object_nbytes], dtype=np.int64)
        return HEADER_NBYTES + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

    @cached_property
    def object_nbytes(self) -> np.ndarray:
        return np.array(self.geometry.object_nbytes, dtype=np.int64)

    @property
    def payload_offset(self) -> int:
        return HEADER_NBYTES

    @cached_property
    def slot_nbytes(self) -> int:
        return int(self.object_offsets[-1] + align_up(int(self.object_nbytes[-1])))

    @property
    def payload_nbytes(self) -> int:
        """Bytes from the payload start to the slot end (objects plus their padding)."""
        return self.slot_nbytes - HEADER_NBYTES

    def staged_objects(self, slot_addrs: np.ndarray) -> np.ndarray:
        """[n, objects] addresses of each object in n slot payloads staged at slot_addrs (the
        payload starts at the header's end, so object o sits at object_offsets[o] - HEADER_NBYTES)."""
        within = (self.object_offsets - HEADER_NBYTES).astype(np.uint64)
        return np.asarray(slot_addrs, dtype=np.uint64)[:, None] + within[None, :]

    @property
    def padded(self) -> bool:
        """True when some object is not a whole number of 4 KiB blocks."""
        return bool(np.any(self.object_nbytes % ALIGN))


@dataclass(frozen=True)
class Placement:
    """Slots striped round-robin over directories, packed into fixed-size segment files.

    Slot s lives in directory s % n_dirs, as local slot s // n_dirs of that directory,
    in segment (local // slots_per_segment) at byte (local % slots_per_segment) * slot_nbytes.
    """

    n_dirs: int
    slot_nbytes: int
    segment_nbytes: int

    @property
    def slots_per_segment(self) -> int:
        return max(1, self.segment_nbytes // self.slot_nbytes)

    @property
    def segment_file_nbytes(self) -> int:
        return self.slots_per_segment * self.slot_nbytes

    def locate(self, slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dir, segment, file_offset) int64 arrays for an array of slot numbers."""
        s = np.asarray(slots, dtype=np.int64)
        local = s // self.n_dirs
        sps = self.slots_per_segment
        return s % self.n_dirs, local // sps, (local % sps) * self.slot_nbytes

    def devices(self, slots) -> frozenset:
        """The directories (indices) that hold these slots."""
        return frozenset(np.unique(np.asarray(slots, dtype=np.int64) % self.n_dirs).tolist())

    def segment_slots(self, dir_index: int, segment: int) -> np.ndarray:
        """Slot numbers stored in one segment file, in file order."""
        sps = self.slots_per_segment
        local = segment * sps + np.arange(sps, dtype=np.int64)
        return local * self.n_dirs + dir_index

    def segments_for(self, n_slots: int) -> int:
        """Segments per directory needed to hold slots [0, n_slots)."""
        per_dir = -(-n_slots // self.n_dirs)
        return -(-per_dir // self.slots_per_segment)
