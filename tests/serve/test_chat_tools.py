"""Tool calls and reasoning through the real HTTP app and real clients (the openai SDK, streaming and
not; LangChain's bind_tools and litellm when installed). The tiny random model never writes a tool
call, so these run the app over a scripted engine: each request is answered with a hand-written
Qwen3.5 answer, a few bytes per step, as the engine process streams deltas. What reaches the
engine (the prompt the chat template rendered, the tools in it) is checked too."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from bi_core.config import ServeConfig  # noqa: E402 (after the skips)
from bi_core.models.tokenizer import ByteTokenizer  # noqa: E402
from bi_core.ports import free_port  # noqa: E402
from bi_core.runtime.sequence import RequestOutput  # noqa: E402
from bi_core.serve.app import create_app  # noqa: E402
from bi_core.serve.client import AddedRequest, Delta  # noqa: E402
from bi_core.serve.messages import EngineInfo  # noqa: E402
from bi_core.serve.metrics import Metrics  # noqa: E402

TOK = ByteTokenizer()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "where": {"type": "object"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
CALLS = ("Two lookups.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=where>\n{\"lat\": 48.8, \"tags\": [\"a\"]}\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nrain\n"
         "</parameter>\n</function>\n</tool_call>")


class ScriptedCore:
    """The engine process's client as the app uses it; every request answers ``answer``, streamed
    ``step`` bytes at a time, ending on <|im_end|>."""

    def __init__(self) -> None:
        self.info = EngineInfo(max_model_len=4096, batch_invariant=False, vocab_size=260, max_num_seqs=8)
        self.accepting, self.status, self.failure, self.lost = True, {}, None, False
        self.answer, self.step, self.jobs = "", 3, []

    def submit(self, jobs, emit, post=None) -> Future:
        self.jobs.append(jobs)
        fut: Future = Future()
        n = jobs[0][1].n
        fut.set_result(AddedRequest(list(range(n)), 0))
        threading.Thread(target=self._stream, args=(jobs[0][0], n, self.answer, emit, post), daemon=True).start()
        return fut

    def _stream(self, prompt, n, answer, emit, post) -> None:
        ids = TOK.encode(answer)
        for start in range(0, len(ids) + 1, self.step):
            chunk = ids[start:start + self.step]
            last = start + self.step > len(ids)
            for choice in range(n):
                out = (RequestOutput(request_id=choice, prompt_token_ids=prompt, token_ids=ids + [TOK.im_end],
                                     text=answer, token_logprobs=[0.0] * (len(ids) + 1), logprobs=None,
                                     finish_reason="stop", stop_reason=TOK.im_end) if last else None)
                post(emit, choice, Delta(chunk + ([TOK.im_end] if last else []), [], [], TOK.decode(chunk), out))
            time.sleep(0.001)

    def abort(self, request_ids) -> None:
        pass

    def drain(self, timeout_s) -> None:
        pass

    def stop(self, timeout_s) -> None:
        pass

    def prompt_text(self) -> str:
        return TOK.decode(self.jobs[-1][0][0], skip_special_tokens=False, spaces_between_special_tokens=False)


@pytest.fixture(scope="module")
def scripted():
    core = ScriptedCore()
    app = create_app(core, ServeConfig(), "tiny", TOK, Metrics("tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", core
    server.should_exit = True
    thread.join(10)


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert [name for name, _ in calls] == ["get_weather", "search"]
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": 3, "where": {"lat": 48.8, "tags": ["a"]}}
    assert json.loads(calls[1][1]) == {"query": "rain"}


def test_tool_calls_reasoning_and_finish_reason_through_the_openai_sdk(scripted):
    url, core = scripted
    core.answer = CALLS
    r = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris?"}],
                                             tools=[WEATHER, SEARCH], max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "\n\nChecking."
    assert choice.message.model_extra["reasoning_content"] == choice.message.model_extra["reasoning"] == "Two lookups.\n"
    _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    prompt = core.prompt_text()  # the tools reached the template's system prompt
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                             + json.dumps(WEATHER) + "\n" + json.dumps(SEARCH) + "\n</tools>")
    assert prompt.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("step", [1, 4, 9])
def test_streamed_tool_calls_accumulate_to_the_same_answer(scripted, step):
    url, core = scripted
    core.answer, core.step = CALLS, step
    try:
        chunks = list(_client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER, SEARCH], stream=True,
            max_tokens=400))
    finally:
        core.step = 3
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:  # OpenAI's accumulation: by index
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert reasoning == "Two lookups.\n" and content == "\n\nChecking."
    _check_calls([(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_malformed_calls_stay_content_and_tool_choice_none_parses_nothing(scripted):
    url, core = scripted
    bad = "Done.\n</think>\n\n<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>"
    core.answer = bad
    r = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             tools=[WEATHER], max_tokens=400)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == bad.split("</think>")[1]
    core.answer = CALLS
    r = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             tools=[WEATHER, SEARCH], tool_choice="none", max_tokens=400)
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content
    r = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             tools=[WEATHER, SEARCH], parallel_tool_calls=False, max_tokens=400)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_include_reasoning_and_separate_reasoning(scripted):
    url, core = scripted
    core.answer = "Let me see.\n</think>\n\nHello."
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50}
    msg = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Let me see.\n", "\n\nHello.")
    msg = httpx.post(f"{url}/v1/chat/completions", json={**body, "include_reasoning": False}).json()["choices"][0]
    assert "reasoning_content" not in msg["message"] and msg["message"]["content"] == "\n\nHello."
    msg = httpx.post(f"{url}/v1/chat/completions", json={**body, "separate_reasoning": False}).json()["choices"][0]
    assert msg["message"]["content"] == core.answer and msg["message"].get("reasoning_content") is None


def test_a_tool_round_trip_renders_the_call_and_its_result(scripted):
    """The assistant's calls (arguments as the JSON text OpenAI sends) and the tool results go back
    into the template in Qwen3.5's format."""
    url, core = scripted
    core.answer = "Sunny.\n</think>\n\nIt is sunny."
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _client(url).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=50)
    assert r.choices[0].message.content == "\n\nIt is sunny." and r.choices[0].finish_reason == "stop"
    assert core.prompt_text().endswith(
        "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<think>\nlook it up\n</think>\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    bad = {"model": "tiny", "max_tokens": 5, "messages": [messages[0], {**messages[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]}
    err = httpx.post(f"{url}/v1/chat/completions", json=bad)
    assert err.status_code == 400 and err.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_langchain_bind_tools(scripted):
    lc = pytest.importorskip("langchain_openai")
    url, core = scripted
    core.answer = CALLS
    model = lc.ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="unused", max_tokens=400)
    reply = model.bind_tools([WEATHER, SEARCH]).invoke("Weather in Paris?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather", "search"]
    assert reply.tool_calls[0]["args"] == {"city": "Paris", "days": 3, "where": {"lat": 48.8, "tags": ["a"]}}
    streamed = None
    for piece in model.bind_tools([WEATHER, SEARCH]).stream("Weather in Paris?"):
        streamed = piece if streamed is None else streamed + piece
    assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in reply.tool_calls]


def test_litellm_tools(scripted, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    url, core = scripted
    core.answer = CALLS
    r = litellm.completion(model="openai/tiny", api_base=f"{url}/v1", api_key="unused", max_tokens=400,
                           messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER, SEARCH])
    _check_calls([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls])
    assert r.choices[0].finish_reason == "tool_calls"
