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


def tiny_config(**overrides) -> dict:
    """A config dict for the tiny random preset on the reference backend, float32 on the CPU."""
    base = {
        "model": {"random": {"preset": "tiny-dense", "seed": 0}, "dtype": "float32", "device": "cpu",
                  "max_model_len": 512},
        "backend": "reference",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
        "cache": {"block_size": 16, "num_blocks": 256},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base
