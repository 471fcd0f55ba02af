"""Routes clients probe before (or beside) generating, with vLLM's shapes (SGLang's are the same):

- ``GET /v1/models`` and ``GET /v1/models/{id}`` (OpenAI's model objects; an unknown id is a 404
  ``model_not_found``), ``GET /version`` -> ``{"version"}``.
- ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (the chat template, with
  ``tools``, ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message`` as
  the chat route takes them) -> ``{"count", "max_model_len", "tokens", "token_strs": null}``: the
  ids the completion and chat routes run. ``add_special_tokens`` takes either value: this server
  never adds special tokens to a prompt (Qwen3.5's tokenizer adds none either way).
- ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": str}`` (the plain decode).
- ``POST /v1/chat/completions/render`` (vLLM's): a chat request, checked as the chat route checks
  it, is not run but answered as the token-in request it would be: ``{"request_id", "token_ids",
  "features": null, "sampling_params", "model", "stream", "stream_options", "cache_salt": null,
  "priority": 0, "kv_transfer_params": null}``; ``sampling_params`` by vLLM's names.

``model`` is optional in both; given, it must name this server's model."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from pydantic import Field, field_validator

from bi_core import __version__
from bi_core.errors import CheckpointError
from bi_core.models.chat_template import ChatTemplateError
from bi_core.runtime.sequence import SamplingParams
from bi_core.serve.api_errors import ApiError
from bi_core.serve.chat_messages import check_tools
from bi_core.serve.completions import chat_jobs, encode
from bi_core.serve.openai_protocol import STRICT, ChatCompletionRequest, ChatMessage, TextBody, only


class TokenizeRequest(TextBody):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``: ``prompt`` or ``messages``."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False

    _checked_tools = field_validator("tools")(lambda cls, v: check_tools(v))
    _no_token_strs = field_validator("return_token_strs")(only(
        None, False, why="token strings are not returned (POST /detokenize decodes ids)"))


class DetokenizeRequest(TextBody):
    """vLLM's ``DetokenizeRequest``."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]


REQUEST_MODELS = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
                  "/v1/chat/completions/render": ChatCompletionRequest}


def model_card(server, name: str | None = None) -> dict:
    """vLLM's card: the base model's, or (``name``) a LoRA adapter's, whose ``parent`` is the base model."""
    card = {"id": name or server.model_name, "object": "model", "created": server.created, "owned_by": "bi-engine",
            "max_model_len": server.max_model_len}
    if name is not None:
        card["parent"] = server.model_name
    return card


def tokenize(server, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt" if req.prompt else "messages")
    if server.tokenizer is None:
        raise ApiError(400, "this checkpoint has no tokenizer", param="prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        return encode(server, req.prompt) if req.prompt else []
    agp = req.add_generation_prompt and not (req.continue_final_message
                                             and "add_generation_prompt" not in req.model_fields_set)
    try:
        return server.tokenizer.chat([m.as_template_message() for m in req.messages], tools=req.tools,
                                     add_generation_prompt=agp, continue_final_message=req.continue_final_message,
                                     template_kwargs=req.chat_template_kwargs or {}).ids
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param=e.param) from None
    except CheckpointError as e:
        raise ApiError(400, str(e), param="messages") from None


def vllm_sampling_params(p: SamplingParams) -> dict:
    """A request's sampling parameters by vLLM's names (its SamplingParams' fields)."""
    return {"n": p.n, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "seed": p.seed, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.ignore_eos, "max_tokens": p.max_new_tokens, "min_tokens": p.min_tokens,
            "logprobs": p.logprobs, "prompt_logprobs": p.prompt_logprobs,
            "include_stop_str_in_output": p.include_stop_str_in_output, "skip_special_tokens": p.skip_special_tokens,
            "spaces_between_special_tokens": p.spaces_between_special_tokens}


def install(app: FastAPI, server) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server)] + [model_card(server, n)
                                                                  for n in sorted(server.lora_names)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(server, server.check_model(model_id))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def post_tokenize(req: TokenizeRequest):
        if req.model is not None:
            server.check_model(req.model)
        ids = tokenize(server, req)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest):
        _, jobs = chat_jobs(server, req)
        ids, params = jobs[0][:2]  # (a third item: the decoded images, not rendered)
        return {"request_id": uuid.uuid4().hex, "token_ids": ids, "features": None,
                "sampling_params": vllm_sampling_params(params), "model": server.model_name, "stream": req.stream,
                "stream_options": req.stream_options.model_dump() if req.stream_options else None,
                "cache_salt": None, "priority": 0, "kv_transfer_params": None}

    @app.post("/detokenize")
    async def post_detokenize(req: DetokenizeRequest):
        if req.model is not None:
            server.check_model(req.model)
        if server.tokenizer is None:
            raise ApiError(400, "this checkpoint has no tokenizer", param="tokens")
        bad = [t for t in req.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise ApiError(400, f"tokens has ids outside the vocabulary [0, {server.vocab_size}): {bad[:5]}",
                           param="tokens")
        return {"prompt": server.tokenizer.decode(req.tokens)}
