"""The RL control routes through a real server, with requests in flight: pause in modes keep
(frozen, then bitwise the uninterrupted run), abort (their tokens so far, finish_reason abort) and
wait (answered once they finished); requests sent while paused or asleep wait and are served
after; sleep / wake (vLLM's and SGLang's names) give the same outputs after; the prefix cache
reset; each route's bad input; vLLM's metric names moving with the bi_* ones."""

from __future__ import annotations

import json
import threading
import time

import pytest
from serve_helpers import API_KEY, CONFIG, ServerProcess, eventually, families, httpx, labeled

CTL_CONFIG = CONFIG.replace("max_num_batched_tokens: 2048}", "max_num_batched_tokens: 2048, prefill_chunk_size: 32}")
SEEDED = {"max_new_tokens": 160, "temperature": 0.8, "sampling_seed": 7, "ignore_eos": True}
LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}
TINY = {"model_name": "tiny", "engine": "0"}


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("control"), config=CTL_CONFIG)
    yield s
    s.stop()


def post(server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", timeout=120, **kw)


class Background:
    """A request in a thread: a stream's events as they come (``events``; set ``first`` at the
    first one), or a plain response (``response``)."""

    def __init__(self, server, path: str, body: dict, stream: bool) -> None:
        self.events, self.response, self.first = [], None, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, path, body, stream))
        self.thread.start()

    def _run(self, server, path, body, stream) -> None:
        if not stream:
            self.response = post(server, path, body)
            self.first.set()
            return
        with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.first.set()

    def join(self, timeout: float = 60) -> Background:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request did not finish"
        return self

    @property
    def last(self) -> dict:
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return self.events[-2]


def stream(server, body: dict, path: str = "/generate") -> Background:
    b = Background(server, path, body, stream=True)
    assert b.first.wait(60), "no first event"
    return b


def test_pause_keep_freezes_requests_and_resume_goes_on_bitwise(ctl):
    body = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": SEEDED, "return_logprob": True}
    alone = post(ctl, "/generate", body).json()
    b = stream(ctl, body)
    r = post(ctl, "/pause", params={"mode": "keep"})
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    assert get(ctl, "/is_paused").json() == {"is_paused": True}
    frozen = len(b.events)
    time.sleep(0.5)
    assert len(b.events) == frozen and b.thread.is_alive() and b.events[-1] != "[DONE]"
    assert labeled(ctl, "vllm:num_requests_running", **TINY) == 1  # still holds its pages and state
    r = post(ctl, "/resume")
    assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
    assert get(ctl, "/is_paused").json() == {"is_paused": False}
    last = b.join().last
    assert last["output_ids"] == alone["output_ids"]  # nothing lost or recomputed: the same bits
    assert last["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 160}


def test_pause_abort_answers_requests_with_their_tokens_and_holds_new_ones(ctl):
    gen = stream(ctl, {"input_ids": [2, 7, 1, 8], "sampling_params": LONG, "return_logprob": True})
    cmpl = Background(ctl, "/v1/completions", {"model": "tiny", "prompt": [2, 8], "max_tokens": 480, "temperature": 0,
                                                "ignore_eos": True}, stream=False)
    assert eventually(lambda: labeled(ctl, "vllm:num_requests_running", **TINY) == 2, 30)
    r = post(ctl, "/pause")  # vLLM's default mode: abort
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    last = gen.join().last
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(last["output_ids"]) < 480
    assert len(last["meta_info"]["output_token_logprobs"]) == len(last["output_ids"])
    done = cmpl.join().response
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "abort", done.text
    assert done.json()["metadata"] == {"weight_version": "0"}  # a string, as the openai SDK types it
    # a request sent while paused waits, and is served after the resume
    held = Background(ctl, "/generate", {"input_ids": [5, 5], "sampling_params": {"max_new_tokens": 4}}, stream=False)
    time.sleep(0.5)
    assert held.thread.is_alive() and get(ctl, "/is_paused").json() == {"is_paused": True}
    r = post(ctl, "/continue_generation")  # SGLang's name
    assert r.status_code == 200 and r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    out = held.join().response
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length", out.text


def test_sglang_pause_in_place_is_keep(ctl):
    b = stream(ctl, {"input_ids": [9, 9, 9], "sampling_params": {**LONG, "max_new_tokens": 300}})
    r = post(ctl, "/pause_generation", {"mode": "in_place"})
    assert r.status_code == 200 and r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    frozen = len(b.events)
    time.sleep(0.3)
    assert len(b.events) == frozen
    assert post(ctl, "/continue_generation", {}).status_code == 200
    assert b.join().last["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_wait_answers_once_the_requests_in_flight_finished(ctl):
    b = stream(ctl, {"input_ids": [1, 4, 1, 4], "sampling_params": {**LONG, "max_new_tokens": 300}})
    r = post(ctl, "/pause", params={"mode": "wait"})
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    last = b.join(10).last  # its last event went out before the pause's answer
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert get(ctl, "/is_paused").json() == {"is_paused": True}
    assert post(ctl, "/resume").status_code == 200


@pytest.mark.parametrize("path,params,body,param", [
    ("/pause", {"mode": "bogus"}, None, "mode"),
    ("/pause", {"mode": "keep", "clear_cache": "true"}, None, "clear_cache"),
    ("/pause", {"mode": "abort", "wait_for_inflight_requests": "true"}, None, "mode"),
    ("/pause_generation", None, {"mode": "retract"}, "mode"),
    ("/pause_generation", None, {"mode": "sideways"}, "mode"),
    ("/pause_generation", None, {"mode": "abort", "extra": 1}, "extra"),
    ("/sleep", {"level": 3}, None, "level"),
    ("/sleep", {"level": "deep"}, None, "level"),
    ("/sleep", {"mode": "later"}, None, "mode"),
    ("/wake_up", {"tags": "gpu"}, None, "tags"),
    ("/release_memory_occupation", None, {"tags": ["kv_cache"]}, "tags"),
    ("/release_memory_occupation", None, {"tags": ["cuda_graph"]}, "tags"),
    ("/resume_memory_occupation", None, {"tags": []}, "tags"),
    ("/reset_prefix_cache", {"reset_running_requests": "true"}, None, "reset_running_requests"),
    ("/reset_prefix_cache", {"reset_external": "true"}, None, "reset_external"),
    ("/abort_requests", None, {"request_ids": "cmpl-1"}, "request_ids"),
    ("/abort_request", None, {"rid": 5}, "rid"),
])
def test_bad_control_input_is_one_clear_error_naming_the_parameter(ctl, path, params, body, param):
    r = post(ctl, path, body, params=params)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"], r.text
    assert get(ctl, "/is_paused").json() == {"is_paused": False}  # nothing happened


def test_reset_prefix_cache_drops_cached_prompts(ctl):
    body = {"input_ids": list(range(1, 101)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    post(ctl, "/generate", body)
    assert post(ctl, "/generate", body).json()["meta_info"]["cached_tokens"] == 96  # three 32-token chunks
    r = post(ctl, "/reset_prefix_cache")
    assert r.status_code == 200 and r.content == b""
    assert post(ctl, "/generate", body).json()["meta_info"]["cached_tokens"] == 0
    r = get(ctl, "/flush_cache")  # SGLang's name
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert post(ctl, "/generate", body).json()["meta_info"]["cached_tokens"] == 0


def test_weight_version_and_world_size(ctl):
    chat = post(ctl, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["metadata"] == {"weight_version": "0"}, chat.text  # SGLang's place
    assert get(ctl, "/get_weight_version").json() == {"weight_version": 0}
    assert get(ctl, "/weight_info").json() == {"weight_version": 0}
    info = get(ctl, "/get_model_info").json()
    assert info["weight_version"] == 0 and info["is_generation"] is True
    assert get(ctl, "/get_world_size").json() == {"world_size": 1}


def test_sleep_and_wake_up_give_the_same_outputs(ctl):
    body = {"input_ids": [2, 3, 5, 7, 11], "sampling_params": {**SEEDED, "max_new_tokens": 24}, "return_logprob": True}
    before = post(ctl, "/generate", body).json()
    r = post(ctl, "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": True}
    held = Background(ctl, "/generate", body, stream=False)
    time.sleep(0.5)
    assert held.thread.is_alive()  # asleep: it waits
    assert post(ctl, "/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still released
    assert held.thread.is_alive()
    assert post(ctl, "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": False}
    after = held.join().response.json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    # SGLang's names: release both, resume one tag at a time
    r = post(ctl, "/release_memory_occupation", {})
    assert r.status_code == 200 and r.json() is None, r.text
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": True}
    assert post(ctl, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert post(ctl, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": False}
    again = post(ctl, "/generate", body).json()
    assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_sleep_aborts_requests_in_flight_by_default(ctl):
    b = stream(ctl, {"input_ids": [6, 6], "sampling_params": LONG})
    assert post(ctl, "/sleep").status_code == 200
    assert b.join().last["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(ctl, "/wake_up").status_code == 200
    assert get(ctl, "/is_sleeping").json() == {"is_sleeping": False}
    assert get(ctl, "/is_paused").json() == {"is_paused": False}  # the sleep paused it, the wake-up resumed it


def test_vllm_metric_names_move_with_the_bi_ones(ctl):
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum", "vllm:iteration_tokens_total_count"]
    before = {n: labeled(ctl, n, **TINY) for n in names}
    ok_before = labeled(ctl, "vllm:request_success_total", finished_reason="length", **TINY)
    b = stream(ctl, {"input_ids": [1, 2, 3, 4, 5, 6, 7], "sampling_params": LONG})
    now = families(ctl)  # one scrape: the figures of one moment
    usage = labeled(now, "vllm:kv_cache_usage_perc", **TINY)
    assert labeled(now, "vllm:num_requests_running", **TINY) == labeled(now, "bi_requests_running") == 1
    assert usage > 0 and labeled(now, "vllm:gpu_cache_usage_perc", **TINY) == usage
    assert usage == labeled(now, "bi_kv_pages_used") / labeled(now, "bi_kv_pages_total")
    b.join()
    after = {n: labeled(ctl, n, **TINY) for n in names}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 480
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 7
    assert after["vllm:request_prompt_tokens_sum"] - before["vllm:request_prompt_tokens_sum"] == 7
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 480
    for n in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert after[n] - before[n] == 1, n
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] > 0
    assert after["vllm:iteration_tokens_total_count"] > before["vllm:iteration_tokens_total_count"]
    assert labeled(ctl, "vllm:request_success_total", finished_reason="length", **TINY) == ok_before + 1
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    # the same figures as bi-engine's own
    assert after["vllm:generation_tokens_total"] == labeled(ctl, "bi_generation_tokens_total")
    assert after["vllm:prompt_tokens_total"] == labeled(ctl, "bi_prompt_tokens_total")
    assert labeled(ctl, "vllm:request_success_total", finished_reason="abort", **TINY) == \
        labeled(ctl, "bi_requests_finished_total", reason="abort")


def test_control_and_generate_routes_need_the_api_key_health_and_metrics_do_not(server):
    for path in ("/pause", "/resume", "/generate", "/update_weights_from_distributed", "/abort_request"):
        r = post(server, path, {})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert get(server, "/is_paused").status_code == 401
    assert get(server, "/is_paused", headers={"Authorization": f"Bearer {API_KEY}"}).json() == {"is_paused": False}
    assert get(server, "/health").status_code == 200 and get(server, "/metrics").status_code == 200
