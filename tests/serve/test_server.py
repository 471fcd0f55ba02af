"""``bi-engine serve`` over real HTTP: a uvicorn server process with the tiny model on the CPU,
driven by the official openai client and httpx."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from serve_helpers import API_KEY, CONFIG, ServerProcess, aborted, eventually, httpx, metric

openai = pytest.importorskip("openai")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models_health_and_mode_header(server):
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.headers["x-batch-invariant"] == "false"
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    h = httpx.get(f"{server.url}/health")
    assert h.json()["status"] == "ok" and h.json()["batch_invariant"] is False


def test_completion_streams_join_to_the_same_text(server):
    c = client(server)
    full = c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    text, usage = "", None
    for chunk in c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        text += "".join(ch.text for ch in chunk.choices)
        usage = chunk.usage or usage
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    assert text == full.choices[0].text and usage.completion_tokens == 12
    assert usage.prompt_tokens == full.usage.prompt_tokens == 5


def test_chat_and_chat_stream(server):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_logprobs_formats(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # top-3 plus the sampled token, keyed by token name (half a character: "bytes:\\xNN", one name each)
        assert len(top) in (3, 4) and value <= 0 and top[token] == value
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # the byte tokenizer's tokens are one byte each (specials none), not the text's re-encoding
        assert len(entry.bytes) <= 1 and bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_seeded_sampling_reproducible_and_n(server):
    c = client(server)
    kw = dict(model="tiny", prompt="seed me", max_tokens=12, temperature=0.9)
    a = c.completions.create(**kw, seed=11).choices[0].text
    assert c.completions.create(**kw, seed=11).choices[0].text == a
    many = c.completions.create(**kw, seed=11, n=3)
    texts = [ch.text for ch in sorted(many.choices, key=lambda ch: ch.index)]
    assert texts[0] == a and len(set(texts)) == 3  # sample 0 uses the seed itself; each sample its own stream
    assert many.usage.prompt_tokens == 7 and many.usage.completion_tokens == 36


def test_stop_strings_and_token_id_prompts(server):
    c = client(server)
    full = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=24, temperature=0).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    r = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=24, temperature=0, stop=[stop, "never!"])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=24, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == r.choices[0].text  # nothing past the stop string was ever sent
    two = c.completions.create(model="tiny", prompt=[[1, 2], [3, 4, 5]], max_tokens=3, temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.prompt_tokens == 5


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": 2.5}, 400, "temperature"),  # OpenAI's range is 0..2
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x" * 600}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [[1, 2], []]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1.5]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ({"model": "tiny", "prompt": "x", "echo": True, "stream": True}, 400, "echo"),  # echo comes with the finished request
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 needs echo
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),  # no stream
    ({"model": "tiny", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),  # OpenAI's range -2..2
    ({"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "n": 65}, 400, "n"),  # more samples than scheduler.max_num_seqs
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
    # strict types, as OpenAI's: no strings for numbers or booleans, no booleans for numbers
    ({"model": "tiny", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [1, "2"]}, 400, "stop_token_ids[1]"),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
])
def test_completion_errors(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and err["message"] and err["type"], r.text
    assert r.headers["x-batch-invariant"] == "false"


@pytest.mark.parametrize("fields,param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),  # longer than max_model_len
    ({"n": 65}, "n"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
])
def test_chat_errors_name_the_parameter(server, fields, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_ints_are_floats_and_temperature_2_is_allowed(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 2, "top_p": 1, "seed": 3})
    assert r.status_code == 200, r.text


def test_metric_fails_on_a_metric_the_server_does_not_export(server):
    assert metric(server, "bi_requests_running") == 0
    with pytest.raises(AssertionError, match="no bi_requests_runing"):
        metric(server, "bi_requests_runing")


def test_chat_malformed_json_and_auth_errors(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"[1, 2]", headers=AUTH)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_hundreds_of_concurrent_requests_each_equal_alone(server):
    """256 requests at once (greedy and seeded sampling): none lost, each one's tokens equal to the
    same request sent alone (the reference backend keeps tokens, not bits, across batches)."""
    rng = random.Random(0)
    reqs = [dict(model="tiny", prompt=[rng.randrange(256) for _ in range(rng.randint(1, 40))],
                 max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000),
                 logprobs=0) for _ in range(256)]

    async def burst():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(ac.completions.create(**r) for r in reqs))
        finally:
            await ac.close()

    together = asyncio.run(burst())
    c = client(server)
    for r, t in zip(reqs, together):
        alone = c.completions.create(**r)
        assert t.choices[0].logprobs.tokens == alone.choices[0].logprobs.tokens
        assert t.choices[0].text == alone.choices[0].text


def test_client_disconnect_aborts_and_frees_pages(server):
    others = {}

    def other():
        others["out"] = client(server).completions.create(model="tiny", prompt="steady", max_tokens=40,
                                                          temperature=0).choices[0].text

    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": "long", "max_tokens": 480, "temperature": 0, "stream": True}) as r:
        thread = threading.Thread(target=other)
        thread.start()
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    thread.join(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (metric(server, "bi_requests_running") or
                                           metric(server, "bi_kv_pages_used")):
        time.sleep(0.2)
    assert metric(server, "bi_requests_running") == 0 and metric(server, "bi_kv_pages_used") == 0
    assert 'bi_requests_finished_total{reason="abort"}' in httpx.get(f"{server.url}/metrics").text
    alone = client(server).completions.create(model="tiny", prompt="steady", max_tokens=40, temperature=0)
    assert others["out"] == alone.choices[0].text


def idle(server) -> bool:
    return metric(server, "bi_requests_running") == 0 and metric(server, "bi_kv_pages_used") == 0


@pytest.mark.parametrize("num_prompts,n", [(1, 16), (8, 2)])
def test_non_streaming_client_disconnect_aborts_all_its_prompts(server, num_prompts, n):
    """A client that stops waiting for a (non-streaming) response aborts every sequence of its
    request at once, although the engine sends deltas at every step."""
    before = aborted(server)
    body = {"model": "tiny", "prompt": [[1 + i, 2, 3] for i in range(num_prompts)], "n": n, "max_tokens": 480,
            "temperature": 0.8, "ignore_eos": True}  # 16 sequences x 480 tokens: seconds on any CPU
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=1))
    assert eventually(lambda: aborted(server) == before + 16, 5), aborted(server) - before
    assert eventually(lambda: idle(server), 5)


def test_gauges_follow_an_abort_on_an_idle_server(server):
    """An abort with nothing else running updates the gauges (no step has to follow it)."""
    before = aborted(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": "alone", "max_tokens": 480, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        assert metric(server, "bi_requests_running") == 1
    assert eventually(lambda: aborted(server) == before + 1, 10)
    assert eventually(lambda: idle(server), 2), (metric(server, "bi_requests_running"),
                                                 metric(server, "bi_kv_pages_used"))


def test_a_requests_prompts_join_the_batch_in_one_step(server):
    steps = metric(server, "bi_step_seconds_count")
    r = client(server).completions.create(model="tiny", prompt=[[i, i + 1] for i in range(40)], max_tokens=1,
                                          temperature=0)
    assert sorted(c.index for c in r.choices) == list(range(40)) and r.usage.prompt_tokens == 80
    assert metric(server, "bi_step_seconds_count") - steps <= 2  # one prefill step for all 40 (was one per prompt)


def test_a_request_may_ask_for_at_most_max_num_seqs_sequences(server):
    body = {"model": "tiny", "prompt": [[1, 2]] * 33, "n": 2, "max_tokens": 1}  # 66 sequences > 64
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert "66 sequences" in err["message"] and "scheduler.max_num_seqs=64" in err["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [[1, 2]] * 32}, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["choices"]) == 64


def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path):
    s = ServerProcess(tmp_path)
    result = {}

    def stream():
        text, finish = "", None
        for chunk in client(s).completions.create(model="tiny", prompt="bye", max_tokens=300, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                result.setdefault("first", time.monotonic())
        result["text"], result["finish"] = text, finish

    t = threading.Thread(target=stream)
    t.start()
    while "first" not in result and t.is_alive():
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises((httpx.HTTPError, AssertionError)):  # refused: connection closed, or 503
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=5)
        assert r.status_code == 200
    t.join(60)
    assert result["finish"] == "length" and s.stop() == 0


def test_tensor_parallel_server_matches_one_process(server, tmp_path):
    """`bi-engine serve` with tensor_parallel_size 2 (two engine processes, gloo): concurrent
    requests answer as the one-process server does, a stream cut mid-way is aborted on every rank,
    and SIGTERM stops both ranks with exit code 0."""
    tp = ServerProcess(tmp_path, config=CONFIG + "parallel: {tensor_parallel_size: 2}\n")
    try:
        rng = random.Random(1)
        reqs = [dict(model="tiny", prompt=[rng.randrange(256) for _ in range(rng.randint(1, 40))],
                     max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000),
                     logprobs=0) for _ in range(16)]

        async def burst(url):
            ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
            try:
                return await asyncio.gather(*(ac.completions.create(**r) for r in reqs))
            finally:
                await ac.close()

        with httpx.stream("POST", f"{tp.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True}) as r:
            next(r.iter_lines())  # then the client goes away mid-stream
        two = asyncio.run(burst(tp.url))
        one = asyncio.run(burst(server.url))
        for a, b in zip(one, two):
            assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and metric(tp, "bi_requests_running"):
            time.sleep(0.2)
        assert metric(tp, "bi_requests_running") == 0 and metric(tp, "bi_kv_pages_used") == 0
    finally:
        assert tp.stop() == 0


def engine_process(s: ServerProcess) -> int:
    """The pid of the server's engine process (its child started by multiprocessing's spawn)."""
    for pid in open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read().split():
        if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
            return int(pid)
    raise AssertionError("no engine process under the server")


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped by its (killed) parent
            return True
        time.sleep(0.1)
    return False


def test_engine_process_gone_is_logged_fails_health_and_the_server_exits_non_zero(tmp_path):
    """The engine runs in a process of its own: if it dies mid-stream the stream ends with an error
    saying how (its signal), the log says so in one line, /health stops answering 200, and the
    server exits non-zero (a supervisor restarts it) instead of answering 503 forever; if the HTTP
    process is killed, the engine process notices and exits (no orphan holding a GPU)."""
    s = ServerProcess(tmp_path)
    engine = engine_process(s)
    with httpx.stream("POST", f"{s.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(engine, signal.SIGKILL)
        rest = "\n".join(lines)
    assert "engine process was killed by signal SIGKILL (9)" in rest and rest.rstrip().endswith("[DONE]")
    try:
        health = httpx.get(f"{s.url}/health", timeout=5)
        assert health.status_code == 503 and "killed by signal SIGKILL" in health.json()["reason"]
    except httpx.TransportError:  # it has exited already
        pass
    assert s.proc.wait(60) not in (0, None)
    log = s.log_path.read_text()
    assert "ERROR:  the engine process was killed by signal SIGKILL (9); the server stops" in log, log
    assert log.strip().splitlines()[-1].startswith("bi-engine: error: the engine process was killed"), log
    s.stop()
    s = ServerProcess(tmp_path)
    engine = engine_process(s)
    s.proc.kill()
    s.proc.wait()
    assert gone(engine, 30), "the engine process outlived its killed server"


def test_engine_build_error_is_one_clear_line(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(CONFIG.replace("backend: reference", "backend: cuda_hopper_invariant\npolicy: {batch_invariant: true}"))
    r = subprocess.run([sys.executable, "-m", "bi_core.cli", "serve", "--config", str(cfg), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("bi-engine: error:"), r.stderr
