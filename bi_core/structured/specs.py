"""What a structured-output request's text must match (``SamplingParams.structured``): a frozen
``StructuredSpec`` of a kind and its value as text, which is also the cache key of its compiled
grammar. Building one checks its shape only; the grammar itself is checked where it is compiled
(``bi_core.structured.grammars``), which needs the optional package ``xgrammar``."""

from __future__ import annotations

import json
from typing import Any

import attrs

from bi_core.errors import RequestError

# json_schema: a JSON schema; json_object: any JSON object; regex: a regular expression; choice:
# exactly one of some strings; grammar: an EBNF (xgrammar's GBNF dialect) or Lark grammar;
# tool_call: Qwen3.5 XML tool calls of given tools (bi_core.structured.tool_calls)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")


def _fail(message: str) -> None:
    raise RequestError(f"structured outputs: {message}")


def _json_text(value: Any, what: str) -> str:
    """``value`` (a JSON text, or what parses from one) as compact JSON, key order kept (a
    schema's property order is the order its output writes them)."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            _fail(f"{what} is not valid JSON: {e}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        _fail(f"{what} cannot be written as JSON: {e}")
    raise AssertionError  # unreachable: _fail raises


def _parsed(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


@attrs.frozen(kw_only=True)
class StructuredSpec:
    """A structured-output constraint: ``kind`` (one of ``KINDS``) and ``value``, its text (the
    schema as compact JSON, the pattern, the choices as a JSON list, the grammar, the tool-call
    spec as JSON; empty for json_object). ``any_whitespace``: JSON kinds may put whitespace
    between tokens (vLLM's default); False: compact JSON, no whitespace."""

    kind: str
    value: str = ""
    any_whitespace: bool = True

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            _fail(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            _fail(f"{self.kind}: value must be text, got {type(self.value).__name__}")
        if not isinstance(self.any_whitespace, bool):
            _fail(f"any_whitespace must be true or false, got {self.any_whitespace!r}")
        if self.kind == "json_object" and self.value:
            _fail("json_object takes no value")
        if self.kind in ("regex", "grammar", "tool_call") and not self.value:
            _fail(f"{self.kind} is empty")
        if self.kind == "json_schema":
            parsed = _parsed(self.value)
            if not isinstance(parsed, (dict, bool)):
                _fail(f"a JSON schema must be an object (or true/false), got {self.value[:80] or 'nothing'}")
        if self.kind == "choice":
            parsed = _parsed(self.value)
            if not (isinstance(parsed, list) and parsed and all(isinstance(c, str) and c for c in parsed)):
                _fail(f"choice must be a non-empty list of non-empty strings, got {self.value[:80] or 'nothing'}")


def json_schema(schema: Any, *, any_whitespace: bool = True) -> StructuredSpec:
    """Output valid against ``schema`` (a dict, or its JSON text). Properties come in the
    schema's order, and only those the schema declares (``additionalProperties`` false unless the
    schema allows more: xgrammar's strict mode, as vLLM serves it)."""
    return StructuredSpec(kind="json_schema", value=_json_text(schema, "the JSON schema"),
                          any_whitespace=any_whitespace)


def json_object(*, any_whitespace: bool = True) -> StructuredSpec:
    """Output a JSON object (any keys and values): OpenAI's ``json_object`` response format."""
    return StructuredSpec(kind="json_object", any_whitespace=any_whitespace)


def regex(pattern: str) -> StructuredSpec:
    """Output matching ``pattern`` as a whole."""
    if not isinstance(pattern, str):
        _fail(f"regex must be a string, got {type(pattern).__name__}")
    return StructuredSpec(kind="regex", value=pattern)


def choice(options: list[str]) -> StructuredSpec:
    """Output exactly one of ``options``."""
    if isinstance(options, str) or not isinstance(options, (list, tuple)):
        _fail(f"choice must be a list of strings, got {type(options).__name__}")
    return StructuredSpec(kind="choice", value=_json_text(list(options), "choice"))


def grammar(text: str) -> StructuredSpec:
    """Output of a grammar: EBNF in xgrammar's dialect (``root ::= ...``, GBNF, what SGLang's
    ``ebnf`` takes), or Lark when no line defines a rule with ``::=`` (vLLM's rule)."""
    if not isinstance(text, str):
        _fail(f"grammar must be a string, got {type(text).__name__}")
    return StructuredSpec(kind="grammar", value=text)


def choice_grammar(options: list[str]) -> str:
    """The EBNF of ``choice``: each option a literal, escaped as JSON escapes it (xgrammar's EBNF
    reads the same escapes: quotes, backslashes, control characters)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def is_lark(text: str) -> bool:
    """Whether a grammar is Lark rather than EBNF: no line (comments aside) defines a rule with ``::=``."""
    for line in text.splitlines():
        line = line.split("//")[0].split("#")[0].strip()
        if "::=" in line:
            return False
    return True
