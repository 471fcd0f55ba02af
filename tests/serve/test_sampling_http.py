"""Sampling parameters the engine refuses, through the HTTP routes: one 400 naming the problem."""

from __future__ import annotations

import json

import httpx
from serve_helpers import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def post_raw(server, path: str, body: str) -> httpx.Response:
    """``body`` as written (JSON's ``Infinity`` is no value ``json.dumps`` writes by default)."""
    return httpx.post(f"{server.url}{path}", content=body, headers=HEADERS, timeout=60)


def test_a_temperature_of_infinity_is_refused(server):
    r = post_raw(server, "/generate", '{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}')
    assert r.status_code == 400 and "temperature must be a finite number" in r.json()["error"]["message"], r.text
    r = post_raw(server, "/v1/completions", '{"model": "tiny", "prompt": [1, 2], "temperature": NaN}')
    assert r.status_code == 400, r.text


def test_stop_token_ids_outside_the_vocabulary_are_refused(server):
    for path, body in [("/v1/completions", {"model": "tiny", "prompt": [1, 2], "stop_token_ids": [3, 999]}),
                       ("/v1/completions", {"model": "tiny", "prompt": [1, 2], "n": 2, "stop_token_ids": [999]}),
                       ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [999]}})]:
        r = post_raw(server, path, json.dumps(body))
        assert r.status_code == 400, r.text
        assert "stop_token_ids has ids outside the vocabulary [0, 260): [999]" in r.json()["error"]["message"]


def test_completions_top_logprobs_have_exactly_n_entries(server):
    """20 entries, plus the sampled token when it is not among them: byte tokens of half a
    character are named ``bytes:\\xNN`` (all of them decode to U+FFFD alone, and collapsed)."""
    body = {"model": "tiny", "prompt": [200, 201, 202], "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "logprobs": 20}
    r = post_raw(server, "/v1/completions", json.dumps(body))
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and len(top) in (20, 21)
        assert len(top) == 20 or value == min(top.values())  # 21: the sampled token came from outside the top 20
    assert any(name.startswith("bytes:\\x") for top in lp["top_logprobs"] for name in top)


def test_chat_ignore_eos_ignores_the_turn_end_too(server):
    """vLLM counts the template's turn end among the EOS ids (generation_config's), which
    ignore_eos ignores: the job the render route shows stops on <|im_end|> (258) unless
    ignore_eos; the greedy reply to "no" (thinking off) starts with its EOS, and goes on past it."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "no"}], "max_tokens": 30, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}
    r = post_raw(server, "/v1/chat/completions", json.dumps({**body, "ignore_eos": True})).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 30
    tokens = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == "token_id:256"  # <|endoftext|> first
    ends = post_raw(server, "/v1/chat/completions", json.dumps(body)).json()
    assert ends["choices"][0]["finish_reason"] == "stop" and ends["usage"]["completion_tokens"] == 1  # its EOS
    for ignore, stops in ((False, [258]), (True, [])):
        job = post_raw(server, "/v1/chat/completions/render", json.dumps({**body, "ignore_eos": ignore})).json()
        assert job["sampling_params"]["stop_token_ids"] == stops and job["sampling_params"]["ignore_eos"] is ignore
