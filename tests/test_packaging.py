"""Packaging by who installs what: a plain install is the client an engine links."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEB_AND_PLOTS = ("fastapi", "uvicorn", "prometheus-client", "prometheus_client", "matplotlib", "rich")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def test_a_plain_install_pulls_no_web_stack_or_plots():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = {_name(r) for r in project["dependencies"]}
    assert plain == {"numpy", "crc32c", "ml_dtypes", "lz4"}
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["daemon"]} >= {"fastapi", "uvicorn", "prometheus-client"}
    assert {_name(r) for r in extras["plot"]} == {"matplotlib"}


def test_every_package_folder_is_packaged():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {v: k for k, v in setuptools["package-dir"].items()}
    found = set()
    for folder, name in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(setuptools["packages"])


def test_the_client_imports_without_the_daemon_stack():
    code = ("import sys, kvtier.client, kvtier.client.block_client, kvtier.client.async_block_client, "
            "kvtier.client.kvcache, kvtier.common.keys, kvtier.kernels;"
            f"print(','.join(m for m in {WEB_AND_PLOTS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the client pulled in {out}"


def test_kvtierd_without_the_daemon_extra_says_which_extra(tmp_path):
    """A node that installed only the client gets a start-up error naming the extra, not a traceback."""
    code = ("import sys; sys.modules['fastapi'] = None;"  # as if the daemon extra were not installed
            "from kvtier.daemon.main import main;"
            f"sys.exit(main(['--data-dir', {str(tmp_path)!r}, '--device-size', '64m', '--region-size', '4m',"
            "'--stripe-size', '256k', '--listen', '127.0.0.1:0', '--admin', '127.0.0.1:0']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "the admin API needs fastapi, from the daemon extra: pip install 'kvtier[daemon]'" in result.stderr
    assert "Traceback" not in result.stderr
