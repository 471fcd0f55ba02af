"""What the HTTP routes share (``Server``): the engine process's client, the tokenizer, the settings,
the requests in flight by the names clients know them by; and how a request's choices are
submitted to the engine process and awaited (``start``, ``wait``)."""

from __future__ import annotations

import asyncio
import time

import attrs
from fastapi import Request

from bi_core.config import ServeConfig
from bi_core.errors import PromptTooLongError, RequestError
from bi_core.models.tokenizer import Tokenizer
from bi_core.rl.coverage import WeightsMissing
from bi_core.runtime.sequence import RequestOutput, SamplingParams
from bi_core.serve.api_errors import ApiError, output_failure
from bi_core.serve.client import ControlError, Delta, EngineClient, Overloaded, Unavailable
from bi_core.serve.metrics import Metrics

RETRY_AFTER_S = 1  # overloaded: the engine admits waiting requests at every step
_GONE = (-1, None)  # what a request's queue gets when its client disconnects


@attrs.define(eq=False)
class Choice:
    """One choice of a request (a prompt's sample) as the routes track it."""

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
                 metrics: Metrics, model_path: str | None = None, media_root: str | None = None) -> None:
        self.core, self.config, self.model_name, self.model_path = core, config, model_name, model_path
        self.media_root = media_root  # vision.media_root: where requests' local image files may be read
        self.tokenizer, self.metrics = tokenizer, metrics
        info = core.info
        self.max_model_len, self.invariant = info.max_model_len, info.batch_invariant
        self.vocab_size, self.max_num_seqs = info.vocab_size, info.max_num_seqs
        self.tensor_parallel_size = info.tensor_parallel_size
        # the loaded LoRA adapters, name -> where each came from; kept by the LoRA routes (serve/lora_routes.py)
        self.lora_names: dict[str, str] = dict(info.lora_adapters)
        self.takes_images = info.takes_images
        self.shutting_down = False
        self.created = int(time.time())
        self.requests: dict[str, list[Choice]] = {}  # unfinished requests by the ids clients know them by

    def track(self, named: dict[str, list[Choice]]) -> None:
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
            status, type_ = {"invalid": (400, "invalid_request_error"), "not_found": (404, "not_found_error"),
                             "unavailable": (503, "service_unavailable")}.get(e.reason, (500, "server_error"))
            raise ApiError(status, str(e), type_) from None
        except Unavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (vLLM's way), or None for the base model;
        a 404 for any other name."""
        if name == self.model_name:
            return None
        if name in self.lora_names:
            return name
        served = ", ".join([f"`{self.model_name}`", *(f"`{n}`" for n in sorted(self.lora_names))])
        raise ApiError(404, f"The model `{name}` does not exist (this server serves {served})",
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
                    prompt_param: str) -> tuple[asyncio.Queue, list[Choice]]:
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
        return queue, [Choice(i, len(jobs[i // n][0]), rid, added.weight_version)
                       for i, rid in enumerate(added.request_ids)]

    def abort(self, choices: list[Choice]) -> None:
        self.core.abort([c.request_id for c in choices if c.output is None])

    async def wait(self, queue: asyncio.Queue, choices: list[Choice], request: Request) -> None:
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
