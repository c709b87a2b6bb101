import pytest

from kvtier.common.stripe import StripeGeometry

MiB = 1 << 20
GEO = StripeGeometry(("a", "b", "c", "d"), MiB, 4 * MiB, 16 * MiB)


def test_units_are_dealt_round_robin():
    assert GEO.map_range(0, 10) == [(0, 4 * MiB, 10)]
    assert GEO.map_range(MiB, 10) == [(1, 4 * MiB, 10)]
    assert GEO.map_range(4 * MiB + 5, 10) == [(0, 5 * MiB + 5, 10)]


def test_a_range_across_units_splits_in_order():
    assert GEO.map_range(MiB - 4, 8) == [(0, 5 * MiB - 4, 4), (1, 4 * MiB, 4)]
    pieces = GEO.map_range(0, 8 * MiB)
    assert [p[0] for p in pieces] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sum(p[2] for p in pieces) == 8 * MiB


def test_one_device_is_contiguous():
    one = StripeGeometry(("a",), MiB, MiB, 8 * MiB)
    assert one.map_range(MiB - 1, 3 * MiB) == [(0, 2 * MiB - 1, 3 * MiB)]


def test_out_of_range_and_bad_geometry():
    with pytest.raises(ValueError, match="outside"):
        GEO.map_range(GEO.logical_size_bytes - 1, 2)
    with pytest.raises(ValueError, match="4096"):
        StripeGeometry(("a",), 1000, 0, 1000)
    with pytest.raises(ValueError, match="at least one"):
        StripeGeometry((), MiB, 0, MiB)
