"""SGLang-native clients, their recorded bodies replayed against a real server: slime's rollout
``/generate`` and its abort-until-idle loop (``/abort_request`` then ``/v1/loads``), verl's
``/generate``, SGLang's own frontend (``sgl.gen``, and ``select``'s scoring with
``max_new_tokens`` 0). Tokens and logprobs are checked bitwise against the Python API."""

from __future__ import annotations

import threading
import time

import bodies
import pytest
from replay import events, send

from bi_core import SamplingParams


def triples(lps: list[float], ids: list[int], texts: list[str | None] | None = None) -> list:
    return [[lp, t, texts[i] if texts else None] for i, (lp, t) in enumerate(zip(lps, ids))]


def test_slime_generate(client_server, engine):
    r = send(client_server, bodies.SLIME_GENERATE)
    assert r.status_code == 200, r.text
    ref = engine.generate([bodies.IDS], SamplingParams(
        max_new_tokens=8, temperature=1.0, top_p=0.9, seed=42, skip_special_tokens=False,
        include_stop_str_in_output=True, spaces_between_special_tokens=False))[0]
    meta = r.json()["meta_info"]
    # slime reads the tokens and logprobs from output_token_logprobs, the text beside them
    assert meta["output_token_logprobs"] == triples(ref.token_logprobs, ref.token_ids)
    assert r.json()["output_ids"] == ref.token_ids and meta["weight_version"] == 0
    assert r.json()["text"] == ref.text
    assert r.headers["x-unused-params"] == "sampling_params.custom_params"  # SGLang ignores it too, unreported


def _num_requests(load) -> int:
    """slime's server_control.num_requests_from_load, as it reads SGLang's /v1/loads."""
    if isinstance(load, list):
        return sum(_num_requests(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return _num_requests(load["loads"])
    counts = [load.get("num_total_reqs", load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0))]
    for key, value in load.items():
        if isinstance(value, int) and not isinstance(value, bool) and (
                key in ("num_running_reqs", "num_waiting_reqs", "waiting", "grammar") or key.endswith("_queue_reqs")):
            counts.append(value)
        elif key in ("disaggregation", "queues"):
            counts.append(_num_requests(value))
    return max(counts)


def test_slime_abort_loop_drains_a_busy_server(client_server):
    body = {"input_ids": bodies.IDS, "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                         "ignore_eos": True}}
    got: list = []

    def run() -> None:
        got.extend(events(client_server, ("POST", "/generate", body), stream=True)[1])

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while _num_requests(send(client_server, bodies.SLIME_LOADS).json()) == 0:
        assert time.monotonic() < deadline, "the request never showed in /v1/loads"
        time.sleep(0.05)
    busy = send(client_server, bodies.SLIME_LOADS).json()
    assert set(busy) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"} and busy["dp_rank_count"] == 1
    load = busy["loads"][0]
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == load["num_total_reqs"] >= 1
    assert load["disaggregation"]["mode"] == "null" and set(load["queues"]) == {"waiting", "grammar", "paused",
                                                                                   "retracted"}
    assert "memory" not in load and busy["aggregate"]["total_reqs"] == load["num_total_reqs"]
    for _ in range(60):  # slime's loop: abort everything, then read the load, until idle
        assert send(client_server, bodies.SLIME_ABORT).status_code == 200
        if _num_requests(send(client_server, bodies.SLIME_LOADS).json()) == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server never went idle")
    t.join(60)
    assert got[-1] == "[DONE]" and got[-2]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("query,param", [("include=core,gpu", "include"), ("dp_rank=1", "dp_rank")])
def test_loads_refuses_what_it_does_not_have(client_server, query, param):
    r = send(client_server, ("GET", f"/v1/loads?{query}", None))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_verl_generate(client_server, engine):
    r = send(client_server, bodies.VERL_GENERATE)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["id"] == "verl-0" and meta["finish_reason"]["type"] in ("stop", "length")
    assert [x[1] for x in meta["output_token_logprobs"]] == r.json()["output_ids"]  # verl zips these
    plain = send(client_server, bodies.VERL_HTTP_GENERATE)
    assert plain.status_code == 200 and "output_token_logprobs" not in plain.json()["meta_info"], plain.text
    greedy = engine.generate([bodies.IDS], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert plain.json()["output_ids"] == greedy.token_ids


def test_sglang_frontend_gen_and_its_stream(client_server, engine):
    r = send(client_server, bodies.SGL_GEN)
    assert r.status_code == 200, r.text
    ids = list(bodies.SGL_GEN[2]["text"].encode())
    ref = engine.generate([ids], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert r.json()["output_ids"] == ref.token_ids and r.json()["text"] == ref.text
    resp, evs = events(client_server, bodies.SGL_GEN_STREAM)
    assert resp.status_code == 200 and evs[-1] == "[DONE]"
    assert evs[-2]["text"] == ref.text  # the frontend reads data["text"][pos:] from each event


def test_sglang_frontend_stop_regex_other_than_empty_is_refused(client_server):
    _, path, body = bodies.SGL_GEN
    r = send(client_server, ("POST", path, {**body, "sampling_params": {**body["sampling_params"],
                                                                        "stop_regex": ["\\d+"]}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop_regex", r.text
    assert "stop regexes are not implemented" in r.json()["error"]["message"]


def test_sglang_frontend_select_scores_with_max_new_tokens_0(client_server, engine):
    cached = send(client_server, bodies.SGL_CACHE_PREFIX)
    assert cached.status_code == 200, cached.text
    meta = cached.json()["meta_info"]
    assert cached.json()["output_ids"] == [] and cached.json()["text"] == ""
    assert meta["prompt_tokens"] == 13 and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    start = max(meta["prompt_tokens"] - 2, 0)  # select's token healing
    assert bodies.SGL_SELECT[2]["logprob_start_len"] == start
    r = send(client_server, bodies.SGL_SELECT)
    assert r.status_code == 200, r.text
    prompts = [list(text.encode()) for text in bodies.SGL_SELECT[2]["text"]]  # both in one step, as the server ran them
    refs = engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0))
    for item, ids, ref in zip(r.json(), prompts, refs):
        want = [[ref.prompt_logprobs[p][ids[p]], ids[p], chr(ids[p])] for p in range(start, len(ids))]
        assert item["meta_info"]["input_token_logprobs"] == want  # bitwise: the prompt's own logprobs
        assert item["meta_info"]["output_token_logprobs"] == [] and item["output_ids"] == []
    values = [x[0] for x in r.json()[0]["meta_info"]["input_token_logprobs"] if x[0]]
    assert sum(values) / len(values) < 0  # the frontend's normalized prompt logprob
    unconditional = send(client_server, bodies.SGL_UNCONDITIONAL)
    assert unconditional.status_code == 200, unconditional.text
    # logprob_start_len left out with max_new_tokens 0: SGLang computes no input logprobs either
    assert [x["meta_info"]["input_token_logprobs"] for x in unconditional.json()] == [[], []]


def test_sglang_frontend_reads_model_info(client_server):
    r = send(client_server, bodies.SGL_MODEL_INFO)
    assert r.status_code == 200 and "model_path" in r.json(), r.text
