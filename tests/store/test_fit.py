"""The store fitted to its filesystems at attach: a capacity beyond them is capped with one
warning, segments adapt to a small filesystem, a given segment size that cannot fit is refused,
and a fuller disk never shrinks a store that exists."""

import logging
import os

import numpy as np
import pytest

from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import extension
from tutti_hicache.layout import PageGeometry, SlotLayout
from tutti_hicache.store import ObjectStore

GEOM = PageGeometry("mha", 4, 16, 2 * 64 * 2, 2 * 64 * 2)  # 8 objects of 4 KiB per page
SLOT = SlotLayout(GEOM).slot_nbytes
IDENT = {"model": "fit", "tp": [0, 1]}
MiB = 1 << 20


def cfg(dirs, **kw):
    return TuttiConfig.from_sources({"tutti_dirs": [str(d) for d in dirs],
                                     "tutti_rescan_interval_s": 0.0, **kw}, env={})


@pytest.fixture
def small_fs(tmpfs):
    """A 32 MiB tmpfs mounted for the test (needs root and mount; skipped otherwise)."""
    return tmpfs("size=32m")


def free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write(store, n, tag):
    pages = extension().AlignedBuffer(n * GEOM.page_nbytes)
    np.frombuffer(pages, dtype=np.uint8)[:] = 7
    m = len(GEOM.object_nbytes)
    addrs = (pages.address + np.arange(n * m, dtype=np.uint64) * 4096).reshape(n, m)
    keys = [f"{tag}{i:060d}" for i in range(n)]
    return keys, store.write_pages(keys, addrs, True)


def fit_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "capacity_gb" in r.getMessage()]


def test_a_capacity_beyond_the_filesystem_is_capped_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg([tmp_path], tutti_capacity_gb=1e9), GEOM, IDENT)
    try:
        [msg] = fit_warnings(caplog)
        assert msg.startswith("tutti: tutti_capacity_gb 1e+09 is more than tutti_dirs' "
                              "filesystems can hold (their free space plus this store's own "
                              "segments): the store is capped at ")
        assert s.capacity_slots * SLOT <= free(tmp_path) + (1 << 30)
        assert s.cfg.capacity_bytes < 1e9 * 2**30 and s.n_rows == s.placement.segments_for(
            s.capacity_slots)
        keys, ok = write(s, 4, "big")
        assert ok.all()
    finally:
        s.close()


def test_segments_adapt_to_a_small_filesystem_and_pages_are_stored(small_fs, caplog):
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg([small_fs]), GEOM, IDENT)  # defaults: 64 GiB, segments auto
    try:
        assert s.placement.segment_file_nbytes <= 4 * MiB  # an eighth of 32 MiB, in whole slots
        assert s.placement.segment_file_nbytes > 4 * MiB - SLOT
        assert len(fit_warnings(caplog)) == 1 and "capped at" in fit_warnings(caplog)[0]
        keys, ok = write(s, 64, "small")  # 64 pages of 128 KiB: 8 MiB over three segments
        assert ok.all() and s.prefix_len(keys) == 64
    finally:
        s.close()


def test_a_given_segment_larger_than_the_filesystem_is_refused(small_fs):
    with pytest.raises(ValueError) as e:
        ObjectStore(cfg([small_fs], tutti_segment_gb=1), GEOM, IDENT)
    assert str(e.value) == (f"tutti_segment_gb: a 1024 MiB segment does not fit in the 32 MiB "
                            f"filesystem of {small_fs}; leave it unset (0: sized to the "
                            f"filesystem) or set it below 0.03125")


def test_a_fuller_disk_never_shrinks_a_store_that_exists(small_fs, caplog):
    s = ObjectStore(cfg([small_fs], tutti_capacity_gb=16 / 1024), GEOM, IDENT)
    keys, ok = write(s, 32, "kept")
    assert ok.all()
    slots = s.capacity_slots
    s.close()
    with open(small_fs / "ballast", "wb") as f:  # another tenant takes the rest of the disk
        f.write(b"\1" * (free(small_fs) - 64 * 1024))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg([small_fs], tutti_capacity_gb=16 / 1024), GEOM, IDENT)
    try:
        assert s.prefix_len(keys) == 32  # every page still served
        assert s.capacity_slots * SLOT >= 32 * SLOT and s.capacity_slots <= slots
        assert not any("removed segment" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def test_directories_on_one_filesystem_share_its_room(small_fs, caplog):
    a, b = small_fs / "a", small_fs / "b"
    room = free(small_fs)
    with caplog.at_level(logging.WARNING, logger="tutti_hicache"):
        s = ObjectStore(cfg([a, b]), GEOM, IDENT)
    try:
        assert room - 2 * SLOT < s.capacity_slots * SLOT <= room  # not twice the filesystem
    finally:
        s.close()
