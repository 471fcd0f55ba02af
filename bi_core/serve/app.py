"""The HTTP front: a FastAPI app over the engine process (``client.py``; what its routes share:
``server.py``): OpenAI's endpoints (``completions.py``), SGLang's native ``/generate``
(``native.py``), the routes clients probe (``info.py``: models, tokenize, version), what routers
read (``router_routes.py``), the RL control routes of vLLM and SGLang (``control_routes.py``: pause,
sleep, weight sync, ...) and, in dev mode only, vLLM's ``/collective_rpc`` (``dev.py``).

Every response carries ``X-Batch-Invariant: true|false``: whether the engine behind it makes a
request's tokens and logprobs independent of the other requests it shares steps with. Every
generation response says which weights made it (``weight_version``: OpenAI responses in a top-level
``metadata`` object, as SGLang's, a string there; ``/generate`` in ``meta_info``, an integer)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bi_core.config import ServeConfig
from bi_core.models.tokenizer import Tokenizer
from bi_core.serve import completions, control_routes, dev, info, lora_routes, native, router_routes
from bi_core.serve.api_errors import ApiError, error_response, install_error_handlers
from bi_core.serve.auth import OPEN_PATHS, Guard
from bi_core.serve.client import EngineClient
from bi_core.serve.metrics import Metrics
from bi_core.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from bi_core.serve.responses import ResponsesRequest, create_response
from bi_core.serve.server import Server

INVARIANT_HEADER = "X-Batch-Invariant"


def create_app(core: EngineClient, config: ServeConfig, model_name: str, tokenizer: Tokenizer | None,
               metrics: Metrics, model_path: str | None = None, media_root: str | None = None) -> FastAPI:
    """The app over a started engine process; stopping the app stops the engine process.
    ``model_path``: the checkpoint directory (None for a random preset), as routers read it.
    ``media_root``: ``vision.media_root``, the directory requests' local image files may be read from."""
    server = Server(core, config, model_name, tokenizer, metrics, model_path, media_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.shutting_down = True
        await asyncio.to_thread(core.stop, 0.0)  # uvicorn already waited for in-flight responses

    app = FastAPI(title="bi-engine", lifespan=lifespan)
    app.state.server = server
    _install_middleware(app, server)
    install_error_handlers(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                 "/v1/responses": ResponsesRequest,
                                 **native.REQUEST_MODELS, **info.REQUEST_MODELS, **control_routes.REQUEST_MODELS,
                                 **lora_routes.REQUEST_MODELS, **dev.REQUEST_MODELS}, success_style=control_routes.SUCCESS_STYLE | lora_routes.SUCCESS_STYLE)
    native.install(app, server)
    info.install(app, server)
    control_routes.install(app, server)
    lora_routes.install(app, server)
    router_routes.install(app, server)
    if dev.dev_mode(config):
        dev.install(app, server)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's and SageMaker's name for it
    async def health():
        """vLLM's liveness: 503 once the engine cannot serve again (failed, gone, shutting down).
        Without whole weights (a level-2 sleep; a broken update) it stays 200, with ``status``
        ``weights_missing`` and the reason (it is alive and waiting for a weight sync, which a
        restart would lose; generation routes answer 409 and /health_generate 503 meanwhile)."""
        down = server.shutting_down or not core.accepting
        missing = core.status.get("weights_missing")
        status = "unavailable" if down else "weights_missing" if missing else "ok"
        reason = core.failure or ("shutting down" if server.shutting_down else None) or missing
        body = {"status": status, "batch_invariant": server.invariant, "reason": reason,
                "weight_groups": core.status.get("weight_groups", {})}
        return JSONResponse(body, status_code=503 if down else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def post_completions(req: CompletionRequest, request: Request):
        return await completions.completions(server, req, request)

    @app.post("/v1/chat/completions")
    async def post_chat(req: ChatCompletionRequest, request: Request):
        return await completions.chat_completions(server, req, request)

    @app.post("/v1/responses")
    async def post_responses(req: ResponsesRequest, request: Request):
        return await create_response(server, req, request)

    return app


def _install_middleware(app: FastAPI, server: Server) -> None:
    guard = Guard.of(server.config)

    @app.middleware("http")
    async def mode_auth_and_shutdown(request: Request, call_next):
        refused = guard.check(request.url.path, request.headers.get("authorization"))
        if refused is not None:  # the keys and the control routes' rule (auth.py)
            response = error_response(refused)
        elif server.shutting_down and request.method in ("POST", "PUT") and not request.url.path.startswith(
                OPEN_PATHS):
            response = error_response(ApiError(503, "the server is shutting down", "service_unavailable"))
        else:
            response = await call_next(request)
        response.headers[INVARIANT_HEADER] = "true" if server.invariant else "false"
        return response
