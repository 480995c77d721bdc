"""Pure geometry: object sizes, slot layout, placement (exact numbers)."""

import numpy as np
import pytest

from tutti_hicache.layout import HEADER_NBYTES, PageGeometry, Placement, SlotLayout, strided


def llama8b(order="canonical"):
    return PageGeometry("mha", 32, 64, 8 * 128 * 2, 8 * 128 * 2, order)


def test_llama3_8b_page():
    g = llama8b()
    assert len(g.object_nbytes) == 64 and set(g.object_nbytes) == {128 << 10}
    assert g.page_nbytes == 8 << 20
    lay = SlotLayout(g)
    assert lay.slot_nbytes == 4096 + (8 << 20)
    assert lay.object_offsets[0] == HEADER_NBYTES
    assert lay.object_offsets[1] == HEADER_NBYTES + (128 << 10)
    assert not lay.padded
    assert list(g.layer_objects(3)) == [6, 7]


def test_page_first_keeps_host_objects():
    g = llama8b("page_first")
    assert g.object_nbytes == (4 << 20, 4 << 20)
    with pytest.raises(ValueError):
        g.layer_objects(0)


def test_mla_and_padding():
    g = PageGeometry("mla", 3, 16, 576 * 2, 0)  # 18432 B objects: padded to 20480
    lay = SlotLayout(g)
    assert g.object_nbytes == (18432,) * 3
    assert list(lay.object_offsets) == [4096, 4096 + 20480, 4096 + 2 * 20480]
    assert lay.slot_nbytes == 4096 + 3 * 20480 and lay.padded
    assert lay.payload_nbytes == 3 * 20480


@pytest.mark.parametrize("bad", [
    dict(kind="gqa"), dict(order="weird"), dict(num_layers=0), dict(v_token_bytes=0),
])
def test_geometry_validation(bad):
    args = dict(kind="mha", num_layers=2, page_size=16, k_token_bytes=256, v_token_bytes=256)
    args.update(bad)
    with pytest.raises(ValueError):
        PageGeometry(**args)


def test_placement_stripes_round_robin():
    p = Placement(n_dirs=3, slot_nbytes=1000, segment_nbytes=2500)  # 2 slots per segment
    assert p.slots_per_segment == 2 and p.segment_file_nbytes == 2000
    d, seg, off = p.locate(np.arange(8))
    assert d.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert seg.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert off.tolist() == [0, 0, 0, 1000, 1000, 1000, 0, 0]
    assert p.segment_slots(1, 1).tolist() == [7, 10]
    assert p.segments_for(6) == 1 and p.segments_for(7) == 2


def test_strided_addresses():
    assert strided(4096, 3, 512).tolist() == [4096, 4608, 5120]
    assert strided(4096, 3, 512).dtype == np.uint64
    base = np.array([0, 1 << 40], dtype=np.uint64)
    assert strided(base, 2, 8).tolist() == [[0, 8], [1 << 40, (1 << 40) + 8]]
    assert strided(7, 0, 8).shape == (0,)


def test_staged_objects_skip_the_header():
    lay = SlotLayout(PageGeometry("mha", 2, 16, 100, 100))  # 1600 B objects, 4 KiB padded
    addrs = lay.staged_objects(np.array([1 << 20, 2 << 20], dtype=np.uint64))
    want = (lay.object_offsets - HEADER_NBYTES).tolist()
    assert addrs.tolist() == [[(1 << 20) + o for o in want], [(2 << 20) + o for o in want]]


def test_devices_of_slots():
    p = Placement(3, 8192, 1 << 20)
    assert p.devices([0, 3, 6]) == frozenset({0})
    assert p.devices(np.array([1, 2, 4])) == frozenset({1, 2})
    assert p.devices([]) == frozenset()
