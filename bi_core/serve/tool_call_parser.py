"""Qwen3.5's tool calls: the XML blocks its chat template teaches the model to write,

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

parsed into OpenAI's tool calls (``{"id", "type": "function", "function": {"name", "arguments"}}``,
``arguments`` a JSON object's text). A value is typed by the tool's JSON schema for that parameter:
plain strings stay the raw text (one newline on each side dropped, as the template writes it),
integers, numbers, booleans and null are parsed, objects and arrays are JSON (the template writes
non-strings with ``tojson``), an enum's member is the one named; a value that does not parse as its
type stays a string, and a parameter the schema does not name is a string (vLLM's qwen3_coder
parser does the same). A block that is not one well-formed call of a tool the request offered is not a
call: ``parse_block`` says why, and the text stays content.

This reads what ``bi_core.structured.tool_calls`` (the grammar of ``tool_choice`` required or
named) lets a model write: the same tags, with whitespace around tags and around every value but a
plain string's (``_raw_text``), which is therefore stripped."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import attrs

log = logging.getLogger(__name__)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class MalformedToolCall(ValueError):
    """A ``<tool_call>`` block that is not a call; the message says what is wrong with it."""


@attrs.frozen
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of its typed parameters."""

    name: str
    arguments: str
    id: str = attrs.field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_parameters(tools: list[dict] | None) -> dict[str, dict]:
    """Each offered function's name -> its parameters' JSON schema (``{}`` when it gives none)."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", {})
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def parse_block(body: str, tools: dict[str, dict]) -> ToolCall:
    """The call in a block's body (the text between ``<tool_call>`` and ``</tool_call>``)."""
    text = body.strip()
    if not text.startswith(FUNCTION_OPEN):
        raise MalformedToolCall(f"the block does not start with {FUNCTION_OPEN}NAME>")
    name_end = text.find(">")
    name = text[len(FUNCTION_OPEN):name_end] if name_end > 0 else ""
    if not name or "\n" in name:
        raise MalformedToolCall("the block's <function=...> tag has no name")
    if not text.endswith(FUNCTION_CLOSE):
        raise MalformedToolCall(f"the call to {name} does not end with {FUNCTION_CLOSE}")
    if name not in tools:
        raise MalformedToolCall(f"it calls {name}, which is not among the request's tools ({', '.join(tools)})")
    raw = _parameters(text[name_end + 1:-len(FUNCTION_CLOSE)], name)
    schema = tools[name].get("properties") or {}
    args = {key: typed_value(value, schema.get(key), key, name) for key, value in raw.items()}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _parameters(inner: str, function: str) -> dict[str, str]:
    """``<parameter=P>\\nVALUE\\n</parameter>`` blocks in order. A value ends at the first
    ``</parameter>`` followed by another parameter or the end, so a value may hold the tag itself."""
    out: dict[str, str] = {}
    pos = 0
    while (start := _skip_space(inner, pos)) < len(inner):
        if not inner.startswith(PARAMETER_OPEN, start):
            raise MalformedToolCall(f"the call to {function} has text outside its <parameter=...> blocks: "
                                    f"{inner[start:start + 40]!r}")
        name_end = inner.find(">", start)
        key = inner[start + len(PARAMETER_OPEN):name_end] if name_end > 0 else ""
        if not key or "\n" in key:
            raise MalformedToolCall(f"a <parameter=...> tag of the call to {function} has no name")
        if key in out:
            raise MalformedToolCall(f"the call to {function} gives parameter {key} twice")
        end = _value_end(inner, name_end + 1)
        if end < 0:
            raise MalformedToolCall(f"parameter {key} of the call to {function} has no {PARAMETER_CLOSE}")
        value = inner[name_end + 1:end]
        value = value[1:] if value.startswith("\n") else value  # the template writes "\n" around a value
        out[key] = value[:-1] if value.endswith("\n") else value
        pos = end + len(PARAMETER_CLOSE)
    return out


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _value_end(inner: str, start: int) -> int:
    end = inner.find(PARAMETER_CLOSE, start)
    while end >= 0:
        rest = inner[_skip_space(inner, end + len(PARAMETER_CLOSE)):]
        if not rest or rest.startswith(PARAMETER_OPEN):
            return end
        end = inner.find(PARAMETER_CLOSE, end + 1)
    return -1


def _schema_types(schema: dict | None) -> list[str]:
    """The JSON types a parameter's schema allows, in its order (``type``, a list of types, or the
    members of ``anyOf`` / ``oneOf``)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [k for member in schema.get("anyOf") or schema.get("oneOf") or [] for k in _schema_types(member)]


_JSON_TYPES = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list,)}


def _raw_text(schema: dict | None, kind: str | None) -> bool:
    """Whether a value is its raw text: a plain string (no enum, const, pattern, length or format),
    or a parameter the schema does not describe. The grammar writes those as any text up to
    ``</parameter>``; every other value it lets whitespace surround, which is not the value."""
    if not schema:
        return True
    return kind == "string" and not set(schema) & _STRING_CONSTRAINTS


_STRING_CONSTRAINTS = {"enum", "const", "pattern", "minLength", "maxLength", "format"}


def _member(text: str, schema: dict) -> tuple[bool, Any]:
    """An ``enum`` / ``const`` member the text names: a string member as its text, another as JSON."""
    members = schema.get("enum", [schema["const"]] if "const" in schema else [])
    if text in members:
        return True, text
    try:
        value = json.loads(text)
    except ValueError:
        return False, None
    return any(value == m and type(value) is type(m) for m in members), value


def typed_value(raw: str, schema: dict | None, key: str, function: str) -> Any:
    """A parameter's value as its schema's type: the first type it allows besides null decides
    (a plain string stays the text); ``null`` is None where the schema allows null; an ``enum`` or
    ``const`` without a type is the member named."""
    types = _schema_types(schema)
    if "null" in types and raw.strip() == "null":
        return None
    kind = next((t for t in types if t != "null"), None)
    if _raw_text(schema, kind):
        return raw
    text = raw.strip()
    if kind in (None, "string"):
        found, value = _member(text, schema or {})
        return value if found else text
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in _JSON_TYPES:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, _JSON_TYPES[kind]) and not isinstance(value, bool):
            return value
    log.warning("tool call %s: parameter %s is not a JSON %s (%r); it stays a string", function, key, kind,
                raw[:80])
    return raw
