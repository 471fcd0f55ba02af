"""One ``bi-engine serve`` process (the embedded tiny model on the CPU, no API key, one torch
thread so its arithmetic matches the Python API's bitwise) that the recorded client bodies are
replayed against, and the Python API on the same config."""

from __future__ import annotations

import pytest
import torch
import yaml

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import serve_helpers  # noqa: E402 (after the skips)

# prompts are prefilled in 32-token chunks, so a repeated prompt finds its prefix cached
CONFIG = serve_helpers.CONFIG.replace("max_num_batched_tokens: 2048}", "max_num_batched_tokens: 2048, "
                                       "prefill_chunk_size: 32}")


@pytest.fixture(scope="session")
def client_server(tmp_path_factory):
    assert "prefill_chunk_size" in CONFIG
    s = serve_helpers.ServerProcess(tmp_path_factory.mktemp("clients"), config=CONFIG, env={"OMP_NUM_THREADS": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="session")
def engine():
    """The Python API on the server's config, with the server engine's thread count."""
    from bi_core import EngineConfig, build_engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(EngineConfig.from_dict(yaml.safe_load(CONFIG)))
    torch.set_num_threads(before)
