"""Constrained tool calls: ``tool_choice`` "required" or a named function as a ``StructuredSpec``
(kind ``tool_call``) whose grammar is Qwen3.5's XML tool-call format::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

each VALUE typed by the function's JSON schema (a string's raw text, other types as JSON), as
xgrammar's ``qwen_3_5`` structural tag builds it. Whitespace may surround each tag and value, so
a parser strips it from a value (the model writes one newline on each side). "required" takes
one call (or more, with ``parallel_tool_calls``) of any of the tools; a named function exactly
that one; nothing else is written between or after the calls (xgrammar's own "required"
lets free text surround them), calls separated by a newline. ``reasoning`` says how the output starts: "disabled" with the call, "enabled" inside a
thinking block the prompt opened (free text up to ``</think>``, then a blank line), "auto" with an
optional ``<think>...</think>`` block."""

from __future__ import annotations

import json
from typing import Any

from bi_core.errors import RequestError
from bi_core.structured.specs import StructuredSpec

REASONING = ("disabled", "enabled", "auto")


def _fail(message: str) -> None:
    raise RequestError(f"tool_choice: {message}")


def _function(tool: Any, i: int) -> dict:
    """A tool's function as the grammar reads it: name, parameters and strict (its description
    changes no grammar, so it stays out of the cache key)."""
    if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(tool.get("function"), dict)):
        _fail(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not (isinstance(name, str) and name):
        _fail(f"tools[{i}].function.name must be a non-empty string, got {name!r}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, (dict, bool)):
        _fail(f"tools[{i}].function.parameters must be a JSON schema (an object), got {type(params).__name__}")
    out = {"name": name, "parameters": params}
    if "strict" in fn and fn["strict"] is not None:
        out["strict"] = fn["strict"]
    return out


def named_function(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` names, or None for a string choice."""
    if isinstance(tool_choice, str):
        return None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        _fail("must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
              f"got {tool_choice!r}")
    return name


def tool_call_spec(tools: list[dict], tool_choice: Any, *, parallel_tool_calls: bool = True,
                   reasoning: str = "disabled") -> StructuredSpec | None:
    """The constraint of ``tool_choice`` over OpenAI-style ``tools``: None for "none" and "auto"
    (nothing is enforced), a ``tool_call`` spec for "required" and a named function."""
    if tool_choice in ("none", "auto"):
        return None
    name = named_function(tool_choice)
    if name is None and tool_choice != "required":
        _fail(f"must be \"none\", \"auto\", \"required\" or a named function, got {tool_choice!r}")
    if reasoning not in REASONING:
        _fail(f"reasoning must be one of {', '.join(REASONING)}, got {reasoning!r}")
    if not isinstance(tools, list) or not tools:
        _fail(f"{tool_choice!r} needs tools (a non-empty list)")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if name is not None:
        if name not in names:
            _fail(f"names function {name!r}, which is not among the tools ({', '.join(names)})")
        functions = [f for f in functions if f["name"] == name]
    value = {"tools": [{"type": "function", "function": f} for f in functions],
             "tool_choice": "required" if name is None else {"type": "function", "function": {"name": name}},
             "parallel_tool_calls": bool(parallel_tool_calls) and name is None, "reasoning": reasoning}
    return StructuredSpec(kind="tool_call", value=json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def structural_tag(xgr, value: str):
    """The xgrammar structural tag of a ``tool_call`` spec's value: xgrammar's ``qwen_3_5`` tags
    (each call's begin, typed parameters and end, the reasoning prefix), the calls alone."""
    from xgrammar import structural_tag as st

    spec = json.loads(value)
    tag = xgr.get_model_structural_tag("qwen_3_5", tools=spec["tools"], tool_choice=spec["tool_choice"],
                                       reasoning=spec["reasoning"], parallel_tool_calls=spec["parallel_tool_calls"])
    fmt = tag.format
    elements = list(fmt.elements) if isinstance(fmt, st.SequenceFormat) else [fmt]  # [reasoning prefix,] calls
    if isinstance(elements[-1], st.TriggeredTagsFormat):  # "required": one call or more, nothing around them
        elements[-1] = st.TagsWithSeparatorFormat(tags=elements[-1].tags, separator="\n", at_least_one=True,
                                                  stop_after_first=not spec["parallel_tool_calls"])
    return st.StructuralTag(format=elements[0] if len(elements) == 1 else st.SequenceFormat(elements=elements))
