"""What clients probe and what they may get wrong: ``/v1/models/{id}``, ``/tokenize`` and
``/detokenize`` (vLLM's shapes), ``/version``, ``/ping``; a lone surrogate in a prompt (a clear 400
naming the field, on a connection that stays usable); parameters at their no-op values accepted,
at any other value one clear 400."""

from __future__ import annotations

import json

import httpx
import pytest
from replay import send

SURROGATE = "\ud800"  # a UTF-16 half: json.dumps writes it as the escape "\ud800"


def test_model_by_id(client_server):
    r = send(client_server, ("GET", "/v1/models/tiny", None))
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model", r.text
    assert r.json() == send(client_server, ("GET", "/v1/models", None)).json()["data"][0]
    missing = send(client_server, ("GET", "/v1/models/org/other", None))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text


def test_version_and_ping(client_server):
    from bi_core import __version__

    assert send(client_server, ("GET", "/version", None)).json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = send(client_server, (method, "/ping", None))
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def test_tokenize_a_prompt_and_a_chat_as_the_generation_routes_do(client_server):
    r = send(client_server, ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}))
    assert r.json() == {"count": 2, "max_model_len": 512, "tokens": [104, 105], "token_strs": None}, r.text
    messages = [{"role": "user", "content": "hi"}]
    chat = send(client_server, ("POST", "/tokenize", {"messages": messages}))
    assert chat.status_code == 200, chat.text
    done = send(client_server, ("POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1}))
    assert chat.json()["count"] == done.json()["usage"]["prompt_tokens"] == len(chat.json()["tokens"])
    back = send(client_server, ("POST", "/detokenize", {"model": "tiny", "tokens": chat.json()["tokens"]}))
    assert back.status_code == 200 and back.json()["prompt"].endswith("assistant\n<think>\n"), back.text


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"nope": 1}},
     "chat_template_kwargs.nope"),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ("/detokenize", {"tokens": [100000]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_errors_name_the_field(client_server, path, body, param):
    r = send(client_server, ("POST", path, body))
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "tiny", "prompt": f"a{SURROGATE}b", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", SURROGATE], "max_tokens": 1}, "prompt[1]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [SURROGATE], "max_tokens": 1}, "stop[0]"),
    ("/v1/completions", {"model": SURROGATE, "prompt": "x"}, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages[0].content[0].text"),
    ("/generate", {"text": SURROGATE}, "text"),
    ("/generate", {"input_ids": [1], "rid": SURROGATE}, "rid"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": SURROGATE}}, "sampling_params.stop"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field_on_a_connection_that_stays_usable(client_server, path, body,
                                                                                       param):
    raw = json.dumps(body).encode()  # ASCII JSON, the surrogate as its escape: valid JSON, not text
    assert b'\\ud800' in raw
    with httpx.Client(base_url=client_server.url, timeout=60) as http:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "surrogate" in r.json()["error"]["message"] and r.headers.get("connection") != "close"
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200, ok.text  # the same keep-alive connection serves the next request


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0},
    {"logit_bias": {}, "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
     "truncate_prompt_tokens": None, "use_beam_search": False, "length_penalty": 1.0, "priority": 0},
    {"skip_special_tokens": True, "no_stop_trim": False, "return_hidden_states": False, "user": "u", "seed": None},
    {"best_of": 1, "suffix": "", "echo": False, "stream": False, "stream_options": None, "logprobs": None},
], ids=["penalties", "vllm", "sglang-router", "openai"])
def test_completion_fields_at_their_no_op_values_are_accepted(client_server, fields):
    r = send(client_server, ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, **fields}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True},
    {"tools": None, "tool_choice": "auto", "add_generation_prompt": True, "echo": False, "chat_template_kwargs": {}},
    {"continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True, "logprobs": False},
    {"include_reasoning": True, "return_token_ids": False, "reasoning_effort": None, "previous_token_ids": None},
], ids=["openai-tools", "vllm", "sglang-router", "reasoning-and-ids"])
def test_chat_fields_at_their_no_op_values_are_accepted(client_server, fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **fields}
    r = send(client_server, ("POST", "/v1/chat/completions", body))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"logprobs_typo": 1}, "logprobs_typo"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),  # two constraints
    ("/v1/chat/completions", {"chat_template_kwargs": {"no_such_variable": 1}}, "chat_template_kwargs.no_such_variable"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"stream_reasoning": False}, "stream_reasoning"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_fields_not_implemented_are_one_clear_400(client_server, path, fields, param):
    base = ({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = send(client_server, ("POST", path, {"model": "tiny", "max_tokens": 1, **base, **fields}))
    assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["message"], r.text
