"""vLLM's sampling fields on the OpenAI routes and SGLang's names for them on ``/generate`` reach
the engine's SamplingParams: each answer equals, bitwise, the Python API given the field, and each
field is chosen where it changes the answer (checked against the Python API without it)."""

from __future__ import annotations

import bodies
import pytest
from replay import send

from bi_core import SamplingParams
from bi_core.models.tokenizer import ByteTokenizer

BASE = dict(max_new_tokens=16, temperature=1.0, seed=7, logprobs=0)
NO_THINKING = {"enable_thinking": False}
NO = ByteTokenizer().chat([{"role": "user", "content": "no"}], template_kwargs=NO_THINKING).ids  # its greedy reply
# starts with <|endoftext|>
# (OpenAI / vLLM field, SGLang field, value, SamplingParams field)
FIELDS = [("min_p", "min_p", 0.3, "min_p"), ("repetition_penalty", "repetition_penalty", 1.8, "repetition_penalty"),
          ("presence_penalty", "presence_penalty", 1.5, "presence_penalty"),
          ("frequency_penalty", "frequency_penalty", 1.5, "frequency_penalty")]


def _reference(engine, prompt: list[int], **fields):
    return engine.generate([prompt], SamplingParams(**{**BASE, **fields}))[0]


@pytest.mark.parametrize("field,sglang,value,param", FIELDS, ids=[f[0] for f in FIELDS])
def test_sampling_fields_reach_the_engine(client_server, engine, field, sglang, value, param):
    ref = _reference(engine, bodies.IDS, **{param: value})
    assert ref.token_ids != _reference(engine, bodies.IDS).token_ids  # the field changes this answer
    r = send(client_server, ("POST", "/v1/completions", {"model": "tiny", "prompt": bodies.IDS, "max_tokens": 16,
                                                         "temperature": 1.0, "seed": 7, "logprobs": 0, field: value}))
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == ref.token_logprobs and r.json()["choices"][0]["text"] == ref.text
    g = send(client_server, ("POST", "/generate", {"input_ids": bodies.IDS, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 7, sglang: value}}))
    assert g.status_code == 200, g.text
    assert g.json()["output_ids"] == ref.token_ids
    assert [x[0] for x in g.json()["meta_info"]["output_token_logprobs"]] == ref.token_logprobs


def test_min_tokens_and_min_new_tokens_hold_off_the_end(client_server, engine):
    ref = engine.generate([NO], SamplingParams(max_new_tokens=6, temperature=0, min_tokens=4,
                                               stop_token_ids=(258,)))[0]
    assert len(ref.token_ids) >= 4 and len(_reference(engine, NO, temperature=0).token_ids) == 1  # EOS first
    chat = send(client_server, ("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "no"}], "max_tokens": 6, "temperature": 0,
        "min_tokens": 4, "chat_template_kwargs": NO_THINKING}))
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == len(ref.token_ids), chat.text
    assert chat.json()["choices"][0]["message"]["content"] == ref.text
    g = send(client_server, ("POST", "/generate", {"input_ids": NO, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "min_new_tokens": 4, "stop_token_ids": [258]}}))
    assert g.status_code == 200 and g.json()["output_ids"] == ref.token_ids, g.text


@pytest.mark.parametrize("skip,spaces", [(False, True), (False, False)])
def test_special_tokens_in_the_text(client_server, engine, skip, spaces):
    """The reply to "no" starts with <|endoftext|>: kept in the text when skip_special_tokens is
    off, spaced from its neighbours by spaces_between_special_tokens."""
    opts = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    ref = engine.generate([NO], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, **opts))[0]
    assert "<|endoftext|>" in ref.text and ref.text != _reference(engine, NO, temperature=0, max_new_tokens=4,
                                                                   ignore_eos=True).text
    c = send(client_server, ("POST", "/v1/completions", {"model": "tiny", "prompt": NO, "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True, **opts}))
    assert c.status_code == 200 and c.json()["choices"][0]["text"] == ref.text, c.text
    g = send(client_server, ("POST", "/generate", {"input_ids": NO, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, **opts}}))
    assert g.status_code == 200 and g.json()["text"] == ref.text, g.text


def test_a_matched_stop_string_stays_with_include_stop_str_in_output_and_no_stop_trim(client_server, engine):
    full = _reference(engine, bodies.IDS, temperature=0, max_new_tokens=24).text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    ref = engine.generate([bodies.IDS], SamplingParams(max_new_tokens=24, temperature=0, stop=(stop,),
                                                       include_stop_str_in_output=True))[0]
    assert ref.text.endswith(stop) and ref.finish_reason == "stop"
    c = send(client_server, ("POST", "/v1/completions", {"model": "tiny", "prompt": bodies.IDS, "max_tokens": 24,
                                                         "temperature": 0, "stop": stop,
                                                         "include_stop_str_in_output": True}))
    assert c.status_code == 200 and c.json()["choices"][0]["text"] == ref.text, c.text
    trimmed = send(client_server, ("POST", "/v1/completions", {"model": "tiny", "prompt": bodies.IDS,
                                                               "max_tokens": 24, "temperature": 0, "stop": stop}))
    assert trimmed.json()["choices"][0]["text"] == ref.text[:-len(stop)]
    for path, body in [("/v1/completions", {"model": "tiny", "prompt": bodies.IDS, "max_tokens": 24, "temperature": 0,
                                            "stop": stop, "no_stop_trim": True}),  # as sglang-router forwards it
                       ("/generate", {"input_ids": bodies.IDS, "sampling_params": {
                           "max_new_tokens": 24, "temperature": 0, "stop": stop, "no_stop_trim": True}})]:
        r = send(client_server, ("POST", path, body))
        text = r.json()["choices"][0]["text"] if path == "/v1/completions" else r.json()["text"]
        assert r.status_code == 200 and text == ref.text, r.text
