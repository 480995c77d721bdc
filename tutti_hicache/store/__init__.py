"""The object store: one checksummed slot per KV page in preallocated segment files striped
over the store directories (objectstore.py), its namespace and slot I/O, the index and the
row files, the write path and the layer-wise read stream, the I/O scheduler and the wear
counters; repair/ heals, re-homes and checks a store (attach healing and fsck)."""

from .objectstore import ObjectStore

__all__ = ["ObjectStore"]
