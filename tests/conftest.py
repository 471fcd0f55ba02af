from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

os.environ.pop("BI_ENABLE_BATCH_INVARIANT", None)  # tests set the mode explicitly


@pytest.fixture(autouse=True)
def _no_invariant_env(monkeypatch):
    monkeypatch.delenv("BI_ENABLE_BATCH_INVARIANT", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
