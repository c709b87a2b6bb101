"""The dependency rule is import-linter's contracts (pyproject.toml), not a convention:
the real tree keeps them, and a copy of it with one daemon -> client import breaks them."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "wire", "client", "daemon", "kernels", "tools")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the test extra)")


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(pythonpath) if pythonpath else ""}
    return subprocess.run([str(LINT_IMPORTS), str(cwd / "pyproject.toml"), "--no-cache", "--no-logo"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _copy_tree(dest: Path) -> Path:
    """The six packages under ``dest``/kvtier (a namespace package, as installed), with the contracts."""
    pkg = dest / "kvtier"
    pkg.mkdir()
    for name in PACKAGES:
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return pkg


def test_the_tree_keeps_every_contract():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_daemon_import_of_the_client_breaks_them(tmp_path):
    pkg = _copy_tree(tmp_path)
    clean = _lint(tmp_path, tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    (pkg / "daemon" / "violation.py").write_text("from kvtier.client import block_client\n")
    broken = _lint(tmp_path, tmp_path)
    assert broken.returncode != 0
    assert "the daemon never imports the client, the kernels or the tools BROKEN" in broken.stdout
    assert "kvtier.daemon.violation -> kvtier.client.block_client (l.1)" in broken.stdout


def test_a_socket_in_the_protocol_breaks_them(tmp_path):
    pkg = _copy_tree(tmp_path)
    (pkg / "wire" / "connection_io.py").write_text("import socket\n")
    broken = _lint(tmp_path, tmp_path)
    assert broken.returncode != 0
    assert "only wire.sockets touches a socket in the protocol BROKEN" in broken.stdout
    assert "kvtier.wire.connection_io -> socket (l.1)" in broken.stdout
