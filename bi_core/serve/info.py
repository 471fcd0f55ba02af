"""Routes clients probe before (or beside) generating, with vLLM's shapes (SGLang's are the same):

- ``GET /v1/models`` and ``GET /v1/models/{id}`` (OpenAI's model objects; an unknown id is a 404
  ``model_not_found``), ``GET /version`` -> ``{"version"}``.
- ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (the chat template, ending in
  the assistant's turn) -> ``{"count", "max_model_len", "tokens", "token_strs": null}``: the ids
  the completion and chat routes run. ``add_special_tokens`` takes either value: this server never
  adds special tokens to a prompt (Qwen3.5's tokenizer adds none either way).
- ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": str}`` (the plain decode).

``model`` is optional in both; given, it must name this server's model."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field, field_validator

from bi_core import __version__
from bi_core.errors import CheckpointError
from bi_core.serve.api_errors import ApiError
from bi_core.serve.completions import encode
from bi_core.serve.openai_protocol import STRICT, ChatMessage, TextBody, only


class TokenizeRequest(TextBody):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``: ``prompt`` or ``messages``."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False

    _generation_prompt = field_validator("add_generation_prompt")(only(
        True, why="the chat template always ends with the assistant's turn"))
    _no_continue = field_validator("continue_final_message")(only(
        False, why="continuing the final assistant message is not supported"))
    _no_token_strs = field_validator("return_token_strs")(only(
        None, False, why="token strings are not returned (POST /detokenize decodes ids)"))


class DetokenizeRequest(TextBody):
    """vLLM's ``DetokenizeRequest``."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]


REQUEST_MODELS = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


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
    try:
        ids, _ = server.tokenizer.chat([m.as_template_message() for m in req.messages])
    except (ValueError, CheckpointError) as e:
        raise ApiError(400, str(e), param="messages") from None
    return ids


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
