"""Fixtures for the SGLang backend tests: a real kvtierd."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # daemon_proc: starts a real kvtierd
sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import start_kvtierd  # noqa: E402


@pytest.fixture(scope="session")
def kvtierd(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd"))
    yield d
    assert d.stop() == 0, d.log_tail()
