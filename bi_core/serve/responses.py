"""OpenAI's Responses API, its stateless subset: ``POST /v1/responses`` with ``input`` (a string, or
items: messages, ``function_call``, ``function_call_output``, ``reasoning``), ``instructions``,
function ``tools``, ``tool_choice``, ``text.format`` (structured outputs), ``reasoning.effort``
(``"none"``: Qwen3.5's thinking off), sampling fields, ``stream`` (the Responses streaming events,
``responses_stream``). The request becomes the chat request it means (``as_chat``) and runs as one;
the answer's reasoning, text and tool calls become ``reasoning``, ``message`` and ``function_call``
output items (``response_items``). Nothing is stored: ``store: true``, ``previous_response_id`` and
``background`` are a 400 naming the field, as is every field this server does not implement at
another value than its no-op one."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from bi_core.serve.api_errors import ApiError
from bi_core.serve.completions import chat_jobs
from bi_core.serve.openai_protocol import STRICT, ChatCompletionRequest, TextBody, only
from bi_core.serve.response_items import ResponseHead
from bi_core.serve.responses_stream import stream_response, whole_response

if TYPE_CHECKING:
    from fastapi import Request

    from bi_core.serve.server import Server

_NOT_STORED = "this server is stateless: responses are not stored"


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesRequest(TextBody):
    """The Responses API request fields this server takes (stateless)."""

    model_config = STRICT
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict | None = None
    reasoning: dict | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    _no_store = field_validator("store")(only(None, False, why=_NOT_STORED))
    _no_previous = field_validator("previous_response_id")(only(None, why=f"{_NOT_STORED}; send the whole input"))
    _no_background = field_validator("background")(only(None, False, why=_NOT_STORED))
    _no_include = field_validator("include")(only(None, [], why="no extra output data is returned"))
    _no_truncation = field_validator("truncation")(only(None, "disabled", why="input is never truncated"))
    _no_max_calls = field_validator("max_tool_calls")(only(None, why="use parallel_tool_calls: false for one call"))
    _no_top_logprobs = field_validator("top_logprobs")(only(None, 0, why="logprobs are not returned here; use "
                                                                       "/v1/chat/completions"))

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v):
        """Qwen3.5 thinks or does not (its template's ``enable_thinking``): effort ``none`` turns
        thinking off, null leaves it on; no summaries are written."""
        if v is None:
            return v
        if extra := sorted(set(v) - {"effort", "summary", "generate_summary"}):
            raise ValueError(f"unknown field(s) {', '.join(extra)} (effort, summary)")
        if v.get("effort") not in (None, "none"):
            raise ValueError("effort must be null (thinking on) or \"none\" (thinking off): Qwen3.5 has no effort levels")
        if v.get("summary") is not None or v.get("generate_summary") is not None:
            raise ValueError("summary must be null: reasoning is returned whole, never summarized")
        return v

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one means; a field that does not map is a 400 naming it."""
        body: dict[str, Any] = {"model": self.model, "messages": _messages(self.instructions, self.input)}
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        for mine, theirs in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_tokens"),
                             ("temperature", "temperature"), ("top_p", "top_p")):
            if getattr(self, mine) is not None:
                body[theirs] = getattr(self, mine)
        if (self.reasoning or {}).get("effort") == "none":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if (fmt := (self.text or {}).get("format")) is not None:
            body["response_format"] = _format(fmt)
        if self.text and set(self.text) - {"format", "verbosity"} or (self.text or {}).get("verbosity") is not None:
            raise ApiError(400, "text: only format is supported (verbosity null)", param="text")
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ApiError(400, f"{where} (of the chat request the input maps to): {err['msg']}", param=where) from None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: only text content is supported (a string, or input_text / output_text parts)",
                   param=where)


def _messages(instructions: str | None, items: str | list[dict]) -> list[dict]:
    """Input items as chat messages: consecutive ``function_call`` items (and the ``reasoning`` item
    before them) are one assistant message with ``tool_calls``, a ``function_call_output`` a tool
    message."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "reasoning":
            parts = item.get("content") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],
                            **({"reasoning_content": reasoning} if reasoning is not None else {})})
                reasoning = None
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise ApiError(400, f"{where}.type: {kind!r} is not supported (message, function_call, "
                                "function_call_output, reasoning)", param=f"{where}.type")
    return out


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return item[key]


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, str):
        return choice
    raise ApiError(400, "tool_choice is none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _format(fmt: dict) -> dict:
    """``text.format`` as the chat route's ``response_format``."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")
    if fmt["type"] != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


async def create_response(server: Server, req: ResponsesRequest, request: Request):
    """Run the request as its chat request; a Responses API ``response``, or with ``stream: true``
    its stream of events (``responses_stream``)."""
    chat = req.as_chat()
    turn, jobs = chat_jobs(server, chat)
    queue, choices = await server.start(jobs, "input")
    rid = f"resp_{uuid.uuid4().hex}"
    server.track({rid: choices})
    head = ResponseHead(echoed_settings(req), rid, chat.model, int(time.time()))
    if req.stream:
        return stream_response(server, queue, choices, turn, head)
    try:
        await server.wait(queue, choices, request)
    finally:
        server.untrack([rid])
    return whole_response(turn, head, choices[0])


def echoed_settings(req: ResponsesRequest) -> dict:
    """The request's settings as a response object repeats them (OpenAI's field names)."""
    return {"instructions": req.instructions, "metadata": req.metadata or {},
            "tools": [t.model_dump() for t in req.tools or []], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "reasoning": req.reasoning,
            "text": req.text or {"format": {"type": "text"}}, "user": req.user}
