"""Bytes in flight derived from the device queues (iodepth.py), over fake sysfs trees: real
directories and symlinks laid out as the kernel's /sys, keyed to the real st_dev of tmp_path."""

import os

import pytest

from tutti_hicache import iodepth
from tutti_hicache.config import TuttiConfig
from tutti_hicache.engine import inflight_for

MiB = 1 << 20


def majmin(path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def disk(sysfs, rel: str, nr: int, kb: int, segs=None):
    """A block device directory devices/<rel> with a queue (nr_requests, max_sectors_kb,
    max_segments)."""
    d = sysfs / "devices" / rel
    (d / "queue").mkdir(parents=True)
    (d / "queue" / "nr_requests").write_text(f"{nr}\n")
    (d / "queue" / "max_sectors_kb").write_text(f"{kb}\n")
    if segs is not None:
        (d / "queue" / "max_segments").write_text(f"{segs}\n")
    return d


def link_dev(sysfs, path, target) -> None:
    (sysfs / "dev" / "block").mkdir(parents=True, exist_ok=True)
    os.symlink(target, sysfs / "dev" / "block" / majmin(path))


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    if majmin(d).startswith("0:"):
        pytest.skip("tmp_path is on a filesystem without a block device (major 0)")
    return d


def test_disk_queue_is_requests_times_largest_request(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    d = disk(sysfs, "pci0000:00/virtio1/block/vda", nr=256, kb=4096, segs=254)
    link_dev(sysfs, store_dir, d)
    q = iodepth.device_queue(str(store_dir), str(sysfs))
    # 254 segments of 4 KiB bound a request below max_sectors_kb (4 MiB)
    assert (q.name, q.nr_requests, q.request_bytes) == ("vda", 256, 254 * 4096)
    dep = iodepth.derive([str(store_dir)], str(sysfs), cores=16)
    assert dep.read_bytes == dep.write_bytes == 256 * 254 * 4096


def test_partition_resolves_to_its_disk(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    d = disk(sysfs, "pci0000:00/nvme/nvme0/block/nvme0n1", nr=1023, kb=128, segs=127)
    part = d / "nvme0n1p2"
    part.mkdir()
    (part / "partition").write_text("2\n")
    link_dev(sysfs, store_dir, part)
    q = iodepth.device_queue(str(store_dir), str(sysfs))
    assert (q.name, q.bytes) == ("nvme0n1", 1023 * 128 * 1024)


def test_loop_device_has_its_own_queue(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    d = disk(sysfs, "virtual/block/loop3", nr=128, kb=1280, segs=128)
    (d / "loop").mkdir()
    (d / "loop" / "backing_file").write_text("/dev/shm/tutti-a3.img\n")
    link_dev(sysfs, store_dir, d)
    q = iodepth.device_queue(str(store_dir), str(sysfs))
    assert (q.name, q.nr_requests, q.request_bytes) == ("loop3", 128, 128 * 4096)


def test_device_mapper_sums_its_slaves(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    a = disk(sysfs, "virtual/block/loop0", nr=128, kb=1280, segs=128)
    b = disk(sysfs, "virtual/block/loop1", nr=64, kb=256)
    dm = sysfs / "devices" / "virtual" / "block" / "dm-0"
    (dm / "dm").mkdir(parents=True)
    (dm / "slaves").mkdir()
    (dm / "queue").mkdir()  # bio-based: a queue without nr_requests
    os.symlink(a, dm / "slaves" / "loop0")
    os.symlink(b, dm / "slaves" / "loop1")
    link_dev(sysfs, store_dir, dm)
    q = iodepth.device_queue(str(store_dir), str(sysfs))
    assert q.name == "dm-0" and q.request_bytes == 512 * 1024
    assert q.bytes == 128 * 512 * 1024 + 64 * 256 * 1024  # both slaves' queues


def test_two_dirs_on_one_device_count_once_and_cores_cap(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    link_dev(sysfs, store_dir, disk(sysfs, "block/vdb", nr=1024, kb=1024))
    other = store_dir / "second"
    other.mkdir()
    one = iodepth.derive([str(store_dir)], str(sysfs), cores=64)
    two = iodepth.derive([str(store_dir), str(other)], str(sysfs), cores=64)
    assert one.write_bytes == two.write_bytes == 1024 * MiB
    assert len(two.devices) == 1
    capped = iodepth.derive([str(store_dir)], str(sysfs), cores=2)
    assert capped.write_bytes == 2 * iodepth.CORE_BYTES


def test_no_block_device_is_bounded_by_the_cores_only(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    (sysfs / "dev" / "block").mkdir(parents=True)  # nothing for this st_dev
    assert iodepth.device_queue(str(store_dir), str(sysfs)) is None
    dep = iodepth.derive([str(store_dir)], str(sysfs), cores=3)  # only the cores bound it
    assert dep.write_bytes == 3 * iodepth.CORE_BYTES and dep.devices == (None,)
    small = disk(sysfs, "block/tiny", nr=1, kb=4)
    link_dev(sysfs, store_dir, small)
    assert iodepth.derive([str(store_dir)], str(sysfs), cores=64).write_bytes == iodepth.MIN_BYTES


def test_tmpfs_has_no_queue():
    if not os.path.isdir("/dev/shm") or not majmin("/dev/shm").startswith("0:"):
        pytest.skip("no tmpfs at /dev/shm")
    assert iodepth.device_queue("/dev/shm") is None


def test_a_store_dir_not_made_yet_uses_the_one_it_will_be_in(tmp_path, store_dir):
    sysfs = tmp_path / "sys"
    link_dev(sysfs, store_dir, disk(sysfs, "block/vdc", nr=32, kb=512))
    q = iodepth.device_queue(str(store_dir / "not" / "yet"), str(sysfs))
    assert q.bytes == 32 * 512 * 1024


def test_explicit_queue_depth_wins(tmp_path):
    cfg = TuttiConfig.from_sources({"tutti_dirs": [str(tmp_path)], "tutti_queue_depth": 64}, env={})
    assert inflight_for(cfg) == (64, 0, 0)
    auto = inflight_for(cfg.with_(queue_depth=0))
    assert auto[0] == 1024 and auto[1] == auto[2] >= iodepth.MIN_BYTES
    with pytest.raises(ValueError, match="tutti_queue_depth"):
        TuttiConfig.from_sources({"tutti_queue_depth": 4}, env={})
