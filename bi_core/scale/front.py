"""The control front of a deployment (``--control-port``): the RL control routes of a lone server
(``bi_core.serve.control_routes``: vLLM's and SGLang's names), each fanned out to every replica that is
up (``fanout.py``), plus what only the deployment knows: ``GET /replicas`` (the supervisor's view:
each replica's URL, state, restarts, failures), ``GET /health`` and ``GET /get_world_size``.
Generation goes to the router's port, never here.

A weight-update group spans the trainer and every replica: the trainer is rank 0 and gives the
group's ``world_size`` = ``rank_offset`` + replicas x tensor_parallel_size; replica i joins at
``rank_offset + i * tensor_parallel_size`` (the front rewrites each replica's ``rank_offset``). After
any weight update the front reads every replica's weight version; a replica that missed updates
(it was restarting) stays out of the router until one reaches it (``supervisor.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from bi_core.scale import fanout
from bi_core.scale.supervisor import Supervisor
from bi_core.serve.api_errors import ApiError, error_response
from bi_core.serve.auth import Guard

# (methods, path) fanned out as they come
FANNED = (
    (("POST",), "/pause"), (("POST",), "/resume"), (("GET",), "/is_paused"), (("POST",), "/reset_prefix_cache"),
    (("POST",), "/sleep"), (("POST",), "/wake_up"), (("GET",), "/is_sleeping"), (("GET",), "/weight_info"),
    (("GET",), "/get_weight_version"), (("POST",), "/pause_generation"), (("POST",), "/continue_generation"),
    (("GET", "POST"), "/flush_cache"), (("POST",), "/destroy_weights_update_group"),
    (("GET", "POST"), "/release_memory_occupation"), (("GET", "POST"), "/resume_memory_occupation"),
)
WEIGHT_UPDATES = ("/update_weights", "/update_weights_from_distributed", "/update_weights_from_disk")
# where a weight-update group's rank_offset and world_size sit in each route's body
GROUP_FIELDS = {"/init_weights_update_group": (), "/init_weight_transfer_engine": ("init_info",)}
# no client timeout: a weight sync or a pause that waits for requests takes as long as it takes, and
# every replica bounds its own waits (the group's timeout, serve.shutdown_timeout_s)
TIMEOUT = httpx.Timeout(None, connect=10.0)


class ControlFront:
    """What the routes share: the supervisor (who is up), the HTTP client, the settings. ``guard``:
    who may call this front (``bi_core.serve.auth``); ``replica_key``: what it sends the replicas
    (their control key: never the client's own header)."""

    def __init__(self, supervisor: Supervisor, tensor_parallel_size: int, guard: Guard, replica_key: str | None,
                 router_url: str) -> None:
        self.supervisor, self.tp, self.guard, self.router_url = supervisor, tensor_parallel_size, guard, router_url
        self.replica_headers = {"Authorization": f"Bearer {replica_key}"} if replica_key is not None else {}
        self.client = httpx.AsyncClient(timeout=TIMEOUT)

    def targets(self) -> tuple[list[tuple[int, str]], list[dict]]:
        """The replicas that are up, and the others (state named)."""
        live = self.supervisor.live()
        up = {r.index for r in live}
        skipped = [{"replica": s["replica"], "state": s["state"]} for s in self.supervisor.statuses()
                   if s["replica"] not in up]
        return [(r.index, r.url) for r in live], skipped

    def headers(self, request: Request) -> dict[str, str]:
        kept = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        return {**kept, **self.replica_headers}

    async def fan_out(self, request: Request, path: str, bodies=None) -> JSONResponse:
        """The call to every replica that is up; ``bodies(targets)``: one body each (else the call's own)."""
        targets, skipped = self.targets()
        raw = await request.body()
        per_replica = bodies(targets, raw) if bodies is not None else [raw or None] * len(targets)
        answers = await fanout.call_all(self.client, targets, request.method, path, request.url.query,
                                        self.headers(request), per_replica)
        if path in WEIGHT_UPDATES:
            await self.note_weight_versions(request)
        status, body = fanout.merge(path, answers, skipped)
        return JSONResponse(body, status_code=status)

    async def note_weight_versions(self, request: Request) -> None:
        targets, _ = self.targets()
        answers = await fanout.call_all(self.client, targets, "GET", "/get_weight_version", "", self.headers(request),
                                        [None] * len(targets))
        self.supervisor.weights_updated({a.replica: a.body["weight_version"] for a in answers
                                         if a.ok and isinstance(a.body, dict) and "weight_version" in a.body})

    def group_bodies(self, path: str) -> Callable[[list[tuple[int, str]], bytes], list[bytes]]:
        """Each replica's body for joining a weight-update group: its own rank_offset."""
        nesting = GROUP_FIELDS[path]

        def bodies(targets: list[tuple[int, str]], raw: bytes) -> list[bytes]:
            try:
                data = json.loads(raw or b"null")
            except ValueError:
                raise ApiError(400, f"{path}: the body is not JSON") from None
            holder = data
            for key in nesting:
                holder = holder.get(key) if isinstance(holder, dict) else None
            param = ".".join((*nesting, "world_size"))
            if not isinstance(holder, dict) or not all(isinstance(holder.get(k), int) and not isinstance(
                    holder.get(k), bool) for k in ("rank_offset", "world_size")):
                raise ApiError(400, f"{path}: give rank_offset and world_size as integers", param=param)
            offset, world, n = holder["rank_offset"], holder["world_size"], len(targets)
            if world != offset + n * self.tp:
                raise ApiError(400, f"world_size must be rank_offset + replicas x tensor_parallel_size = {offset} + "
                                    f"{n} x {self.tp} = {offset + n * self.tp} (the trainer is rank 0; replica i "
                                    f"joins at rank_offset + i x {self.tp}); got {world}", param=param)
            out = []
            for i in range(n):
                holder["rank_offset"] = offset + i * self.tp
                out.append(json.dumps(data).encode())
            return out

        return bodies


def create_front(front: ControlFront) -> FastAPI:
    app = FastAPI(title="bi-engine replicas: control")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404, 405: OpenAI-shaped too
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail} on the "
                                                      "control front (generation goes to the router's port)"))

    @app.middleware("http")
    async def auth(request: Request, call_next):
        refused = front.guard.check(request.url.path, request.headers.get("authorization"))
        return error_response(refused) if refused is not None else await call_next(request)

    def route(path: str, bodies=None):
        async def handler(request: Request):
            return await front.fan_out(request, path, bodies)
        return handler

    for methods, path in FANNED:
        app.add_api_route(path, route(path), methods=list(methods))
    for path in WEIGHT_UPDATES:
        app.add_api_route(path, route(path), methods=["POST"])
    for path in GROUP_FIELDS:
        app.add_api_route(path, route(path, front.group_bodies(path)), methods=["POST"])

    @app.post("/abort_requests")
    @app.post("/abort_request")
    async def abort(request: Request):
        """Abort everything on every replica. One request lives on one replica: abort it there (its
        URL is in GET /replicas), or through the router's own routes."""
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError:
            raise ApiError(400, f"{request.url.path}: the body is not JSON") from None
        if request.url.path == "/abort_request" and isinstance(data, dict) and not data.get("rid") and \
                not data.get("abort_all"):
            return Response(status_code=200)  # verl's default call: nothing to abort, as a lone server answers
        if not isinstance(data, dict) or data.get("request_ids") or data.get("rid") or (
                request.url.path == "/abort_request" and not data.get("abort_all")):
            raise ApiError(400, "only aborting all requests is fanned out (/abort_requests with no request_ids, "
                                "/abort_request with abort_all: true); a single request lives on one replica",
                           param="request_ids" if request.url.path == "/abort_requests" else "rid")
        return await front.fan_out(request, request.url.path)

    @app.get("/replicas")
    async def replicas():
        return {"router": front.router_url, "fleet_weight_version": front.supervisor.fleet_weight_version,
                "replicas": front.supervisor.statuses()}

    @app.get("/health")
    async def health():
        """200 while the router runs and at least one replica serves ("degraded" unless all do)."""
        statuses = front.supervisor.statuses()
        serving = sum(s["state"] == "serving" for s in statuses)
        router_up = front.supervisor.router.returncode() is None
        status = "ok" if serving == len(statuses) and router_up else "degraded" if serving and router_up else \
            "unavailable"
        return JSONResponse({"status": status, "router_running": router_up, "serving": serving,
                             "replicas": len(statuses)}, status_code=503 if status == "unavailable" else 200)

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        """vLLM's: the GPUs of every replica (include_dp), else of one."""
        return {"world_size": front.tp * (len(front.supervisor.replicas) if include_dp else 1)}

    return app
