"""What the package declares."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_floor_is_3_11():
    """Python 3.11 is the floor (issue 21: 3.10 was declared but never tested, and asyncio differs
    there, e.g. its TimeoutError is not the builtin); pyproject and ruff's target agree."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
