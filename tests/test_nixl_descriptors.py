"""Where a NIXL_GET may write, and which transports a NIXL agent uses: pure checks, no NIXL needed."""
import pytest

from kvtier.common.ucx_env import rdma_devices, transport_plan, ucx_environment
from kvtier.daemon.nixl.descriptors import ClientRegions, DescriptorError, check_descriptors, check_fits

REGIONS = ClientRegions([(0x20000, 0x1000), (0x10000, 0x4000)])


def test_regions_answer_whether_a_range_lies_inside_one():
    assert REGIONS.contains(0x10000, 0x4000) and REGIONS.contains(0x13000, 0x1000)
    assert REGIONS.contains(0x20000, 0x1000)
    assert not REGIONS.contains(0x13000, 0x1001)  # runs past the region's end
    assert not REGIONS.contains(0x0F000, 0x2000)  # starts before it
    assert not REGIONS.contains(0x14000, 0x1000)  # the gap between the two
    assert not REGIONS.contains(0x1F000, 0x2000)  # spans the gap into the next
    assert REGIONS.total_bytes == 0x5000 and len(REGIONS) == 2


@pytest.mark.parametrize("regions,message", [
    ([(0x1000, 0x2000), (0x2000, 0x1000)], "overlap"),
    ([(0x1000, 0)], "empty"),
    ([(0, 0x1000)], "address 0"),
])
def test_bad_regions_are_refused(regions, message):
    with pytest.raises(DescriptorError, match=message):
        ClientRegions(regions)


def test_descriptors_inside_and_apart_pass():
    check_descriptors(REGIONS, [(0x10000, 0x1000), (0x11000, 0x3000), (0x20000, 0x1000)])
    check_descriptors(REGIONS, [])


@pytest.mark.parametrize("descriptors,message", [
    ([(0x10000, 0x1000), (0x14000, 0x10)], "descriptor 1: 16 bytes at 0x14000 are outside every region"),
    ([(0x13F00, 0x200)], "descriptor 0: 512 bytes at 0x13f00 are outside"),
    ([(0x10000, 0)], "descriptor 0: capacity of 0 bytes"),
    ([(0x10000, 0x2000), (0x11000, 0x1000)], "descriptors 0 and 1 overlap"),
    ([(0x12000, 0x1000), (0x10000, 0x2001)], "descriptors 1 and 0 overlap"),
])
def test_descriptors_outside_or_overlapping_are_refused(descriptors, message):
    with pytest.raises(DescriptorError, match=message):
        check_descriptors(REGIONS, descriptors)


def test_a_block_longer_than_its_descriptor_is_refused():
    check_fits([(0x10000, 100), (0x20000, 50)], [100, 0])
    with pytest.raises(DescriptorError, match="descriptor 1: 50 bytes at 0x20000 cannot hold its block of 51"):
        check_fits([(0x10000, 100), (0x20000, 50)], [100, 51])


# -- transports ------------------------------------------------------------------
def test_transport_plan_prefers_shared_memory_then_rdma_then_tcp():
    assert transport_plan(True, False).name == "sm" and transport_plan(True, False).tls == "self,sm,tcp"
    assert transport_plan(False, True).name == "rdma" and transport_plan(False, True).tls == "self,rc,ud,tcp"
    assert transport_plan(True, True).tls == "self,sm,rc,ud,tcp"
    assert transport_plan(False, False) == transport_plan(False, False, None)
    assert transport_plan(False, False).name == "tcp" and transport_plan(False, False).tls == "self,tcp"


def test_transport_override_is_taken_as_given():
    assert transport_plan(True, True, "tcp,self").name == "tcp"
    assert transport_plan(True, False, "sysv,self").name == "sm"
    assert transport_plan(False, True, "rc,tcp").name == "rdma"
    with pytest.raises(ValueError, match="names no transport"):
        transport_plan(True, False, " , ")


def test_ucx_environment_pins_loopback_and_leaves_set_variables_alone():
    plan = transport_plan(True, False)
    env = ucx_environment(plan, loopback_only=True, rdma=False, environ={})
    assert env == {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib*",
                   "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
    env = ucx_environment(plan, loopback_only=False, rdma=True, environ={"UCX_TLS": "tcp"})
    assert "UCX_TLS" not in env and "UCX_NET_DEVICES" not in env and "UCX_MODULES" not in env
    env = ucx_environment(plan, loopback_only=True, rdma=False, environ={"KVTIER_NIXL_NET_DEVICES": "eth1"})
    assert env["UCX_NET_DEVICES"] == "eth1"


def test_rdma_devices_lists_the_sysfs_class(tmp_path):
    assert rdma_devices(str(tmp_path / "absent")) == ()
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path)) == ("mlx5_0", "mlx5_1")
