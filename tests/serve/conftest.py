"""The server tests' shared server (helpers: ``tests/serve_helpers.py``)."""

from __future__ import annotations

import pytest
from serve_helpers import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server for every test that needs no server of its own (requests never overlap)."""
    s = ServerProcess(tmp_path_factory.mktemp("serve"), "--api-key", API_KEY)
    yield s
    s.stop()
