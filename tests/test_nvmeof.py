"""NVMe-oF export and connect (kvtier.tools.nvmeof): the nvmet configfs plan as exact
operation lists, the applier on a directory laid out as configfs (this kernel has no
nvmet), both the plain layout and one where mkdir creates the default groups and
attribute files as the kernel does, ``kvtier nvmeof`` against a real kvtierd, and a
device map that KVCache reads blocks through.

The client side has no NVMe fabric here: where the kernel would attach a namespace, the
tests create what it would show (``sys/block/nvmeXnY/uuid`` and the ``dev/nvmeXnY``
node, here a link to the exported device file)."""
from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from daemon_proc import start_kvtierd
from kvtier.tools.admin_cli import main
from kvtier.tools.nvmeof.cli import devices_from_doc
from kvtier.tools.nvmeof.configfs import ApplyError, ConfigfsApplier, is_configfs, read_state
from kvtier.tools.nvmeof.connect_plan import (ConnectConfig, connect_command, read_only_commands, resolve_device_map,
                                              write_protect_commands)
from kvtier.tools.nvmeof.export_plan import (ExportConfig, ExportDevice, ExportState, Op, OpKind, PlanError,
                                             default_nqn, device_uuid, export_plan, render_shell, unexport_plan)
from kvtier.tools.nvmeof.host_devices import read_namespace_uuids, wait_for_namespaces

TOKEN = "nvmeof-test-token"
ID_A, ID_B = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
UUID_A, UUID_B = "01234567-89ab-cdef-0123-456789abcdef", "fedcba98-7654-3210-fedc-ba9876543210"
NQN = "nqn.2026-12.io.kvtier:node-a"
HOST1, HOST2 = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-1111-1111-111111111111", "nqn.2026-12.io.kvtier:gpu-2"
SUB = f"nvmet/subsystems/{NQN}"


def config(**overrides) -> ExportConfig:
    fields = dict(nqn=NQN, devices=(ExportDevice(ID_A, "/dev/disk/by-id/nvme-a"), ExportDevice(ID_B, "/dev/nvme1n1")),
                  traddr="10.0.0.5", hosts=(HOST1,))
    fields.update(overrides)
    return ExportConfig(**fields)


def fake_configfs(root: Path) -> str:
    """What loading nvmet creates: the nvmet directory and its three groups."""
    for group in ("subsystems", "ports", "hosts"):
        (root / "nvmet" / group).mkdir(parents=True)
    return str(root)


def tree(root: str) -> dict[str, str]:
    """Every entry under ``root``: file contents, link targets (relative to root), 'dir'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = "-> " + os.path.relpath(os.readlink(full), root)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                out[rel] = Path(full).read_text()
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return out


# -- the plan (no I/O) -----------------------------------------------------------------
def test_export_plan_is_the_exact_operation_list_in_kernel_order():
    ops = export_plan(config(hosts=(HOST1, HOST2)))
    M, W, L = OpKind.MKDIR, OpKind.WRITE, OpKind.SYMLINK
    assert ops == [
        Op(M, "nvmet/subsystems", exist_ok=True),
        Op(M, SUB),
        Op(W, f"{SUB}/attr_allow_any_host", "0"),
        Op(M, f"{SUB}/namespaces", exist_ok=True),
        Op(M, f"{SUB}/namespaces/1"),
        Op(W, f"{SUB}/namespaces/1/device_path", "/dev/disk/by-id/nvme-a"),
        Op(W, f"{SUB}/namespaces/1/device_uuid", UUID_A),
        Op(W, f"{SUB}/namespaces/1/enable", "1"),
        Op(M, f"{SUB}/namespaces/2"),
        Op(W, f"{SUB}/namespaces/2/device_path", "/dev/nvme1n1"),
        Op(W, f"{SUB}/namespaces/2/device_uuid", UUID_B),
        Op(W, f"{SUB}/namespaces/2/enable", "1"),
        Op(M, "nvmet/hosts", exist_ok=True),
        Op(M, f"{SUB}/allowed_hosts", exist_ok=True),
        Op(M, f"nvmet/hosts/{HOST1}", exist_ok=True),
        Op(L, f"{SUB}/allowed_hosts/{HOST1}", f"nvmet/hosts/{HOST1}"),
        Op(M, f"nvmet/hosts/{HOST2}", exist_ok=True),
        Op(L, f"{SUB}/allowed_hosts/{HOST2}", f"nvmet/hosts/{HOST2}"),
        Op(M, "nvmet/ports", exist_ok=True),
        Op(M, "nvmet/ports/1", exist_ok=True),
        Op(W, "nvmet/ports/1/addr_trtype", "tcp"),
        Op(W, "nvmet/ports/1/addr_adrfam", "ipv4"),
        Op(W, "nvmet/ports/1/addr_traddr", "10.0.0.5"),
        Op(W, "nvmet/ports/1/addr_trsvcid", "4420"),
        Op(M, "nvmet/ports/1/subsystems", exist_ok=True),
        Op(L, f"nvmet/ports/1/subsystems/{NQN}", SUB),
    ]


def test_rdma_on_ipv6_and_another_port():
    ops = export_plan(config(transport="rdma", traddr="fd00::5", trsvcid=4421, port_id=7))
    writes = {op.path: op.value for op in ops if op.kind is OpKind.WRITE and "ports" in op.path}
    assert writes == {"nvmet/ports/7/addr_trtype": "rdma", "nvmet/ports/7/addr_adrfam": "ipv6",
                      "nvmet/ports/7/addr_traddr": "fd00::5", "nvmet/ports/7/addr_trsvcid": "4421"}
    assert ops[-1] == Op(OpKind.SYMLINK, f"nvmet/ports/7/subsystems/{NQN}", SUB)


@pytest.mark.parametrize("overrides, message", [
    ({"nqn": "node-a"}, "does not start with 'nqn.'"),
    ({"nqn": "nqn." + "x" * 220}, "over the limit 223"),
    ({"nqn": "nqn.2026-12.io.kvtier:a/b"}, "without spaces or '/'"),
    ({"hosts": ()}, "no allowed hosts"),
    ({"hosts": (HOST1, HOST1)}, "host NQNs repeat"),
    ({"hosts": ("gpu-2",)}, "host NQN 'gpu-2'"),
    ({"traddr": "storage-a.example"}, "not an IP address"),
    ({"transport": "fc"}, "transport must be one of"),
    ({"trsvcid": 0}, "service port 0"),
    ({"port_id": 70000}, "port id 70000"),
    ({"devices": ()}, "no devices"),
    ({"devices": (ExportDevice(ID_A, "/a"), ExportDevice(ID_A, "/b"))}, "device ids repeat"),
])
def test_bad_export_configs_are_refused_with_the_reason(overrides, message):
    with pytest.raises(PlanError, match=message):
        config(**overrides)


def test_bad_devices_are_refused():
    with pytest.raises(PlanError, match="not 32 lowercase hex digits"):
        ExportDevice("ABC", "/dev/x")
    with pytest.raises(PlanError, match="not an absolute path"):
        ExportDevice(ID_A, "dev/x")
    with pytest.raises(PlanError, match="no devices"):
        default_nqn([])


def test_device_ids_travel_as_namespace_uuids_and_name_the_default_nqn():
    assert device_uuid(ID_A) == UUID_A
    assert default_nqn([ID_B, ID_A]) == "nqn.2014-08.org.nvmexpress:uuid:" + UUID_B


def test_unexport_plan_closes_the_network_side_first_and_keeps_what_others_use():
    state = ExportState(NQN, True, namespaces=(1, 2), allowed_hosts=(HOST1, HOST2), ports=(1, 3),
                        shared_hosts=frozenset({HOST2}), shared_ports=frozenset({3}))
    U, W, R = OpKind.UNLINK, OpKind.WRITE, OpKind.RMDIR
    assert unexport_plan(state) == [
        Op(U, f"nvmet/ports/1/subsystems/{NQN}"),
        Op(U, f"nvmet/ports/3/subsystems/{NQN}"),
        Op(U, f"{SUB}/allowed_hosts/{HOST1}"),
        Op(U, f"{SUB}/allowed_hosts/{HOST2}"),
        Op(W, f"{SUB}/namespaces/1/enable", "0"),
        Op(R, f"{SUB}/namespaces/1"),
        Op(W, f"{SUB}/namespaces/2/enable", "0"),
        Op(R, f"{SUB}/namespaces/2"),
        Op(R, SUB),
        Op(R, f"nvmet/hosts/{HOST1}"),
        Op(R, "nvmet/ports/1"),
    ]
    assert unexport_plan(ExportState(NQN, exists=False)) == []


def test_dry_run_shell_is_what_an_operator_would_type():
    text = render_shell(export_plan(config()), "/sys/kernel/config/")
    lines = text.splitlines()
    assert lines[1] == f"mkdir /sys/kernel/config/{SUB}"
    assert lines[2] == f"echo 0 > /sys/kernel/config/{SUB}/attr_allow_any_host"
    assert lines[-1] == f"ln -s /sys/kernel/config/{SUB} /sys/kernel/config/nvmet/ports/1/subsystems/{NQN}"
    assert "mkdir -p /sys/kernel/config/nvmet/ports/1" in lines
    assert render_shell([Op(OpKind.WRITE, "a b", "it's")], "/r") == "echo 'it'\\''s' > '/r/a b'"


# -- the applier on a directory laid out as configfs -----------------------------------
def test_export_then_unexport_on_a_plain_directory(tmp_path):
    root = fake_configfs(tmp_path)
    before = tree(root)
    result = ConfigfsApplier(root, kernel=False).apply(export_plan(config()))
    assert (result.applied, result.skipped) == (21, 3)  # 24 operations; nvmet's three groups exist
    t = tree(root)
    assert t[f"{SUB}/attr_allow_any_host"] == "0\n"
    assert t[f"{SUB}/namespaces/1/device_path"] == "/dev/disk/by-id/nvme-a\n"
    assert t[f"{SUB}/namespaces/2/device_uuid"] == UUID_B + "\n"
    assert t[f"{SUB}/namespaces/2/enable"] == "1\n"
    assert t[f"{SUB}/allowed_hosts/{HOST1}"] == f"-> nvmet/hosts/{HOST1}"
    assert t[f"nvmet/ports/1/subsystems/{NQN}"] == f"-> {SUB}"
    assert os.path.isabs(os.readlink(os.path.join(root, f"nvmet/ports/1/subsystems/{NQN}")))
    assert t["nvmet/ports/1/addr_traddr"] == "10.0.0.5\n"
    state = read_state(root, NQN)
    assert state == ExportState(NQN, True, (1, 2), (HOST1,), (1,), frozenset(), frozenset())
    ConfigfsApplier(root, kernel=False).apply(unexport_plan(state))
    assert tree(root) == before
    assert read_state(root, NQN).exists is False


def test_exporting_twice_is_refused_and_changes_nothing(tmp_path):
    root = fake_configfs(tmp_path)
    ConfigfsApplier(root, kernel=False).apply(export_plan(config()))
    snapshot = tree(root)
    with pytest.raises(ApplyError, match="exists already") as info:
        ConfigfsApplier(root, kernel=False).apply(export_plan(config()))
    assert info.value.done == 1 and info.value.op == Op(OpKind.MKDIR, SUB)
    assert tree(root) == snapshot


def test_two_subsystems_share_a_port_and_a_host(tmp_path):
    root = fake_configfs(tmp_path)
    other = "nqn.2026-12.io.kvtier:node-b"
    ConfigfsApplier(root, kernel=False).apply(export_plan(config()))
    second = ConfigfsApplier(root, kernel=False).apply(
        export_plan(config(nqn=other, devices=(ExportDevice("ab" * 16, "/dev/nvme9n1"),), hosts=(HOST1, HOST2))))
    assert second.skipped == 10  # the groups, host 1, the port and its four attributes were in place
    state = read_state(root, NQN)
    assert state.shared_hosts == {HOST1} and state.shared_ports == {1}
    ConfigfsApplier(root, kernel=False).apply(unexport_plan(state))
    t = tree(root)
    assert f"nvmet/hosts/{HOST1}" in t and t[f"nvmet/ports/1/subsystems/{other}"] == f"-> nvmet/subsystems/{other}"
    assert f"nvmet/ports/1/subsystems/{NQN}" not in t and SUB not in t
    ConfigfsApplier(root, kernel=False).apply(unexport_plan(read_state(root, other)))
    assert sorted(t for t in tree(root)) == ["nvmet", "nvmet/hosts", "nvmet/ports", "nvmet/subsystems"]


def test_a_port_already_on_another_address_is_rewritten_only_where_it_differs(tmp_path):
    root = fake_configfs(tmp_path)
    port = tmp_path / "nvmet/ports/1"
    port.mkdir()
    (port / "addr_trtype").write_text("tcp\n")
    (port / "addr_traddr").write_text("10.0.0.9\n")
    mtime = (port / "addr_trtype").stat().st_mtime_ns
    ConfigfsApplier(root, kernel=False).apply(export_plan(config()))
    assert (port / "addr_traddr").read_text() == "10.0.0.5\n"
    assert (port / "addr_trtype").stat().st_mtime_ns == mtime  # equal value: not written


def test_a_failure_midway_names_the_operation_and_unexport_cleans_up(tmp_path):
    root = fake_configfs(tmp_path)
    ns2 = tmp_path / SUB / "namespaces/2"
    ops = export_plan(config())
    applier = ConfigfsApplier(root, kernel=False)
    applier.apply(ops[:9])  # up to the mkdir of namespace 2
    (ns2 / "device_path").mkdir()  # something the write cannot open
    with pytest.raises(ApplyError, match="namespaces/2/device_path") as info:
        applier.apply(ops[9:])
    assert info.value.done == 0 and info.value.op.kind is OpKind.WRITE
    (ns2 / "device_path").rmdir()
    applier.apply(unexport_plan(read_state(root, NQN)))
    assert read_state(root, NQN).exists is False


class KernelLikeTree:
    """Applies operations one at a time and, after each mkdir, does what nvmet's configfs
    does by itself: creates the item's default groups and its attribute files."""

    ITEMS = {
        "subsystem": (("namespaces", "allowed_hosts"), ("attr_allow_any_host", "attr_serial", "attr_model")),
        "namespace": ((), ("device_path", "device_uuid", "device_nguid", "enable", "buffered_io", "ana_grpid")),
        "port": (("subsystems", "referrals", "ana_groups"),
                 ("addr_trtype", "addr_adrfam", "addr_traddr", "addr_trsvcid", "addr_treq", "addr_portid")),
        "host": ((), ("dhchap_key",)),
    }

    def __init__(self, root: str) -> None:
        self.root = root
        self.applier = ConfigfsApplier(root, kernel=True)

    @staticmethod
    def kind(path: str) -> str | None:
        parts = path.split("/")
        if parts[:2] == ["nvmet", "subsystems"] and len(parts) == 3:
            return "subsystem"
        if parts[:2] == ["nvmet", "subsystems"] and len(parts) == 5 and parts[3] == "namespaces":
            return "namespace"
        if parts[:2] == ["nvmet", "ports"] and len(parts) == 3:
            return "port"
        if parts[:2] == ["nvmet", "hosts"] and len(parts) == 3:
            return "host"
        return None

    def apply(self, ops: list[Op]) -> tuple[int, int]:
        applied = skipped = 0
        for op in ops:
            result = self.applier.apply([op])
            applied, skipped = applied + result.applied, skipped + result.skipped
            kind = self.kind(op.path)
            if op.kind is OpKind.MKDIR and result.applied and kind:
                groups, attributes = self.ITEMS[kind]
                for group in groups:
                    os.mkdir(os.path.join(self.root, op.path, group))
                for attribute in attributes:
                    Path(self.root, op.path, attribute).write_text("\n" if attribute != "enable" else "0\n")
        return applied, skipped


def test_export_where_mkdir_creates_default_groups_and_attributes_as_the_kernel_does(tmp_path):
    root = fake_configfs(tmp_path)
    applied, skipped = KernelLikeTree(root).apply(export_plan(config(hosts=(HOST1, HOST2))))
    assert (applied, skipped) == (20, 6)  # namespaces/, allowed_hosts/, ports/1/subsystems/ were made by "the kernel"
    t = tree(root)
    assert t[f"{SUB}/namespaces/1/device_uuid"] == UUID_A + "\n" and t[f"{SUB}/namespaces/1/enable"] == "1\n"
    assert t[f"{SUB}/namespaces/1/buffered_io"] == "\n"  # left as the kernel made it
    assert t[f"nvmet/ports/1/subsystems/{NQN}"] == f"-> {SUB}"


def test_in_kernel_mode_a_missing_attribute_is_an_error_not_a_new_file(tmp_path):
    root = fake_configfs(tmp_path)
    with pytest.raises(ApplyError, match="no such attribute"):
        ConfigfsApplier(root, kernel=True).apply(export_plan(config()))
    assert not os.path.exists(os.path.join(root, SUB, "attr_allow_any_host"))


def test_a_temporary_directory_is_not_configfs(tmp_path):
    assert is_configfs(str(tmp_path)) is False


# -- the client side (no I/O) ----------------------------------------------------------
def test_connect_command_and_read_only_steps():
    cfg = ConnectConfig(nqn=NQN, traddr="10.0.0.5", device_ids=(ID_A, ID_B))
    assert connect_command(cfg) == ["nvme", "connect", "-t", "tcp", "-a", "10.0.0.5", "-s", "4420", "-n", NQN]
    cfg = ConnectConfig(nqn=NQN, traddr="fd00::5", device_ids=(ID_A,), transport="rdma", trsvcid=4421, hostnqn=HOST1)
    assert connect_command(cfg, "/usr/sbin/nvme")[-2:] == ["-q", HOST1]
    device_map = {ID_A: "/dev/nvme3n1", ID_B: "/dev/nvme3n2"}
    assert read_only_commands(device_map) == [["blockdev", "--setro", "/dev/nvme3n1"],
                                              ["blockdev", "--setro", "/dev/nvme3n2"]]
    assert write_protect_commands(device_map, (ID_A, ID_B))[1] == [
        "nvme", "set-feature", "/dev/nvme3n2", "--namespace-id=2", "--feature-id=0x84", "--value=1"]
    with pytest.raises(PlanError, match="not an IP address"):
        ConnectConfig(nqn=NQN, traddr="storage-a", device_ids=(ID_A,))


def test_device_map_resolution_matches_uuids_and_refuses_guesses():
    seen = {"nvme3n1": UUID_B.upper(), "nvme3c3n2": UUID_A, "nvme3n2": UUID_A, "nvme0n1": "other"}
    found = resolve_device_map((ID_A, ID_B), seen, "/dev")
    assert found.device_map == {ID_A: "/dev/nvme3n2", ID_B: "/dev/nvme3n1"} and found.missing == ()
    assert list(found.device_map) == [ID_A, ID_B]  # stripe order
    assert resolve_device_map((ID_A, ID_B), {"nvme3n2": UUID_A}).missing == (ID_B,)
    with pytest.raises(PlanError, match="visible as nvme3n2, nvme4n2"):
        resolve_device_map((ID_A,), {"nvme3n2": UUID_A, "nvme4n2": UUID_A})


def test_devices_come_from_either_form_of_kvtier_devices():
    doc = {"devices": [{"index": 0, "device_id": ID_A, "path": "/dev/a"}], "stripe_size_bytes": 4096}
    assert devices_from_doc(doc) == [ExportDevice(ID_A, "/dev/a")]
    assert devices_from_doc({ID_B: "/dev/b"}) == [ExportDevice(ID_B, "/dev/b")]
    with pytest.raises(PlanError, match="expected the output"):
        devices_from_doc([ID_A])
    with pytest.raises(PlanError, match="not 32 lowercase hex"):
        devices_from_doc({"xyz": "/dev/b"})
    with pytest.raises(PlanError, match="entry 0 needs a device_id and a path"):  # not exported as '/'
        devices_from_doc({"devices": [{"device_id": ID_A}]})
    assert devices_from_doc({"devices": [{"device_id": ID_A}]}, paths_needed=False)[0].device_id == ID_A


def attach(sysfs: Path, dev: Path, name: str, uuid_text: str, backing: str | None = None) -> None:
    """What the client kernel shows once it has scanned a namespace."""
    (sysfs / "block" / name).mkdir(parents=True, exist_ok=True)
    (sysfs / "block" / name / "uuid").write_text(uuid_text + "\n")
    node = dev / name
    if backing:
        node.symlink_to(backing)
    else:
        node.write_bytes(b"")


def test_waiting_for_namespaces_wakes_when_the_node_appears(tmp_path):
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    assert read_namespace_uuids(str(sysfs)) == {}
    timer = threading.Timer(0.3, lambda: (attach(sysfs, dev, "nvme5n1", UUID_A), attach(sysfs, dev, "nvme5n2", UUID_B)))
    start = time.monotonic()
    timer.start()
    found = wait_for_namespaces((ID_A, ID_B), str(sysfs), str(dev), timeout_s=20)
    timer.join()
    assert found.missing == () and found.device_map == {ID_A: f"{dev}/nvme5n1", ID_B: f"{dev}/nvme5n2"}
    assert time.monotonic() - start < 5
    (dev / "nvme5n2").unlink()
    partial = wait_for_namespaces((ID_A, ID_B), str(sysfs), str(dev), timeout_s=0.2)
    assert partial.missing == (ID_B,)  # sysfs shows it but there is no node: not usable yet


# -- kvtier nvmeof against a real kvtierd -----------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvmeof")
    (root / "token").write_text(TOKEN)
    d = start_kvtierd(root / "store", "--token-file", str(root / "token"), admin="127.0.0.1:0")
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture
def kv(daemon, monkeypatch, capsys):
    for name in ("KVTIER_ADMIN", "KVTIER_TOKEN", "KVTIER_TOKEN_FILE", "KVTIER_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str):
        code = main(["--admin", daemon.admin_addr, "--token", TOKEN, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def daemon_devices(kv) -> list[dict]:
    code, out, _ = kv("--json", "devices")
    assert code == 0
    return json.loads(out)["devices"]


def kernel_attaches_export(configfs: str, nqn: str, sysfs: Path, dev: Path, controller: int = 4) -> None:
    """Where the client kernel would attach the exported namespaces: one nvmeXnY per
    namespace, its uuid from the export's device_uuid, its node the exported device."""
    namespaces = Path(configfs, "nvmet/subsystems", nqn, "namespaces")
    for ns in sorted(namespaces.iterdir()):
        attach(sysfs, dev, f"nvme{controller}n{ns.name}", (ns / "device_uuid").read_text().strip(),
               backing=(ns / "device_path").read_text().strip())


def test_cli_export_dry_run_export_and_unexport(kv, daemon, tmp_path):
    devices = daemon_devices(kv)
    root = fake_configfs(tmp_path / "configfs")
    nqn = "nqn.2014-08.org.nvmexpress:uuid:" + device_uuid(devices[0]["device_id"])
    code, out, _ = kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", HOST1, "--configfs", root, "--dry-run")
    assert code == 0 and f"mkdir {root}/nvmet/subsystems/{nqn}" in out
    assert tree(root) == {"nvmet": "dir", "nvmet/hosts": "dir", "nvmet/ports": "dir", "nvmet/subsystems": "dir"}
    code, out, err = kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", HOST1, "--configfs", root)
    assert code == 0, err
    assert f"subsystem {nqn}: {len(devices)} namespaces on tcp://127.0.0.1:4420 for 1 host(s)" in out
    for d in devices:
        ns = Path(root, "nvmet/subsystems", nqn, "namespaces", str(d["index"] + 1))
        assert (ns / "device_path").read_text() == d["path"] + "\n"
        assert (ns / "device_uuid").read_text() == device_uuid(d["device_id"]) + "\n"
    code, _, err = kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", HOST1, "--configfs", root)
    assert code == 1 and "exists already" in err
    code, out, _ = kv("--json", "nvmeof", "unexport", "--configfs", root)
    assert code == 0 and json.loads(out)["unexport"] is True
    assert tree(root) == {"nvmet": "dir", "nvmet/hosts": "dir", "nvmet/ports": "dir", "nvmet/subsystems": "dir"}
    code, out, _ = kv("nvmeof", "unexport", "--configfs", root)
    assert code == 0 and "is not exported" in out
    code, _, err = kv("nvmeof", "unexport", "--configfs", str(tmp_path / "no-nvmet"))
    assert code == 1 and "load the NVMe target modules" in err


def test_cli_refuses_bad_input_with_the_reason(kv, tmp_path):
    root = fake_configfs(tmp_path / "configfs")
    code, _, err = kv("nvmeof", "export", "--addr", "storage-a", "--host", HOST1, "--configfs", root)
    assert code == 2 and "not an IP address" in err
    code, _, err = kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", "gpu-1", "--configfs", root)
    assert code == 2 and "host NQN 'gpu-1'" in err
    code, _, err = kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", HOST1, "--configfs", str(tmp_path / "no"))
    assert code == 1 and "load the NVMe target modules" in err
    (tmp_path / "bad.json").write_text("[1, 2]")
    code, _, err = kv("nvmeof", "connect", "--addr", "127.0.0.1", "--devices-json", str(tmp_path / "bad.json"))
    assert code == 2 and "expected the output" in err
    assert tree(root) == {"nvmet": "dir", "nvmet/hosts": "dir", "nvmet/ports": "dir", "nvmet/subsystems": "dir"}


def test_cli_connect_prints_then_writes_the_device_map_that_kvcache_reads_through(kv, daemon, tmp_path):
    torch = pytest.importorskip("torch")
    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    root = fake_configfs(tmp_path / "configfs")
    sysfs, dev, map_file = tmp_path / "sys", tmp_path / "dev", tmp_path / "device-map.json"
    dev.mkdir()
    assert kv("nvmeof", "export", "--addr", "127.0.0.1", "--host", HOST1, "--configfs", root)[0] == 0
    flags = ["--addr", "127.0.0.1", "--sysfs", str(sysfs), "--dev", str(dev), "--device-map", str(map_file)]
    code, out, _ = kv("nvmeof", "connect", *flags)
    devices = daemon_devices(kv)
    nqn = "nqn.2014-08.org.nvmexpress:uuid:" + device_uuid(devices[0]["device_id"])
    assert code == 0 and out.splitlines()[0] == f"nvme connect -t tcp -a 127.0.0.1 -s 4420 -n {nqn}"
    assert "not attached yet" in out and not map_file.exists()
    kernel_attaches_export(root, nqn, sysfs, dev)
    code, out, _ = kv("--json", "nvmeof", "connect", *flags, "--data", daemon.data_addr)  # ids from HELLO
    doc = json.loads(out)
    assert code == 0 and doc["missing"] == []
    expected = {d["device_id"]: f"{dev}/nvme4n{d['index'] + 1}" for d in devices}
    assert json.loads(map_file.read_text()) == expected == doc["device_map"]
    assert doc["commands"][1:] == [f"blockdev --setro {p}" for p in expected.values()]

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_tokens=16)
    tokens = list(range(16 * 8))
    kv_layers = [(torch.randn(1, 2, len(tokens), 32).half(), torch.randn(1, 2, len(tokens), 32).half())]
    with KVCache(Namespace("nvmeof-map", layout), daemon.data_addr, token=TOKEN, hot_pool_bytes=0,
                 device_map=json.loads(map_file.read_text()), transport="direct") as cache:
        assert cache.store(tokens, kv_layers) == 8
        cache.flush()
        loaded = cache.load(tokens)
        assert loaded.transports == {"direct": 8}
        assert torch.equal(loaded.layers[0][0], kv_layers[0][0]) and torch.equal(loaded.layers[0][1], kv_layers[0][1])


def fake_tool(path: Path, log: Path, body: str = "") -> str:
    """A stand-in for nvme-cli or blockdev that records its arguments (the kernel side it
    would drive does not exist here); ``body`` is Python run after the record."""
    path.write_text(f"#!{sys.executable}\nimport sys, json, os, threading, time\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_cli_connect_run_connects_waits_sets_read_only_and_writes_the_map(kv, daemon, tmp_path):
    devices = daemon_devices(kv)
    sysfs, dev, log, map_file = tmp_path / "sys", tmp_path / "dev", tmp_path / "calls", tmp_path / "map.json"
    dev.mkdir()
    attach_later = "".join(
        f"os.makedirs({str(sysfs / 'block' / f'nvme2n{i + 1}')!r}, exist_ok=True)\n"
        f"open({str(sysfs / 'block' / f'nvme2n{i + 1}' / 'uuid')!r}, 'w').write({device_uuid(d['device_id'])!r})\n"
        f"open({str(dev / f'nvme2n{i + 1}')!r}, 'w').close()\n" for i, d in enumerate(devices))
    # the kernel scans the namespaces after connect returns: the fake attaches them 0.3 s later
    nvme = fake_tool(tmp_path / "nvme", log, "if sys.argv[1] == 'connect':\n    pid = os.fork()\n"
                     "    if pid == 0:\n        time.sleep(0.3)\n" + "".join(
                         "        " + line + "\n" for line in attach_later.splitlines()) + "        os._exit(0)\n")
    blockdev = fake_tool(tmp_path / "blockdev", log)
    code, out, err = kv("nvmeof", "connect", "--addr", "127.0.0.1", "--hostnqn", HOST1, "--run", "--write-protect",
                        "--nvme-cli", nvme, "--blockdev", blockdev, "--sysfs", str(sysfs), "--dev", str(dev),
                        "--device-map", str(map_file))
    assert code == 0, err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    nqn = "nqn.2014-08.org.nvmexpress:uuid:" + device_uuid(devices[0]["device_id"])
    paths = [f"{dev}/nvme2n{i + 1}" for i in range(len(devices))]
    assert calls == ([["connect", "-t", "tcp", "-a", "127.0.0.1", "-s", "4420", "-n", nqn, "-q", HOST1]]
                     + [["--setro", p] for p in paths]
                     + [["set-feature", p, f"--namespace-id={i + 1}", "--feature-id=0x84", "--value=1"]
                        for i, p in enumerate(paths)])
    assert json.loads(map_file.read_text()) == {d["device_id"]: p for d, p in zip(devices, paths)}
    assert out.startswith("ran: ")
    # connected already: a second --run does not connect again
    log.write_text("")
    assert kv("nvmeof", "connect", "--addr", "127.0.0.1", "--run", "--nvme-cli", nvme, "--blockdev", blockdev,
              "--sysfs", str(sysfs), "--dev", str(dev))[0] == 0
    assert [json.loads(line)[0] for line in log.read_text().splitlines()] == ["--setro"] * len(devices)


def test_cli_connect_run_reports_a_failed_connect_and_a_namespace_that_never_shows(kv, tmp_path):
    sysfs, dev, log, map_file = tmp_path / "sys", tmp_path / "dev", tmp_path / "calls", tmp_path / "map.json"
    dev.mkdir()
    failing = fake_tool(tmp_path / "nvme-fails", log, "sys.stderr.write('failed to write to nvme-fabrics device\\n')"
                                                      "\nsys.exit(1)")
    common = ["--addr", "127.0.0.1", "--run", "--sysfs", str(sysfs), "--dev", str(dev), "--device-map", str(map_file)]
    code, _, err = kv("nvmeof", "connect", *common, "--nvme-cli", failing)
    assert code == 1 and "exited 1: failed to write to nvme-fabrics device" in err and not map_file.exists()
    silent = fake_tool(tmp_path / "nvme-silent", log)
    code, _, err = kv("nvmeof", "connect", *common, "--nvme-cli", silent, "--wait-s", "0.3")
    assert code == 1 and "after 0.3 s no namespace shows daemon device(s)" in err and not map_file.exists()
    code, _, err = kv("nvmeof", "connect", *common, "--nvme-cli", str(tmp_path / "absent"))
    assert code == 1 and "not found" in err
