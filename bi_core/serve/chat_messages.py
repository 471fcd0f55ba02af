"""Chat messages and tools as OpenAI's chat API sends them (with vLLM's and DeepSeek's reasoning
fields), and their form for the chat template: an assistant message's tool calls with their
arguments as objects (Qwen3.5's template iterates them), ``developer`` as ``system``, the reasoning
of an earlier turn as ``reasoning_content`` (the name Qwen3.5's template reads)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from bi_core.serve import media

STRICT = ConfigDict(extra="forbid", strict=True)


def _null_only(v, name: str):
    if v is not None:
        raise ValueError(f"only null is supported: {name} is not an input this server reads")
    return v


class FunctionCallParam(BaseModel):
    model_config = STRICT
    name: str
    arguments: str | dict  # OpenAI sends the JSON text; some clients send the object

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, v):
        if isinstance(v, str):
            try:
                v_obj = json.loads(v) if v.strip() else {}
            except ValueError:
                raise ValueError("arguments must be a JSON object's text") from None
            if not isinstance(v_obj, dict):
                raise ValueError("arguments must be a JSON object's text")
        return v

    def arguments_object(self) -> dict:
        if isinstance(self.arguments, dict):
            return self.arguments
        return json.loads(self.arguments) if self.arguments.strip() else {}


class ToolCallParam(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning (DeepSeek's, SGLang's name)
    reasoning: str | None = None  # the same, by vLLM's name
    refusal: str | None = None
    function_call: dict | None = None  # OpenAI's deprecated single call
    audio: dict | None = None
    annotations: list | None = None

    _no_function_call = field_validator("function_call")(lambda cls, v: _null_only(v, "function_call (use tool_calls)"))
    _no_audio = field_validator("audio")(lambda cls, v: _null_only(v, "audio"))
    _no_refusal = field_validator("refusal")(lambda cls, v: _null_only(v, "refusal"))

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        for part in v if isinstance(v, list) else ():
            media.check_part(part)  # text, image_url, video
        return v

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("reasoning_content (reasoning) belongs to assistant messages")
        return self

    def text(self) -> str:
        """The content as text; an image or video part as its placeholders (serve/media.py)."""
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}, ...]
            return "".join(media.part_text(part) for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it: role and content, ``name`` when given
        (templates that know it render it; Qwen's ignores it), tool calls, reasoning."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": c.function.arguments_object()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # OpenAI's strict schema adherence: the grammar engine's; here a hint

    @field_validator("name")
    @classmethod
    def _named(cls, v):
        if not v or any(c.isspace() or c in "<>" for c in v):
            raise ValueError("a function's name must be non-empty, without spaces or angle brackets")
        return v


class ToolParam(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


def check_tools(tools: list | None) -> list[dict] | None:
    """The request's tools, each checked as OpenAI's function tool and kept as sent (the template
    writes each with ``tojson``, so its keys keep the client's order)."""
    if tools is None:
        return None
    names = set()
    for i, tool in enumerate(tools):
        try:
            parsed = ToolParam.model_validate(tool)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"tools[{i}]{'.' + where if where else ''}: {err['msg']} (each tool is "
                             "{\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}})") from None
        if parsed.function.name in names:
            raise ValueError(f"tools[{i}].function.name: {parsed.function.name} names two tools")
        names.add(parsed.function.name)
    return tools


def check_tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str | dict | None:
    """OpenAI's ``tool_choice``: none, auto, required or ``{"type": "function", "function": {"name"}}``
    naming one of the tools; required with an empty tool list is none (as OpenAI and vLLM)."""
    if choice is None or choice in ("none", "auto"):
        return choice
    if choice == "required":
        if tools is None:
            raise ValueError("tool_choice required needs tools")
        return "none" if not tools else choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or set(choice) != {"type", "function"} or not isinstance(fn, dict) \
                or set(fn) != {"name"} or not isinstance(fn["name"], str):
            raise ValueError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if fn["name"] not in {t["function"]["name"] for t in tools or ()}:
            raise ValueError(f"tool_choice names {fn['name']}, which is not among tools")
        return choice
    raise ValueError("tool_choice is none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
