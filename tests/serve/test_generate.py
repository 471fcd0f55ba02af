"""SGLang's native ``/generate`` through a real server: token ids in, the Python API's ids and
logprobs out (bitwise: one torch thread on both sides, so the CPU GEMMs sum in the same order),
SGLang's shapes (finish reason objects, logprob triples, prompt-major batches, cumulative stream
events), one clear error per bad field, and aborts by id."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import yaml
from serve_helpers import CONFIG, ServerProcess, httpx

from bi_core import EngineConfig, SamplingParams, build_engine

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("generate"), env=ONE_THREAD)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine():
    """The Python API on the server's config, with the server engine's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(EngineConfig.from_dict(yaml.safe_load(CONFIG)))
    torch.set_num_threads(before)


def post(server, body: dict, path: str = "/generate", **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


def events(server, body: dict) -> list:
    """A stream's events, parsed; ``[DONE]`` as the string."""
    out = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def triples(logprobs: list[float], ids: list[int]) -> list:
    return [[lp, t, None] for lp, t in zip(logprobs, ids)]


def tops(d: dict[int, float], n: int) -> list:
    return [[lp, t, None] for t, lp in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


PROMPT = [5, 17, 200, 3, 9, 41]
SAMPLING = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "sampling_seed": 1234,
            "ignore_eos": True}


def reference(engine, prompts, n: int = 1, **extra):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True, n=n,
                            **extra)
    return engine.generate(prompts, params)


def test_input_ids_give_the_python_apis_ids_and_logprobs_bitwise(gen_server, engine):
    r = post(gen_server, {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_logprob": True,
                          "top_logprobs_num": 3, "logprob_start_len": 2})
    assert r.status_code == 200, r.text
    got = r.json()
    ref = reference(engine, [PROMPT], logprobs=3, prompt_logprobs=3)[0]
    assert set(got) == {"text", "output_ids", "meta_info"}
    meta = got["meta_info"]
    assert got["output_ids"] == ref.token_ids and len(ref.token_ids) == 12
    assert meta["output_token_logprobs"] == triples(ref.token_logprobs, ref.token_ids)  # floats equal, bitwise
    assert meta["output_top_logprobs"] == [tops(d, 3) for d in ref.logprobs]
    assert meta["input_token_logprobs"] == [[ref.prompt_logprobs[p][PROMPT[p]], PROMPT[p], None]
                                            for p in range(2, len(PROMPT))]
    assert meta["input_top_logprobs"] == [tops(ref.prompt_logprobs[p], 3) for p in range(2, len(PROMPT))]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 12 and meta["weight_version"] == 0
    assert got["text"] == ref.text and isinstance(meta["id"], str) and meta["e2e_latency"] > 0


def test_a_batch_with_n_samples_is_prompt_major_and_each_sample_is_the_python_apis(gen_server, engine):
    prompts = [PROMPT, [7, 7, 1]]
    r = post(gen_server, {"input_ids": prompts, "sampling_params": {**SAMPLING, "n": 2}, "return_logprob": True})
    assert r.status_code == 200, r.text
    items = r.json()
    ref = [s for o in reference(engine, prompts, n=2) for s in o.outputs]
    assert isinstance(items, list) and len(items) == 4
    assert [i["output_ids"] for i in items] == [s.token_ids for s in ref]
    assert [i["meta_info"]["output_token_logprobs"] for i in items] == [triples(s.token_logprobs, s.token_ids)
                                                                       for s in ref]
    assert [i["meta_info"]["prompt_tokens"] for i in items] == [6, 6, 3, 3]
    assert items[0]["output_ids"] != items[1]["output_ids"]  # each sample its own seed
    assert "input_token_logprobs" in items[0]["meta_info"] and items[0]["meta_info"]["input_token_logprobs"] == []
    # one prompt with n > 1 is a list too, as SGLang answers it
    one = post(gen_server, {"input_ids": PROMPT, "sampling_params": {**SAMPLING, "n": 2}}).json()
    assert [i["output_ids"] for i in one] == [s.token_ids for s in ref[:2]]


def test_text_in_stop_string_and_per_prompt_sampling_params(gen_server, engine):
    full = post(gen_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    r = post(gen_server, {"text": ["Hello", "Hello"], "sampling_params": [
        {"max_new_tokens": 24, "temperature": 0, "stop": stop}, {"max_new_tokens": 24, "temperature": 0}]}).json()
    assert r[0]["text"] == text[:text.index(stop)]
    assert r[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r[1]["text"] == text and r[1]["meta_info"]["finish_reason"]["type"] == "length"
    ref = engine.generate(["Hello"], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
    assert full["output_ids"] == ref.token_ids and full["meta_info"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_stop_token_ids_end_with_the_matched_id(gen_server):
    full = post(gen_server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).json()
    stop_id = full["output_ids"][5]
    r = post(gen_server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                  "stop_token_ids": [stop_id]}}).json()
    cut = full["output_ids"].index(stop_id)
    assert r["output_ids"] == full["output_ids"][:cut + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_a_stream_sends_the_output_so_far_then_done(gen_server):
    body = {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_logprob": True}
    whole = post(gen_server, body).json()
    evs = events(gen_server, body)
    assert evs[-1] == "[DONE]" and len(evs) > 3
    items = evs[:-1]
    for before, after in zip(items, items[1:]):  # SGLang's default stream: every event has all so far
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert after["meta_info"]["completion_tokens"] == len(after["output_ids"])
    assert all(e["meta_info"]["finish_reason"] is None for e in items[:-1])
    last = items[-1]
    for key in ("e2e_latency", "id"):
        last["meta_info"].pop(key), whole["meta_info"].pop(key)
    assert last == whole and "index" not in last


def test_a_batch_stream_says_which_item_each_event_is(gen_server):
    evs = events(gen_server, {"input_ids": [PROMPT, [3, 4]], "sampling_params": {**SAMPLING, "n": 2}})[:-1]
    finals = {e["index"]: e for e in evs if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    batch = post(gen_server, {"input_ids": [PROMPT, [3, 4]], "sampling_params": {**SAMPLING, "n": 2}}).json()
    assert [finals[i]["output_ids"] for i in range(4)] == [b["output_ids"] for b in batch]


@pytest.mark.parametrize("body,param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1], []]}, "input_ids"),
    ({"input_ids": [999]}, "input_ids"),
    ({"input_ids": [1.5]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": "0.5"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"input_ids": [1], "custom_logit_processor": "gASVAAAA"}, "custom_logit_processor"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 600}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"regex": "[a-"}}, "sampling_params.regex"),  # no regex
    ({"input_ids": [1], "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "sampling_params.min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    ({"input_ids": [1], "routed_experts_start_len": 3}, "routed_experts_start_len"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": [1], "log_metrics": False}, "log_metrics"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "rid": ["a", "b"]}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid"),
    ({"input_ids": [[1]] * 65}, "input_ids"),  # more sequences than scheduler.max_num_seqs
    ({"input_ids": [1], "max_new_tokens": 4}, "max_new_tokens"),  # belongs in sampling_params
])
def test_bad_input_is_one_clear_error_naming_the_field(gen_server, body, param):
    r = post(gen_server, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"] and err["type"], r.text


def test_health_generate(gen_server):
    assert httpx.get(f"{gen_server.url}/health_generate", timeout=30).status_code == 200


def _stream_in_thread(server, body: dict, path: str = "/generate") -> tuple[threading.Thread, list, threading.Event]:
    """Stream in a thread: its events go to a list; the event is set at the first one."""
    got, first = [], threading.Event()

    def run():
        with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    got.append(data if data == "[DONE]" else json.loads(data))
                    first.set()
    t = threading.Thread(target=run)
    t.start()
    return t, got, first


LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}


def test_abort_request_by_rid_ends_its_stream_with_its_tokens_so_far(gen_server):
    t, got, first = _stream_in_thread(gen_server, {"input_ids": [1, 2, 3], "sampling_params": LONG, "rid": "job-1"})
    assert first.wait(60)
    r = post(gen_server, {"rid": "job-1"}, "/abort_request")
    assert r.status_code == 200, r.text
    t.join(60)
    assert got[-1] == "[DONE]"
    last = got[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["meta_info"]["id"] == "job-1"
    assert 0 < len(last["output_ids"]) < 480
    full = post(gen_server, {"input_ids": [1, 2, 3], "sampling_params": {**LONG, "max_new_tokens": 8}}).json()
    assert last["output_ids"][:8] == full["output_ids"][:len(last["output_ids"][:8])]
    missing = post(gen_server, {"rid": "job-1"}, "/abort_request")  # finished now
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "rid"
    nothing = post(gen_server, {}, "/abort_request")  # no rid, no abort_all: nothing to abort, as SGLang answers
    assert nothing.status_code == 200, nothing.text


def test_abort_all_and_vllms_abort_requests_by_a_completion_id(gen_server):
    t1, got1, first1 = _stream_in_thread(gen_server, {"input_ids": [4, 5], "sampling_params": LONG})
    t2, got2, first2 = _stream_in_thread(gen_server, {"model": "tiny", "prompt": [6, 7], "max_tokens": 480,
                                                      "temperature": 0, "ignore_eos": True}, "/v1/completions")
    assert first1.wait(60) and first2.wait(60)
    cmpl_id = got2[0]["id"]
    r = post(gen_server, {"request_ids": [cmpl_id]}, "/abort_requests")
    assert r.status_code == 200 and r.json() == {"status": "aborted", "aborted": 1}, r.text
    t2.join(60)
    assert got2[-1] == "[DONE]" and got2[-2]["choices"][0]["finish_reason"] == "abort"
    assert got2[-2]["metadata"] == {"weight_version": "0"}
    r = post(gen_server, {"abort_all": True}, "/abort_request")
    assert r.status_code == 200, r.text
    t1.join(60)
    # the other request ran on until abort_all
    assert got1[-2]["meta_info"]["finish_reason"]["type"] == "abort" and len(got1[-2]["output_ids"]) < 480
    r = post(gen_server, {"request_ids": ["cmpl-nope"]}, "/abort_requests")
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_ids"
    assert post(gen_server, {}, "/abort_requests").json() == {"status": "aborted", "aborted": 0}
