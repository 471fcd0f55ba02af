"""Structured outputs through the HTTP routes: OpenAI's response_format (json_object, json_schema),
vLLM's structured_outputs and guided_*, SGLang's json_schema / regex / ebnf map to the engine's
StructuredSpec; a bad schema, pattern or grammar, two constraints at once, or an option xgrammar
does not take are one 400 naming the field; and served requests come back valid."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serve_helpers import API_KEY

from bi_core.serve.api_errors import ApiError
from bi_core.serve.native_protocol import GenerateSamplingParams
from bi_core.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from bi_core.serve.structured_fields import sglang_spec
from bi_core.structured import choice, grammar, json_object, json_schema, regex

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["v", "w"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}, "required": ["k", "n"]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": [1, 2]}


def spec_of(body: dict, chat: bool = True):
    model = ChatCompletionRequest if chat else CompletionRequest
    return model.model_validate({**(CHAT if chat else COMPLETION), **body}).sampling_params(8, None).structured


@pytest.mark.parametrize("chat", [True, False])
def test_fields_map_to_the_engines_spec(chat):
    cases = [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, json_object()),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         json_schema(SCHEMA)),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, json_schema(SCHEMA, any_whitespace=False)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "[ab]+"}}, regex("[ab]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, choice(["yes", "no"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, grammar('root ::= "a"')),
        ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}}, json_object()),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, json_schema(SCHEMA)),
        ({"guided_regex": "[ab]+"}, regex("[ab]+")),
        ({"guided_choice": ["yes", "no"]}, choice(["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, grammar('root ::= "a"')),
    ]
    for body, want in cases:
        assert spec_of(body, chat) == want, body


def test_sglang_sampling_params_map_to_the_engines_spec():
    for field, value, want in [("json_schema", json.dumps(SCHEMA), json_schema(SCHEMA)),
                               ("regex", "[ab]+", regex("[ab]+")), ("ebnf", 'root ::= "a"', grammar('root ::= "a"'))]:
        assert sglang_spec(GenerateSamplingParams.model_validate({field: value}), "sampling_params") == want
    assert sglang_spec(GenerateSamplingParams.model_validate({}), "sampling_params") is None
    with pytest.raises(ApiError, match="only one of json_schema, regex, ebnf can be set"):
        sglang_spec(GenerateSamplingParams.model_validate({"regex": "a", "ebnf": 'root ::= "a"'}), "sampling_params")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "does not compile: Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "name must be a non-empty string"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "unknown field"),
    ({"guided_regex": "[a-"}, "guided_regex", "the regex does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "the grammar does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured-output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern",
     "only null"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown field"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "min_tokens must be 0"),
])
def test_bad_structured_fields_are_one_400_naming_the_field(body, param, message):
    with pytest.raises(ApiError) as e:
        spec_of(body)
    assert e.value.status == 400 and e.value.body["error"]["param"] == param and message in str(e.value), str(e.value)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=120)


def test_served_requests_follow_their_constraint(server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "kv", "schema": SCHEMA}}
    r = post(server, "/v1/chat/completions", {**CHAT, "response_format": schema_format, "max_tokens": 200,
                                              "temperature": 1.0, "seed": 2})
    assert r.status_code == 200, r.text
    choice_ = r.json()["choices"][0]
    assert choice_["finish_reason"] == "stop" and set(json.loads(choice_["message"]["content"])) == {"k", "n"}
    r = post(server, "/v1/completions", {**COMPLETION, "guided_regex": "[a-c]{3}-[0-9]", "max_tokens": 20,
                                         "temperature": 1.0, "seed": 4, "logprobs": 2, "masked_logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert re.fullmatch("[a-c]{3}-[0-9]", body["text"]) and body["finish_reason"] == "stop"
    assert all(set(top) <= set("abc") for top in body["logprobs"]["top_logprobs"][:3])  # the masked distribution
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"ebnf": 'root ::= "x" [0-9]',
                                                                           "max_new_tokens": 10}})
    assert r.status_code == 200 and re.fullmatch("x[0-9]", r.json()["text"]), r.text
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"json_schema": '{"type": "nope"}'}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.json_schema", r.text


def test_tool_choice_required_or_named_gives_the_tool_call_grammar():
    from bi_core.serve.structured_fields import tool_choice_spec
    from bi_core.structured import tool_call_spec

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}]
    assert tool_choice_spec(None, tools, "required") == tool_call_spec(tools, "required", parallel_tool_calls=True)
    named = {"type": "function", "function": {"name": "f"}}
    assert tool_choice_spec(None, tools, named, parallel_tool_calls=False) == tool_call_spec(tools, named)
    for choice_ in ("auto", "none", None):
        assert tool_choice_spec(regex("a"), tools, choice_) == regex("a")
    for spec, bad, message in [(json_object(), "required", "cannot be combined with response_format"),
                               (None, {"type": "function", "function": {"name": "g"}}, "not among the tools"),
                               (None, "sometimes", "must be \"none\", \"auto\", \"required\"")]:
        with pytest.raises(ApiError, match=message) as e:
            tool_choice_spec(spec, tools, bad)
        assert e.value.body["error"]["param"] == "tool_choice"
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(ApiError, match="does not compile") as e:
        tool_choice_spec(None, bad_schema, "required")
    assert e.value.body["error"]["param"] == "tools"
