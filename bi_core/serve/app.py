"""The HTTP front: a FastAPI app over the engine process (``client.py``): OpenAI's endpoints
(``completions.py``), SGLang's native ``/generate`` (``native.py``), the routes clients probe
(``info.py``: models, tokenize, version), what routers read (``worker.py``), the RL control routes
of vLLM and SGLang (``control.py``: pause, sleep, weight sync, ...) and, in dev mode only, vLLM's
``/collective_rpc`` (``dev.py``).

Every response carries ``X-Batch-Invariant: true|false``: whether the engine behind it makes a
request's tokens and logprobs independent of the other requests it shares steps with. Every
generation response says which weights made it (``weight_version``: OpenAI responses in a top-level
``metadata`` object, as SGLang's, a string there; ``/generate`` in ``meta_info``, an integer)."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bi_core.config import ServeConfig
from bi_core.errors import PromptTooLongError, RequestError
from bi_core.models.tokenizer import Tokenizer
from bi_core.rl.coverage import WeightsMissing
from bi_core.runtime.sequence import RequestOutput, SamplingParams
from bi_core.serve import completions, control, dev, info, native, worker
from bi_core.serve.auth import OPEN_PATHS, Guard
from bi_core.serve.client import ControlError, Delta, EngineClient, Overloaded, Unavailable
from bi_core.serve.errors import ApiError, error_response, install_error_handlers, output_failure
from bi_core.serve.metrics import Metrics
from bi_core.serve.protocol import ChatCompletionRequest, CompletionRequest

INVARIANT_HEADER = "X-Batch-Invariant"
RETRY_AFTER_S = 1  # overloaded: the engine admits waiting requests at every step
_GONE = (-1, None)  # what a request's queue gets when its client disconnects


@attrs.define(eq=False)
class _Choice:
    index: int
    prompt_tokens: int
    request_id: int
    weight_version: int = 0  # the engine's when it added the request (its output says which finished it)
    output: RequestOutput | None = None
    text_sent: int = 0
    tokens_sent: int = 0  # a stream's tokens so far (continuous usage)


class Server:
    """What the routes share: the engine process's client, the tokenizer, the model's name, the
    mode, the settings."""

    def __init__(self, core: EngineClient, config: ServeConfig, model_name: str, tokenizer: Tokenizer | None,
                 metrics: Metrics, model_path: str | None = None) -> None:
        self.core, self.config, self.model_name, self.model_path = core, config, model_name, model_path
        self.tokenizer, self.metrics = tokenizer, metrics
        info = core.info
        self.max_model_len, self.invariant = info.max_model_len, info.batch_invariant
        self.vocab_size, self.max_num_seqs = info.vocab_size, info.max_num_seqs
        self.tensor_parallel_size = info.tensor_parallel_size
        self.shutting_down = False
        self.created = int(time.time())
        self.requests: dict[str, list[_Choice]] = {}  # unfinished requests by the ids clients know them by

    def track(self, named: dict[str, list[_Choice]]) -> None:
        """Let ``/abort_request`` (SGLang) and ``/abort_requests`` (vLLM) find these choices by name."""
        self.requests.update(named)

    def untrack(self, names: list[str]) -> None:
        for name in names:
            self.requests.pop(name, None)

    async def call(self, kind: type, **fields):
        """A control call to the engine process: its value once the engine did it. Errors are
        ApiErrors: 400 for a bad argument, 503 when the engine takes no more calls, 500 when it
        failed."""
        try:
            return await asyncio.wrap_future(self.core.control(kind, **fields))
        except ControlError as e:
            status, type_ = {"invalid": (400, "invalid_request_error"),
                             "unavailable": (503, "service_unavailable")}.get(e.reason, (500, "server_error"))
            raise ApiError(status, str(e), type_) from None
        except Unavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def check_size(self, num_prompts: int, n: int, prompt_param: str) -> None:
        """A request's sequences (prompts x n) must fit in one batch: they are added together, and
        no request queues behind itself."""
        num = num_prompts * n
        if num > self.max_num_seqs:
            raise ApiError(400, f"this request asks for {num} sequences ({num_prompts} prompt(s) x n={n}); a request "
                                f"may ask for at most scheduler.max_num_seqs={self.max_num_seqs} (prompts x n), so that "
                                "all of them fit in one batch", param="n" if n > self.max_num_seqs else prompt_param)

    async def start(self, jobs: list[tuple[list[int], SamplingParams]],
                    prompt_param: str) -> tuple[asyncio.Queue, list[_Choice]]:
        """Submit all (prompt ids, params) jobs in one message: the engine adds them together before
        its next step. Job j's sample i is choice ``j * n + i``; every choice's deltas arrive on one
        queue as (choice index, delta)."""
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def emit(choice: int, delta: Delta) -> None:  # on the event loop
            queue.put_nowait((choice, delta))
        try:
            added = await asyncio.wrap_future(self.core.submit(jobs, emit, aloop.call_soon_threadsafe))
        except Overloaded as e:
            raise ApiError(503, str(e), "service_unavailable", retry_after_s=RETRY_AFTER_S) from None
        except Unavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param=prompt_param) from None
        except WeightsMissing as e:  # a level-2 sleep, or a broken update: nothing to serve with yet
            raise ApiError(409, str(e), code="weights_missing") from None
        except RequestError as e:  # all the HTTP side leaves to the engine: whether n samples fit at once
            raise ApiError(400, str(e), param="n" if jobs[0][1].n > 1 else prompt_param) from None
        n = jobs[0][1].n
        return queue, [_Choice(i, len(jobs[i // n][0]), rid, added.weight_version)
                       for i, rid in enumerate(added.request_ids)]

    def abort(self, choices: list[_Choice]) -> None:
        self.core.abort([c.request_id for c in choices if c.output is None])

    async def wait(self, queue: asyncio.Queue, choices: list[_Choice], request: Request) -> None:
        """Until every choice has finished; a client that goes away aborts them all at once."""
        watcher = asyncio.create_task(_watch_disconnect(request, queue))
        try:
            while any(c.output is None for c in choices):
                index, delta = await queue.get()
                if delta is None:
                    self.abort(choices)
                    raise ApiError(499, "the client closed the connection")  # an answer to no one
                if delta.finished:
                    choices[index].output = delta.output
        finally:
            watcher.cancel()
        for c in choices:
            if (failure := output_failure(c.output, self.shutting_down)) is not None:
                raise failure


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Put ``_GONE`` on the queue when the client disconnects. The body has been read, so the
    next ASGI message is the disconnect, delivered as soon as the server sees the socket close."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except OSError:
        pass
    queue.put_nowait(_GONE)


def create_app(core: EngineClient, config: ServeConfig, model_name: str, tokenizer: Tokenizer | None,
               metrics: Metrics, model_path: str | None = None) -> FastAPI:
    """The app over a started engine process; stopping the app stops the engine process.
    ``model_path``: the checkpoint directory (None for a random preset), as routers read it."""
    server = Server(core, config, model_name, tokenizer, metrics, model_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.shutting_down = True
        await asyncio.to_thread(core.stop, 0.0)  # uvicorn already waited for in-flight responses

    app = FastAPI(title="bi-engine", lifespan=lifespan)
    app.state.server = server
    _install_middleware(app, server)
    install_error_handlers(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                 **native.REQUEST_MODELS, **info.REQUEST_MODELS, **control.REQUEST_MODELS,
                                 **dev.REQUEST_MODELS}, success_style=control.SUCCESS_STYLE)
    native.install(app, server)
    info.install(app, server)
    control.install(app, server)
    worker.install(app, server)
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
