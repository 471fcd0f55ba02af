"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` over the engine process (the
``Server`` of ``app.py``): one response or a stream of chunks, OpenAI's shapes with vLLM's
extensions (echo and ``prompt_logprobs`` on completions, ``stream_options.continuous_usage_stats``:
usage in every chunk). Usage counts each prompt once whatever ``n``, and says how many prompt
tokens the prefix cache served (``prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import attrs
from fastapi import Request
from fastapi.responses import StreamingResponse

from bi_core.serve import formats
from bi_core.serve.api_errors import ApiError, output_failure
from bi_core.serve.chat import ChatTurn, chat_prompt
from bi_core.serve.client import Delta
from bi_core.serve.media import chat_media
from bi_core.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from bi_core.serve.server import Choice, Server


def weight_metadata(choices: list[Choice]) -> dict:
    """SGLang's top-level ``metadata`` of an OpenAI response: the weight version of its first choice
    (the version that finished it; before it finished, the one it started with). A string, as
    SGLang's is and as the openai SDK types metadata values; ``/generate`` keeps the integer."""
    c = choices[0]
    return {"weight_version": str(c.output.weight_version if c.output is not None else c.weight_version)}


def _max_new_tokens(server: Server, ids: list[int], requested: int | None, param: str, prompt_param: str) -> int:
    room = server.max_model_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                            f"{server.max_model_len} tokens including at least one generated token",
                       param=prompt_param)
    if requested is not None and requested > room:
        raise ApiError(400, f"this model's maximum context length is {server.max_model_len} tokens; the prompt has "
                            f"{len(ids)} and {param} is {requested}", param=param)
    # 0 (echo without generation): the engine samples one token, which the answer drops
    return max(requested, 1) if requested is not None else room


def encode(server: Server, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < server.vocab_size]
        if bad:
            raise ApiError(400, f"{param} has token ids outside the vocabulary [0, {server.vocab_size}): {bad[:5]}",
                           param=param)
        ids = prompt
    elif server.tokenizer is None:
        raise ApiError(400, "text prompts need a tokenizer; this checkpoint has none: send token ids", param=param)
    else:
        ids = server.tokenizer.encode(prompt)
    if not ids:
        raise ApiError(400, f"{param} is empty", param=param)
    return ids


def _usage(choices: list[Choice], n: int) -> dict:
    firsts = choices[::n]  # a prompt counts once, whatever n
    cached = sum(c.output.num_cached_tokens for c in firsts) if all(c.output for c in firsts) else None
    return formats.usage(sum(c.prompt_tokens for c in firsts),
                         sum(len(c.output.token_ids) for c in choices if c.output is not None), cached)


async def completions(server: Server, req: CompletionRequest, request: Request):
    adapter = server.check_model(req.model)
    tokenizer = server.tokenizer
    try:
        texts = req.prompts()
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt") from None
    server.check_size(len(texts), req.n, "prompt")
    if req.stop and tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)",
                       param="stop")
    if req.echo and tokenizer is None:
        raise ApiError(400, "echo needs a tokenizer (the prompt's text); this checkpoint has none", param="echo")
    prompts = [encode(server, p) for p in texts]
    num_computed = req.num_prompt_logprobs()
    jobs = [(ids, req.sampling_params(_max_new_tokens(server, ids, req.max_tokens, "max_tokens", "prompt"),
                                      req.logprobs, num_computed)) for ids in prompts]
    jobs = [(ids, attrs.evolve(p, lora_name=adapter)) for ids, p in jobs]

    def choice(c: Choice) -> dict:
        o, j = c.output, c.index // req.n
        text = o.text or ""
        if req.echo:  # the prompt as sent, or the text of its ids
            text = (texts[j] if isinstance(texts[j], str) else tokenizer.decode(prompts[j])) + text
        lp = None
        if req.logprobs is not None and req.echo:
            lp = formats.echo_logprobs(tokenizer, o, req.logprobs, num_computed, req.return_tokens_as_token_ids)
        elif req.logprobs is not None:
            lp = formats.completion_logprobs(tokenizer, o.token_ids, o.token_logprobs, o.logprobs or [], 0,
                                             req.return_tokens_as_token_ids)
        body = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = formats.prompt_logprobs(tokenizer, o, req.prompt_logprobs, num_computed)
        return body

    return await _respond(server, req, request, jobs, choice, turn=None, drop_generated=req.max_tokens == 0)


def chat_jobs(server: Server, req: ChatCompletionRequest) -> tuple[ChatTurn, list]:
    """A chat request's turn (its prompt) and the one job it runs; what ``/v1/chat/completions/render``
    answers without running it. ``model`` may name a LoRA adapter: the job runs under it."""
    adapter = server.check_model(req.model)
    try:
        num_logprobs = req.num_logprobs()
    except ValueError as e:
        raise ApiError(400, str(e), param="top_logprobs") from None
    server.check_size(1, req.n, "messages")
    turn = ChatTurn(req, chat_prompt(server, req))
    structured = turn.constraint()  # before the prompt's length: a request's own conflicts come first
    ids = turn.prompt.ids
    limit = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    new_tokens = _max_new_tokens(server, ids, limit, param, "messages")
    params = req.sampling_params(new_tokens, num_logprobs)
    # the template's turn end is an EOS as vLLM counts it (generation_config's eos ids), so
    # ignore_eos ignores it too
    ends = () if params.ignore_eos else turn.prompt.stop_token_ids
    params = attrs.evolve(params, stop_token_ids=params.stop_token_ids + ends, structured=structured,
                          lora_name=adapter)
    images, videos = chat_media([m.content for m in req.messages], server.media_root, server.takes_images)
    if images or videos:
        return turn, [(ids, params, {"images": images or None, "videos": videos or None})]
    return turn, [(ids, params)]


async def chat_completions(server: Server, req: ChatCompletionRequest, request: Request):
    tokenizer = server.tokenizer
    turn, jobs = chat_jobs(server, req)

    def choice(c: Choice) -> dict:
        o = c.output
        lp = (formats.chat_logprobs(tokenizer, o.token_ids, o.token_logprobs, o.logprobs or [],
                                    req.top_logprobs or 0, req.return_tokens_as_token_ids) if req.logprobs else None)
        message, finish = turn.message(o)
        body = {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                "stop_reason": o.stop_reason}
        if req.return_token_ids:
            body["token_ids"] = o.token_ids
        return body

    return await _respond(server, req, request, jobs, choice, turn=turn)


async def _respond(server: Server, req, request: Request, jobs: list, choice, *, turn: ChatTurn | None,
                   drop_generated: bool = False):
    """Run the jobs; a stream of chunks, or one response whose choices ``choice`` formats.
    ``turn``: a chat request's (None: a completion). ``drop_generated``: the jobs ran for their
    prompts alone (``formats.without_generated``)."""
    queue, choices = await server.start(jobs, "messages" if turn else "prompt")
    rid = f"{'chatcmpl' if turn else 'cmpl'}-{uuid.uuid4().hex}"
    server.track({rid: choices})
    if req.stream:
        return _stream(server, queue, choices, req, rid, turn)
    try:
        await server.wait(queue, choices, request)
    finally:
        server.untrack([rid])
    if drop_generated:
        for c in choices:
            c.output = formats.without_generated(c.output)
    return formats.envelope("chat.completion" if turn else "text_completion", rid, req.model,
                            [choice(c) for c in choices], usage=_usage(choices, req.n),
                            metadata=weight_metadata(choices), **(turn.top_fields() if turn else {}))


def _stream(server: Server, queue: asyncio.Queue, choices: list[Choice], req, rid: str, turn: ChatTurn | None):
    chat = turn is not None
    kind = "chat.completion.chunk" if chat else "text_completion"
    tok, as_ids = server.tokenizer, req.return_tokens_as_token_ids
    chat_stream = turn.stream(len(choices), tok) if chat else None

    def running_usage(c: Choice) -> dict:
        """vLLM's continuous usage: the choice's prompt and its tokens so far."""
        return formats.usage(c.prompt_tokens, c.tokens_sent)

    def completion_body(c: Choice, delta: Delta) -> dict | None:
        if not (delta.text or delta.finished or (delta.token_ids and req.logprobs)):
            return None
        lp = (formats.completion_logprobs(tok, delta.token_ids, delta.logprobs, delta.top_logprobs, c.text_sent, as_ids)
              if req.logprobs is not None and delta.token_ids else None)
        return {"index": c.index, "text": delta.text, "logprobs": lp,
                "finish_reason": c.output.finish_reason if delta.finished else None}

    def chunk(c: Choice, body: dict, finished: bool) -> dict:
        extra = {"metadata": weight_metadata([c])} if finished else {}
        if req.continuous_usage:
            extra["usage"] = running_usage(c)
        return formats.envelope(kind, rid, req.model, [body], **extra)

    async def events():
        try:
            if chat:
                for c in choices:
                    extra = {"usage": running_usage(c)} if req.continuous_usage else {}
                    if c.index == 0:
                        extra.update(turn.top_fields())  # vLLM: prompt_token_ids in the first chunk
                    yield formats.sse(formats.envelope(kind, rid, req.model, [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], **extra))
            while any(c.output is None for c in choices):
                index, delta = await queue.get()
                c = choices[index]
                c.tokens_sent += len(delta.token_ids)
                if delta.finished:
                    c.output = delta.output
                    # an engine failure, or the shutdown's abort: an error event, then [DONE]
                    if (failure := output_failure(c.output, server.shutting_down)) is not None:
                        yield formats.sse(failure.body)
                        break
                body = chat_stream.choice(c.index, c.output, delta) if chat else completion_body(c, delta)
                if body is not None:
                    yield formats.sse(chunk(c, body, delta.finished))
                    c.text_sent += len(delta.text)
            else:
                if req.include_usage:
                    yield formats.sse(formats.envelope(kind, rid, req.model, [], usage=_usage(choices, req.n),
                                                       metadata=weight_metadata(choices)))
            yield formats.sse("[DONE]")
        finally:  # the client went away (or we are done): unfinished requests stop at the next step
            server.untrack([rid])
            server.abort(choices)

    return StreamingResponse(events(), media_type="text/event-stream")
