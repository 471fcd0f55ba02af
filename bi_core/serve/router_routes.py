"""What a router reads from a worker: the routes sglang-router (the SGLang Model Gateway) calls on
every worker it routes to, beside ``/health`` (its liveness probe, app.py) and ``/model_info``
(control_routes.py), so that N ``bi-engine serve`` processes work behind it unchanged.

As sglang-router 0.3 calls them (``sgl-model-gateway/src/core/steps/worker/local/
discover_metadata.rs`` and ``core/worker_manager.rs``, checked against the released binary):

- ``GET /server_info`` (then ``/get_server_info``) when a worker is added: ``served_model_name``
  (else ``model_path``) becomes the worker's model id, which requests' ``model`` must name;
  ``tp_size``, ``dp_size``, ``max_running_requests`` ... become labels.
- ``GET /get_load``: a list with one entry per data-parallel rank, ``{"dp_rank", "num_reqs",
  "num_waiting_reqs", "num_tokens"}``; the router sums ``num_tokens`` (its power-of-two policy
  compares them; its ``/get_loads`` lists them). Here: one rank; ``num_tokens`` counts the running
  requests' tokens (prompt and generated so far).

And SGLang's ``GET /v1/loads?include=core,queues,...&dp_rank=0`` (``entrypoints/v1_loads.py``), which
RL drivers poll until a server is idle (slime's abort loop sums ``num_running_reqs`` and
``num_waiting_reqs``): ``{"timestamp", "version", "dp_rank_count", "loads": [...], "aggregate"}``,
one load per data-parallel rank with SGLang's core fields, and the sections asked for (default all)
that this engine has: ``queues`` (``paused``: requests held while generation is paused or the
engine sleeps, counted as waiting too), ``disagg`` (mode ``"null"``: not disaggregated). ``memory``,
``spec`` and ``lora`` are left out, as SGLang leaves out a section it has no figures for.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import FastAPI

from bi_core import __version__
from bi_core.serve.api_errors import ApiError

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")  # SGLang's GetLoadsReqInput


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


def _sections(include: str | None) -> set[str]:
    names = {x.strip() for x in include.split(",")} if include else {"all"}
    bad = sorted(names - set(LOAD_SECTIONS))
    if bad:
        raise ApiError(400, f"include has unknown sections {bad}; valid: {', '.join(LOAD_SECTIONS)}", param="include")
    return set(LOAD_SECTIONS) if "all" in names else names


def rank_load(server, sections: set[str]) -> dict:
    """One data-parallel rank's load in SGLang's ``GetLoadsReqOutput`` shape (its ``num_total_reqs``
    added, as the route adds it), from the engine's last report."""
    s, m = server.metrics.state, server.metrics
    running, held = int(s.get("running", 0)), int(s.get("held", 0))
    waiting = int(s.get("waiting", 0)) + held
    used, capacity = int(s.get("tokens_running", 0)), int(s.get("tokens_total", 0))
    usage = s.get("pages_used", 0) / s["pages_total"] if s.get("pages_total") else 0.0
    queried = m.num_prefix_queried
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": used, "num_total_tokens": used + int(s.get("tokens_waiting", 0)),
            "max_total_num_tokens": capacity, "token_usage": round(usage, 4),
            "gen_throughput": round(float(s.get("tokens_per_s", 0.0)), 2),
            "cache_hit_rate": round(m.num_prefix_hits / queried, 4) if queried else 0.0,
            "utilization": round(max(running / server.max_num_seqs, usage / 0.9), 4),
            "max_running_requests": server.max_num_seqs, "num_total_reqs": running + waiting}
    if "disagg" in sections:
        load["disaggregation"] = {"mode": "null", "prefill_prealloc_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                                  "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                                  "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                                  "kv_transfer_latency_ms": 0.0}
    if "queues" in sections:
        load["queues"] = {"waiting": int(s.get("waiting", 0)), "grammar": 0, "paused": held, "retracted": 0}
    return load


def loads(server, include: str | None = None, dp_rank: int | None = None) -> dict:
    """SGLang's ``/v1/loads`` body."""
    if dp_rank not in (None, 0):
        raise ApiError(400, f"dp_rank must be 0: this server has one data-parallel rank, got {dp_rank}",
                       param="dp_rank")
    rows = [rank_load(server, _sections(include))]
    total = {"total_running_reqs": sum(r["num_running_reqs"] for r in rows),
             "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
             "total_reqs": sum(r["num_total_reqs"] for r in rows),
             "total_used_tokens": sum(r["num_used_tokens"] for r in rows),
             "total_tokens": sum(r["num_total_tokens"] for r in rows),
             "avg_token_usage": round(sum(r["token_usage"] for r in rows) / len(rows), 4),
             "avg_throughput": round(sum(r["gen_throughput"] for r in rows) / len(rows), 2),
             "avg_utilization": round(sum(r["utilization"] for r in rows) / len(rows), 4)}
    return {"timestamp": datetime.now(UTC).isoformat(), "version": __version__, "dp_rank_count": len(rows),
            "loads": rows, "aggregate": total}


def install(app: FastAPI, server) -> None:
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(server)

    @app.get("/get_load")
    async def get_load():
        return load(server)

    @app.get("/v1/loads")
    async def get_loads(include: str | None = None, dp_rank: int | None = None):
        return loads(server, include, dp_rank)
