"""Structured outputs through the HTTP routes, as one ``StructuredSpec`` a request: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``) and its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, SGLang's ``json_schema`` / ``regex`` /
``ebnf`` sampling params. At most one constraint a request. Its grammar is compiled here first
(without the vocabulary), so a bad schema, pattern or grammar is one 400 naming its field."""

from __future__ import annotations

from typing import Any

from bi_core.errors import RequestError
from bi_core.serve.api_errors import ApiError
from bi_core.structured import specs
from bi_core.structured.specs import StructuredSpec
from bi_core.structured.tool_calls import tool_call_spec

FORMAT_TYPES = ("text", "json_object", "json_schema")
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's options beside the constraint: disable_additional_properties only changes vLLM's guidance
# backend (xgrammar, which serves here, already allows only the properties a schema declares);
# disable_fallback only picks between vLLM's backends
VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = (None, "auto", "xgrammar")  # the values of guided_decoding_backend that change nothing here


def _built(param: str, build, *args, **kwargs) -> StructuredSpec:
    try:
        return build(*args, **kwargs)
    except RequestError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None


def checked(spec: StructuredSpec | None, param: str) -> StructuredSpec | None:
    """``spec`` once its grammar compiled (one 400 naming ``param`` if not, or if xgrammar is missing)."""
    if spec is None:
        return None
    from bi_core.structured.grammars import check

    try:
        check(spec)
    except RequestError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return spec


def response_format_spec(fmt: dict | None, param: str = "response_format") -> tuple[StructuredSpec, str] | None:
    """OpenAI's ``response_format``: text (nothing enforced), json_object, or json_schema with its
    ``json_schema: {name, schema, strict, description}``; the schema is enforced whatever
    ``strict`` says (as vLLM does). (The spec, the field its grammar comes from), or None."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise ApiError(400, f"{param}.type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}"
                       + (" (structural tags are not supported)" if kind == "structural_tag" else ""),
                       param=f"{param}.type")
    allowed = {"type"} | ({"json_schema"} if kind == "json_schema" else set())
    if extra := sorted(set(fmt) - allowed):
        raise ApiError(400, f"{param}: unknown field(s) {', '.join(extra)} for type {kind}", param=f"{param}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return specs.json_object(), param
    inner = fmt.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(inner, dict):
        raise ApiError(400, f"{where} must be an object {{\"name\": ..., \"schema\": {{...}}}}", param=where)
    if extra := sorted(set(inner) - {"name", "schema", "strict", "description"}):
        raise ApiError(400, f"{where}: unknown field(s) {', '.join(extra)} (name, schema, strict, description)",
                       param=f"{where}.{extra[0]}")
    if not isinstance(inner.get("name"), str) or not inner["name"]:
        raise ApiError(400, f"{where}.name must be a non-empty string", param=f"{where}.name")
    if inner.get("strict") not in (None, True, False):
        raise ApiError(400, f"{where}.strict must be true, false or null", param=f"{where}.strict")
    if "schema" not in inner:
        raise ApiError(400, f"{where}.schema: the JSON schema is missing", param=f"{where}.schema")
    return _built(f"{where}.schema", specs.json_schema, inner["schema"]), f"{where}.schema"


def _vllm_one(kind: str, value: Any, ws: bool, param: str) -> StructuredSpec:
    if kind == "json":
        if not isinstance(value, (str, dict)):
            raise ApiError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param)
        return _built(param, specs.json_schema, value, any_whitespace=ws)
    if kind == "json_object":
        if value is not True:
            raise ApiError(400, f"{param} must be true (or left out)", param=param)
        return specs.json_object(any_whitespace=ws)
    if kind == "structural_tag":
        raise ApiError(400, f"{param}: structural tags are not supported (json, regex, choice, grammar, json_object "
                            "are)", param=param)
    if kind == "choice":
        if not isinstance(value, list):
            raise ApiError(400, f"{param} must be a list of strings", param=param)
        return _built(param, specs.choice, value)
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string", param=param)
    return _built(param, specs.regex if kind == "regex" else specs.grammar, value)


def structured_outputs_spec(so: dict | None, param: str = "structured_outputs") -> tuple[StructuredSpec, str] | None:
    """vLLM's ``structured_outputs``: exactly one of ``VLLM_KINDS``, and its options. (The spec,
    its field), or None."""
    if so is None:
        return None
    if extra := sorted(set(so) - set(VLLM_KINDS) - set(VLLM_OPTIONS)):
        raise ApiError(400, f"{param}: unknown field(s) {', '.join(extra)}; the constraints are "
                            f"{', '.join(VLLM_KINDS)}, the options {', '.join(VLLM_OPTIONS)}", param=f"{param}.{extra[0]}")
    if so.get("whitespace_pattern") is not None:
        raise ApiError(400, f"{param}.whitespace_pattern: only null is supported (xgrammar takes no whitespace "
                            "pattern; disable_any_whitespace gives compact JSON)", param=f"{param}.whitespace_pattern")
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(so.get(name, False), bool):
            raise ApiError(400, f"{param}.{name} must be true or false", param=f"{param}.{name}")
    given = [k for k in VLLM_KINDS if so.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, f"{param}: give exactly one of {', '.join(VLLM_KINDS)}, got "
                            f"{', '.join(given) if given else 'none'}", param=param)
    kind = given[0]
    return _vllm_one(kind, so[kind], not so.get("disable_any_whitespace", False), f"{param}.{kind}"), f"{param}.{kind}"


def guided_spec(req) -> tuple[StructuredSpec, str] | None:
    """vLLM's older ``guided_*`` fields: (the spec, the field it came from), or None."""
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in BACKENDS:
        raise ApiError(400, f"guided_decoding_backend: only null, \"auto\" or \"xgrammar\" is supported (structured "
                            f"outputs run on xgrammar here), got {backend!r}", param="guided_decoding_backend")
    if getattr(req, "guided_whitespace_pattern", None) is not None:
        raise ApiError(400, "guided_whitespace_pattern: only null is supported (xgrammar takes no whitespace "
                            "pattern)", param="guided_whitespace_pattern")
    given = [name for name in GUIDED_FIELDS if getattr(req, name, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give at most one of {', '.join(GUIDED_FIELDS)}, got {', '.join(given)}", param=given[1])
    name = given[0]
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}[name]
    return _vllm_one(kind, getattr(req, name), True, name), name


def request_spec(req) -> StructuredSpec | None:
    """The structured output an OpenAI-route request asks for (at most one way), compiled once
    here to check it; None when it asks for none."""
    found = [f for f in (response_format_spec(getattr(req, "response_format", None)),
                         structured_outputs_spec(getattr(req, "structured_outputs", None)), guided_spec(req))
             if f is not None]
    if len(found) > 1:
        raise ApiError(400, f"a request takes one structured-output constraint; it gives {found[0][1]} and "
                            f"{found[1][1]}", param=found[1][1])
    return checked(*found[0]) if found else None


def tool_choice_spec(spec: StructuredSpec | None, tools: list | None, tool_choice, *,
                     parallel_tool_calls: bool | None = None, reasoning: str = "disabled") -> StructuredSpec | None:
    """A chat request's structured output once its ``tool_choice`` counts: "required" or a named
    function give their Qwen3.5 tool-call grammar (``tool_call_spec``; one 400 if the request also
    asks for a response format or a guided output), "none", "auto" and null keep ``spec``."""
    try:
        calls = tool_call_spec(tools or [], "auto" if tool_choice is None else tool_choice,
                               parallel_tool_calls=parallel_tool_calls is not False, reasoning=reasoning)
    except RequestError as e:
        raise ApiError(400, str(e), param="tool_choice") from None
    if calls is None:
        return spec
    if spec is not None:
        raise ApiError(400, "tool_choice \"required\" or a named function constrains the output to tool calls: it "
                            "cannot be combined with response_format or a guided output", param="tool_choice")
    return checked(calls, "tools")


def sglang_spec(sp, where: str) -> StructuredSpec | None:
    """SGLang's ``json_schema`` (a JSON schema's text), ``regex`` and ``ebnf`` sampling params (one
    at most, as SGLang takes them)."""
    given = [name for name in ("json_schema", "regex", "ebnf") if getattr(sp, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"{where}: only one of json_schema, regex, ebnf can be set, got {', '.join(given)}",
                       param=f"{where}.{given[1]}")
    name = given[0]
    build = {"json_schema": specs.json_schema, "regex": specs.regex, "ebnf": specs.grammar}[name]
    return checked(_built(f"{where}.{name}", build, getattr(sp, name)), f"{where}.{name}")
