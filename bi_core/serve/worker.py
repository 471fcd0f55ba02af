"""What a router reads from a worker: the routes sglang-router (the SGLang Model Gateway) calls on
every worker it routes to, beside ``/health`` (its liveness probe, app.py) and ``/model_info``
(control.py), so that N ``bi-engine serve`` processes work behind it unchanged.

As sglang-router 0.3 calls them (``sgl-model-gateway/src/core/steps/worker/local/
discover_metadata.rs`` and ``core/worker_manager.rs``, checked against the released binary):

- ``GET /server_info`` (then ``/get_server_info``) when a worker is added: ``served_model_name``
  (else ``model_path``) becomes the worker's model id, which requests' ``model`` must name;
  ``tp_size``, ``dp_size``, ``max_running_requests`` ... become labels.
- ``GET /get_load``: a list with one entry per data-parallel rank, ``{"dp_rank", "num_reqs",
  "num_waiting_reqs", "num_tokens"}``; the router sums ``num_tokens`` (its power-of-two policy
  compares them; its ``/get_loads`` lists them). Here: one rank; ``num_tokens`` counts the running
  requests' tokens (prompt and generated so far).
"""

from __future__ import annotations

from fastapi import FastAPI

from bi_core import __version__


def server_info(server) -> dict:
    """SGLang's ``/server_info`` fields a router reads, with this engine's values."""
    return {"served_model_name": server.model_name, "model_path": server.model_path,
            "tp_size": server.tensor_parallel_size, "dp_size": 1, "max_running_requests": server.max_num_seqs,
            "context_length": server.max_model_len, "batch_invariant": server.invariant,
            "version": __version__, "engine": "bi-engine"}


def load(server) -> list[dict]:
    """SGLang's ``/get_load``: requests in the engine (running and waiting), the running ones' tokens.
    Zeros until the engine's first report (it reports once ready, before any request)."""
    s = server.metrics.state
    running, waiting = int(s.get("running", 0)), int(s.get("waiting", 0))
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
             "num_tokens": int(s.get("tokens_running", 0))}]


def install(app: FastAPI, server) -> None:
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(server)

    @app.get("/get_load")
    async def get_load():
        return load(server)
