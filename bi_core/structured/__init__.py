"""Structured outputs: what a request's text must match (``StructuredSpec``, the value of
``SamplingParams.structured``), its grammar through xgrammar (``grammars``) and Qwen3.5 tool calls
(``tool_calls``)."""

from __future__ import annotations

from bi_core.structured.specs import KINDS, StructuredSpec, choice, grammar, json_object, json_schema, regex
from bi_core.structured.tool_calls import tool_call_spec

__all__ = ["KINDS", "StructuredSpec", "choice", "grammar", "json_object", "json_schema", "regex", "tool_call_spec"]
