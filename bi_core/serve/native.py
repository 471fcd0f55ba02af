"""SGLang's native ``/generate`` (token ids or text in; token ids, per-token logprobs, routed
experts out) and ``/health_generate``.

The request is SGLang's ``GenerateReqInput``: ``text`` or ``input_ids`` (one prompt, or a batch),
``sampling_params`` (one dict, or one per prompt; SGLang's names and defaults: ``max_new_tokens``
128, ``temperature`` 1.0, ``top_k`` -1 = off, ``sampling_seed``), ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num`` (each one value or one per prompt),
``return_text_in_logprobs``, ``return_routed_experts``, ``routed_experts_start_len``, ``rid``,
``stream`` (``native_protocol.py``); ``json_schema``, ``regex`` or ``ebnf`` constrain the output
(``structured_fields.py``). SGLang's parameters the engine does not implement are accepted only at
their no-op values (a penalty of 0, no structural tag, ...): anything else is a 400 naming the
field, as is any unknown field. ``max_new_tokens`` 0 runs the prompt alone (SGLang's scoring: its
``input_token_logprobs``, no output tokens, finish reason ``length`` 0). Parameters accepted that
change nothing here (``custom_params``) are named in the ``X-Unused-Params`` header.

The answer is SGLang's: per choice ``{"text", "output_ids", "meta_info"}``, ``meta_info`` holding
``id``, ``finish_reason`` (``{"type": "stop", "matched": <token id or string>}``, ``{"type":
"length", "length": n}``, ``{"type": "abort", "message": ...}``), ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``weight_version``, with ``return_logprob``
``output_token_logprobs`` as ``[logprob, token_id, text or null]`` triples (and
``input_token_logprobs`` from ``logprob_start_len``, ``*_top_logprobs`` with ``top_logprobs_num``),
with ``return_routed_experts`` ``routed_experts``: base64 of little-endian int32, C order, shape
``[positions, moe_layers, top_k]``, one row per position that ran through the model (prompt and
generated tokens but the last), from ``routed_experts_start_len``. One prompt with n = 1 answers one
object, anything else a list (prompt-major: prompt j's sample i is item ``j * n + i``). A stream
sends SGLang's events: ``data: {...}`` with the text, ids and logprobs so far (and ``index`` for a
batch), ``data: [DONE]`` last; prompt logprobs and routed experts come in a choice's last event."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import attrs
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from bi_core.runtime.sequence import RequestOutput, SamplingParams
from bi_core.serve import formats
from bi_core.serve.api_errors import ApiError, output_failure, validation_error
from bi_core.serve.client import Delta
from bi_core.serve.media import sglang_media
from bi_core.serve.native_protocol import REQUEST_MODELS, GenerateRequest, GenerateSamplingParams
from bi_core.serve.structured_fields import sglang_spec

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
MAX_TOP_LOGPROBS = 20  # the engine's limit (SamplingParams.logprobs)
UNUSED_HEADER = "X-Unused-Params"  # the request's parameters that changed nothing (custom_params)
__all__ = ["REQUEST_MODELS", "generate", "install"]


@attrs.define(eq=False)
class _Options:
    """Prompt j's output options."""

    name: str | None  # its rid, when the client gave one
    return_logprob: bool
    logprob_start_len: int  # -1: no prompt logprobs
    top_logprobs_num: int
    prompt_only: bool = False  # max_new_tokens 0: the one token the engine samples is dropped


@attrs.define(eq=False)
class _Progress:
    """A choice's output so far (a stream's events carry all of it, as SGLang's do)."""

    name: str
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    tops: list[dict[int, float]] = attrs.Factory(list)
    text: str = ""

    def add(self, d: Delta) -> None:
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.tops += d.top_logprobs
        self.text += d.text


def _per_prompt(value, num: int, param: str, default):
    """One value for every prompt, or a list of one per prompt."""
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise ApiError(400, f"{param} has {len(value)} values for {num} prompts", param=param)
        return value
    return [value] * num


def _adapters(server, req: GenerateRequest, num: int) -> list[str | None]:
    """Each prompt's LoRA adapter: SGLang's ``lora_path`` (a loaded adapter's name), else the one
    ``model`` names (vLLM's way; None: the base model)."""
    default = server.check_model(req.model) if req.model is not None else None
    names = _per_prompt(req.lora_path, num, "lora_path", default)
    unknown = sorted({n for n in names if n is not None and n not in server.lora_names})
    if unknown:
        raise ApiError(400, f"lora_path names no loaded LoRA adapter: {', '.join(unknown)} (loaded: "
                            f"{', '.join(sorted(server.lora_names)) or 'none'}; /v1/load_lora_adapter loads one)",
                       param="lora_path", code="lora_not_found")
    return [default if n is None else n for n in names]


def _prompts(server, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    """The prompts' token ids, whether the request is a single prompt, and the field they came in."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="input_ids" if req.input_ids else "text")
    if req.input_ids is not None:
        field, single = "input_ids", bool(req.input_ids) and isinstance(req.input_ids[0], int)
        prompts = [req.input_ids] if single else req.input_ids
    else:
        field, single = "text", isinstance(req.text, str)
        prompts = [req.text] if single else req.text
    if not prompts:
        raise ApiError(400, f"{field} is empty", param=field)
    out = []
    for j, p in enumerate(prompts):
        if isinstance(p, list):
            bad = [t for t in p if not 0 <= t < server.vocab_size]
            if bad:
                raise ApiError(400, f"{field}{'' if single else f'[{j}]'} has token ids outside the vocabulary "
                                    f"[0, {server.vocab_size}): {bad[:5]}", param=field)
            ids = p
        elif server.tokenizer is None:
            raise ApiError(400, "text prompts need a tokenizer; this checkpoint has none: send input_ids", param=field)
        else:
            ids = server.tokenizer.encode(p)
        if not ids:
            raise ApiError(400, f"{field}{'' if single else f'[{j}]'} is empty", param=field)
        out.append(ids)
    return out, single, field


def _sampling(raw, num: int) -> list[GenerateSamplingParams]:
    items = _per_prompt(raw, num, "sampling_params", {})
    out = []
    for j, item in enumerate(items):
        try:
            out.append(GenerateSamplingParams.model_validate(item))
        except ValidationError as e:
            where = "sampling_params" if not isinstance(raw, list) else f"sampling_params[{j}]"
            inner = validation_error(GenerateSamplingParams, [dict(x) for x in e.errors()])
            param = inner.body["error"]["param"]
            raise ApiError(400, f"{where}.{inner}", param=f"{where}.{param}" if param else where) from None
    if len({sp.n for sp in out}) > 1:
        raise ApiError(400, "sampling_params: every prompt must ask for the same n", param="sampling_params")
    return out


@attrs.frozen
class Plan:
    """A ``/generate`` request as the engine runs it."""

    jobs: list  # one (prompt ids, SamplingParams) per prompt
    options: list[_Options]  # each prompt's output options
    single: bool  # one prompt (not a batch)
    field: str  # the field the prompts came in
    unused: list[str]  # the parameters given that change nothing (reported in UNUSED_HEADER)


def build_jobs(server, req: GenerateRequest) -> Plan:
    """The engine jobs of a request and how to answer it. Raises ApiError for a bad request."""
    prompts, single, field = _prompts(server, req)
    num = len(prompts)
    sps = _sampling(req.sampling_params, num)
    n = sps[0].n
    server.check_size(num, n, field)
    if isinstance(req.rid, str) and num > 1:  # SGLang: a batch's rid string prefixes its items' ids
        names = [f"{req.rid}_{j}" for j in range(num)]
    else:
        names = _per_prompt(req.rid, num, "rid", None)
    given = [x for x in names if x is not None]
    if len(set(given)) < len(given) or any(x in server.requests for x in given):
        raise ApiError(400, "rid must be unique: another request in flight (or in this one) has it", param="rid")
    return_logprob = _per_prompt(req.return_logprob, num, "return_logprob", False)
    start_len = _per_prompt(req.logprob_start_len, num, "logprob_start_len", -1)
    top_num = _per_prompt(req.top_logprobs_num, num, "top_logprobs_num", 0)
    adapters = _adapters(server, req, num)
    jobs, options, unused = [], [], []
    media = sglang_media(req.image_data, req.video_data, num, server.media_root, server.takes_images)
    for j, (ids, sp) in enumerate(zip(prompts, sps)):
        room = server.max_model_len - len(ids)
        where = "sampling_params" if not isinstance(req.sampling_params, list) else f"sampling_params[{j}]"
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{server.max_model_len} tokens including at least one generated token", param=field)
        if sp.max_new_tokens is not None and sp.max_new_tokens > room:
            raise ApiError(400, f"this model's maximum context length is {server.max_model_len} tokens; the prompt has "
                                f"{len(ids)} and max_new_tokens is {sp.max_new_tokens}",
                           param=f"{where}.max_new_tokens")
        if not -1 <= start_len[j] < len(ids):
            raise ApiError(400, f"logprob_start_len must be -1 (output logprobs only) or a prompt position in "
                                f"[0, {len(ids)}), got {start_len[j]}", param="logprob_start_len")
        if not 0 <= top_num[j] <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs_num must be in 0..{MAX_TOP_LOGPROBS}, got {top_num[j]}",
                           param="top_logprobs_num")
        if req.routed_experts_start_len > len(ids):
            raise ApiError(400, f"routed_experts_start_len must be in [0, {len(ids)}] (the prompt's length), got "
                                f"{req.routed_experts_start_len}", param="routed_experts_start_len")
        if sp.stop and server.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)",
                           param=f"{where}.stop")
        lp = return_logprob[j]
        extra = {"return_routed_experts": True} if req.return_routed_experts else {}
        if adapters[j] is not None:
            extra["lora_name"] = adapters[j]
        # max_new_tokens 0 (SGLang's scoring): the engine samples one token, which the answer drops
        new_tokens = room if sp.max_new_tokens is None else max(sp.max_new_tokens, 1)
        if sp.min_new_tokens > (sp.max_new_tokens if sp.max_new_tokens is not None else room):
            raise ApiError(400, f"min_new_tokens ({sp.min_new_tokens}) must be at most max_new_tokens",
                           param=f"{where}.min_new_tokens")
        structured = sglang_spec(sp, where)
        if structured is not None and sp.min_new_tokens:
            raise ApiError(400, "min_new_tokens must be 0 with a structured output: the grammar decides where the "
                                "output ends", param=f"{where}.min_new_tokens")
        params = SamplingParams(
            max_new_tokens=new_tokens, n=n, structured=structured, masked_logprobs=sp.masked_logprobs,
            temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0), seed=sp.sampling_seed,
            logprobs=top_num[j] if lp and top_num[j] > 0 else None,
            prompt_logprobs=top_num[j] if lp and start_len[j] >= 0 else None,
            stop_token_ids=tuple(sp.stop_token_ids or ()), stop=sp.stop or (), ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_new_tokens, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            include_stop_str_in_output=sp.no_stop_trim, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, **extra)
        jobs.append((ids, params, media[j]) if media[j]["images"] or media[j]["videos"] else (ids, params))
        options.append(_Options(names[j], lp, start_len[j], top_num[j], prompt_only=sp.max_new_tokens == 0))
        unused += [f"{where}.{name}" for name in sp.unused() if f"{where}.{name}" not in unused]
    return Plan(jobs, options, single, field, unused)


def finish_reason(o: RequestOutput) -> dict:
    """SGLang's finish reason object."""
    if o.finish_reason == "stop":
        return {"type": "stop", "matched": o.stop_reason}
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    return {"type": o.finish_reason, "message": o.error or ("aborted" if o.finish_reason == "abort" else None)}


def encode_routed_experts(routed, start: int) -> str:
    """SGLang's wire form: base64 of little-endian int32 in C order, ``[positions, layers, top_k]``."""
    arr = np.asarray(routed, dtype=np.int32)
    return base64.b64encode(np.ascontiguousarray(arr[start:], dtype="<i4").tobytes()).decode("ascii")


class Formatter:
    """Turns a request's choices into SGLang's items."""

    def __init__(self, server, req: GenerateRequest, options: list[_Options], n: int) -> None:
        self.server, self.req, self.options, self.n = server, req, options, n
        self.started = time.monotonic()
        tok = server.tokenizer if req.return_text_in_logprobs else None
        self.text = (lambda t: formats.token_text(tok, t)) if tok is not None else (lambda t: None)

    def names(self, num_choices: int) -> list[str]:
        """Each choice's ``meta_info.id``: the client's rid for a prompt with n = 1, else a fresh id."""
        out = []
        for i in range(num_choices):
            name = self.options[i // self.n].name
            out.append(name if name is not None and self.n == 1 else uuid.uuid4().hex)
        return out

    def _entry(self, lp, token: int) -> list:
        return [lp, token, self.text(token)]

    def _top(self, d: dict[int, float] | None, num: int) -> list | None:
        if not d:
            return None
        return [self._entry(lp, t) for t, lp in sorted(d.items(), key=lambda kv: -kv[1])[:num]]

    def item(self, c, progress: _Progress) -> dict:
        """A choice's item: final once ``c.output`` is set, else its progress so far."""
        o: RequestOutput | None = c.output
        opts = self.options[c.index // self.n]
        ids = o.token_ids if o is not None else progress.token_ids
        meta: dict[str, Any] = {
            "id": progress.name, "finish_reason": finish_reason(o) if o is not None else None,
            "prompt_tokens": c.prompt_tokens, "weight_version": o.weight_version if o is not None else c.weight_version,
            "completion_tokens": len(ids), "cached_tokens": o.num_cached_tokens if o is not None else 0}
        if opts.return_logprob:
            lps = o.token_logprobs if o is not None else progress.logprobs
            meta["output_token_logprobs"] = [self._entry(lp, t) for lp, t in zip(lps, ids)]
            if opts.top_logprobs_num > 0:
                tops = (o.logprobs or []) if o is not None else progress.tops
                meta["output_top_logprobs"] = [self._top(d, opts.top_logprobs_num) for d in tops]
            if opts.logprob_start_len < 0:
                meta["input_token_logprobs"] = []
                if opts.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = []
            elif o is not None:
                self._prompt_logprobs(meta, o, opts)
        if o is not None:
            if self.req.return_routed_experts:
                routed = getattr(o, "routed_experts", None)
                if routed is None and o.finish_reason in ("stop", "length"):
                    raise ApiError(500, "the engine returned no routed experts for a finished request "
                                        "(model.enable_return_routed_experts must be true)", "server_error")
                if routed is not None:
                    meta["routed_experts"] = encode_routed_experts(routed, self.req.routed_experts_start_len)
            meta["e2e_latency"] = time.monotonic() - self.started
        text = o.text if o is not None else progress.text
        return {"text": text or "", "output_ids": list(ids), "meta_info": meta}

    def _prompt_logprobs(self, meta: dict, o: RequestOutput, opts: _Options) -> None:
        ids, table = o.prompt_token_ids, o.prompt_logprobs or []
        entries, tops = [], []
        for p in range(opts.logprob_start_len, len(ids)):
            d = table[p] if p < len(table) else None
            entries.append(self._entry(d.get(ids[p]) if d else None, ids[p]))
            tops.append(self._top(d, opts.top_logprobs_num))
        meta["input_token_logprobs"] = entries
        if opts.top_logprobs_num > 0:
            meta["input_top_logprobs"] = tops


async def generate(server, req: GenerateRequest, request: Request):
    if req.model is not None:
        server.check_model(req.model)
    plan = build_jobs(server, req)
    options, single, n = plan.options, plan.single, plan.jobs[0][1].n
    queue, choices = await server.start(plan.jobs, plan.field)
    fmt = Formatter(server, req, options, n)
    headers = {UNUSED_HEADER: ", ".join(plan.unused)} if plan.unused else None
    progress = [_Progress(name) for name in fmt.names(len(choices))]
    named = {p.name: [c] for p, c in zip(progress, choices)}  # abort by a choice's id, or by its prompt's rid
    named.update({o.name: choices[j * n:(j + 1) * n] for j, o in enumerate(options) if o.name is not None})
    names = list(named)
    server.track(named)
    if req.stream:
        async def events():
            try:
                while any(c.output is None for c in choices):
                    index, delta = await queue.get()
                    c = choices[index]
                    prompt_only = options[index // n].prompt_only
                    if not prompt_only:
                        progress[index].add(delta)
                    if delta.finished:
                        c.output = formats.without_generated(delta.output) if prompt_only else delta.output
                        if (failure := output_failure(c.output, server.shutting_down)) is not None:
                            yield formats.sse(failure.body)  # an error event, then [DONE]
                            break
                    try:
                        item = fmt.item(c, progress[index])
                    except ApiError as e:
                        yield formats.sse(e.body)
                        break
                    if not single:
                        item["index"] = index
                    yield formats.sse(item)
                yield formats.sse("[DONE]")
            finally:  # the client went away (or we are done): unfinished requests stop at the next step
                server.untrack(names)
                server.abort(choices)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    try:
        await server.wait(queue, choices, request)
    finally:
        server.untrack(names)
    for c in choices:
        if options[c.index // n].prompt_only:
            c.output = formats.without_generated(c.output)
    items = [fmt.item(c, p) for c, p in zip(choices, progress)]
    return JSONResponse(items[0] if single and n == 1 else items, headers=headers)


async def _one_token(server) -> None:
    queue, choices = await server.start([([0], SamplingParams(max_new_tokens=1, temperature=0.0))], "input_ids")
    try:
        while choices[0].output is None:
            _, delta = await queue.get()
            if delta.finished:
                choices[0].output = delta.output
        if (failure := output_failure(choices[0].output, True)) is not None:
            raise failure
    finally:
        server.abort(choices)


def install(app: FastAPI, server) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def post_generate(req: GenerateRequest, request: Request):
        return await generate(server, req, request)

    @app.get("/health_generate")
    async def health_generate():
        """SGLang's: 200 once the engine generated one token (within 20 s), else 503."""
        if server.shutting_down or not server.core.accepting:
            return Response(status_code=503)
        try:
            await asyncio.wait_for(_one_token(server), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, ApiError):
            return Response(status_code=503)
        return Response(status_code=200)
