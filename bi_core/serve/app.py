"""The HTTP front: a FastAPI app with OpenAI's endpoints over the engine process (``client.py``),
SGLang's native ``/generate`` (``native.py``), the RL control routes of vLLM and SGLang
(``control.py``: pause, sleep, weight sync, ...) and, in dev mode only, vLLM's ``/collective_rpc``
(``dev.py``).

Every response carries ``X-Batch-Invariant: true|false``: whether the engine behind it makes a
request's tokens and logprobs independent of the other requests it shares steps with. Every
generation response says which weights made it (``weight_version``: OpenAI responses in a top-level
``metadata`` object, as SGLang's; ``/generate`` in ``meta_info``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bi_core.config import ServeConfig
from bi_core.errors import CheckpointError, PromptTooLongError, RequestError
from bi_core.models.tokenizer import Tokenizer
from bi_core.rl.coverage import WeightsMissing
from bi_core.runtime.sequence import RequestOutput, SamplingParams
from bi_core.serve import control, dev, formats, native, worker
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


def weight_metadata(choices: list[_Choice]) -> dict:
    """SGLang's top-level ``metadata`` of an OpenAI response: the weight version of its first choice
    (the version that finished it; before it finished, the one it started with)."""
    c = choices[0]
    return {"weight_version": c.output.weight_version if c.output is not None else c.weight_version}


def _max_new_tokens(server: Server, ids: list[int], requested: int | None, param: str, prompt_param: str) -> int:
    room = server.max_model_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                            f"{server.max_model_len} tokens including at least one generated token",
                       param=prompt_param)
    if requested is not None and requested > room:
        raise ApiError(400, f"this model's maximum context length is {server.max_model_len} tokens; the prompt has "
                            f"{len(ids)} and {param} is {requested}", param=param)
    return requested if requested is not None else room


def _encode(server: Server, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < server.vocab_size]
        if bad:
            raise ApiError(400, f"prompt has token ids outside the vocabulary [0, {server.vocab_size}): {bad[:5]}",
                           param="prompt")
        ids = prompt
    elif server.tokenizer is None:
        raise ApiError(400, "text prompts need a tokenizer; this checkpoint has none: send token ids", param="prompt")
    else:
        ids = server.tokenizer.encode(prompt)
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    return ids


def _usage(choices: list[_Choice], n: int) -> dict:
    prompt = sum(c.prompt_tokens for c in choices[::n])  # a prompt counts once, whatever n
    return formats.usage(prompt, sum(len(c.output.token_ids) for c in choices if c.output is not None))


async def completions(server: Server, req: CompletionRequest, request: Request):
    server.check_model(req.model)
    tokenizer = server.tokenizer
    try:
        texts = req.prompts()
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt") from None
    server.check_size(len(texts), req.n, "prompt")
    if req.stop and tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)",
                       param="stop")
    prompts = [_encode(server, p) for p in texts]
    jobs = [(ids, req.sampling_params(_max_new_tokens(server, ids, req.max_tokens, "max_tokens", "prompt"),
                                      req.logprobs)) for ids in prompts]

    def choice(c: _Choice) -> dict:
        o = c.output
        lp = (formats.completion_logprobs(tokenizer, o.token_ids, o.token_logprobs, o.logprobs or [], 0,
                                          req.return_tokens_as_token_ids) if req.logprobs is not None else None)
        return {"index": c.index, "text": o.text or "", "logprobs": lp, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}

    return await _respond(server, req, request, jobs, choice, chat=False)


async def chat_completions(server: Server, req: ChatCompletionRequest, request: Request):
    server.check_model(req.model)
    tokenizer = server.tokenizer
    if tokenizer is None:
        raise ApiError(400, "chat needs a tokenizer; this checkpoint has none", param="messages")
    try:
        num_logprobs = req.num_logprobs()
    except ValueError as e:
        raise ApiError(400, str(e), param="top_logprobs") from None
    server.check_size(1, req.n, "messages")
    try:
        ids, turn_end = tokenizer.chat(req.conversation())
    except (ValueError, CheckpointError) as e:
        raise ApiError(400, str(e), param="messages") from None
    limit = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    new_tokens = _max_new_tokens(server, ids, limit, param, "messages")
    params = req.sampling_params(new_tokens, num_logprobs)
    jobs = [(ids, attrs.evolve(params, stop_token_ids=params.stop_token_ids + turn_end))]

    def choice(c: _Choice) -> dict:
        o = c.output
        lp = (formats.chat_logprobs(tokenizer, o.token_ids, o.token_logprobs, o.logprobs or [],
                                    req.top_logprobs or 0, req.return_tokens_as_token_ids) if req.logprobs else None)
        return {"index": c.index, "message": {"role": "assistant", "content": o.text or ""}, "logprobs": lp,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}

    return await _respond(server, req, request, jobs, choice, chat=True)


async def _respond(server: Server, req, request: Request, jobs: list, choice, *, chat: bool):
    """Run the jobs; a stream of chunks, or one response whose choices ``choice`` formats."""
    queue, choices = await server.start(jobs, "messages" if chat else "prompt")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    server.track({rid: choices})
    if req.stream:
        return _stream(server, queue, choices, req, rid, chat=chat)
    try:
        await server.wait(queue, choices, request)
    finally:
        server.untrack([rid])
    return formats.envelope("chat.completion" if chat else "text_completion", rid, server.model_name,
                            [choice(c) for c in choices], usage=_usage(choices, req.n),
                            metadata=weight_metadata(choices))


def _stream(server: Server, queue: asyncio.Queue, choices: list[_Choice], req, rid: str, chat: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    tok, as_ids = server.tokenizer, req.return_tokens_as_token_ids

    def chunk(index: int, delta: Delta | None, text: str, finish: str | None, offset: int) -> dict:
        if chat:
            lp = (formats.chat_logprobs(tok, delta.token_ids, delta.logprobs, delta.top_logprobs, req.top_logprobs or 0,
                                        as_ids) if req.logprobs and delta is not None and delta.token_ids else None)
            body = {"index": index, "delta": {"content": text} if text or delta is None else {}, "logprobs": lp,
                    "finish_reason": finish}
        else:
            lp = (formats.completion_logprobs(tok, delta.token_ids, delta.logprobs, delta.top_logprobs, offset, as_ids)
                  if req.logprobs is not None and delta is not None and delta.token_ids else None)
            body = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        extra = {"metadata": weight_metadata([choices[index]])} if finish is not None else {}
        return formats.envelope(kind, rid, server.model_name, [body], **extra)

    async def events():
        try:
            if chat:
                for c in choices:
                    yield formats.sse(formats.envelope(kind, rid, server.model_name, [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]))
            while any(c.output is None for c in choices):
                index, delta = await queue.get()
                c = choices[index]
                if delta.finished:
                    c.output = delta.output
                    # an engine failure, or the shutdown's abort: an error event, then [DONE]
                    if (failure := output_failure(c.output, server.shutting_down)) is not None:
                        yield formats.sse(failure.body)
                        break
                if delta.text or delta.finished or (delta.token_ids and req.logprobs):
                    yield formats.sse(chunk(c.index, delta, delta.text, c.output.finish_reason if c.output else None,
                                            c.text_sent))
                    c.text_sent += len(delta.text)
            else:
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield formats.sse(formats.envelope(kind, rid, server.model_name, [], usage=_usage(choices, req.n),
                                                       metadata=weight_metadata(choices)))
            yield formats.sse("[DONE]")
        finally:  # the client went away (or we are done): unfinished requests stop at the next step
            server.untrack([rid])
            server.abort(choices)

    return StreamingResponse(events(), media_type="text/event-stream")


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
                                 **native.REQUEST_MODELS, **control.REQUEST_MODELS, **dev.REQUEST_MODELS},
                           success_style=control.SUCCESS_STYLE)
    native.install(app, server)
    control.install(app, server)
    worker.install(app, server)
    if dev.dev_mode(config):
        dev.install(app, server)

    @app.get("/health")
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "bi-engine", "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def post_completions(req: CompletionRequest, request: Request):
        return await completions(server, req, request)

    @app.post("/v1/chat/completions")
    async def post_chat(req: ChatCompletionRequest, request: Request):
        return await chat_completions(server, req, request)

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
