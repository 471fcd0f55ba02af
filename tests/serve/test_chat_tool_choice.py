"""Tool calls and exact multi-turn token streams on the embedded default (the random tiny Qwen3.5
with Qwen3.5's chat template) through a real ``bi-engine serve``: tool_choice required / named is
constrained decoding, so even random weights write valid calls, for many seeds, streamed or not,
through the openai SDK and LangChain; the render route gives the ids the chat route runs; and a
5-turn episode continued with ``previous_token_ids`` is the concatenation of its turns' ids."""

from __future__ import annotations

import json

import httpx
import pytest
import serve_helpers

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

# Qwen3.5's tool preamble alone is ~900 bytes (the presets' tokenizer is bytes): a longer context
CONFIG = serve_helpers.CONFIG.replace("max_model_len: 512", "max_model_len: 4096")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"top": {"type": "boolean"}}, "required": ["top"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"enable_thinking": False}
BASE = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
        "max_tokens": 600, "temperature": 1.0, "chat_template_kwargs": NO_THINKING}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = serve_helpers.ServerProcess(tmp_path_factory.mktemp("chat_tools"), config=CONFIG,
                                    env={"OMP_NUM_THREADS": "1"})
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_are_valid_for_many_seeds(server, tool_choice):
    for seed in range(3):
        r = _post(server, "/v1/chat/completions", {**BASE, "tool_choice": tool_choice, "seed": seed, "n": 4,
                                                   "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            msg = choice["message"]
            assert choice["finish_reason"] == "tool_calls" and msg["tool_calls"], choice
            assert msg["content"] is None and msg.get("reasoning_content") is None  # the calls alone
            for call in msg["tool_calls"]:
                _valid(call["function"]["name"], call["function"]["arguments"])
                if tool_choice == NAMED:
                    assert call["function"]["name"] == "get_weather"
            if tool_choice == NAMED:
                assert len(msg["tool_calls"]) == 1


def test_auto_on_random_weights_parses_nothing_and_never_fails(server):
    """Without a constraint the random model writes text: it stays content (or reasoning)."""
    r = _post(server, "/v1/chat/completions", {**BASE, "tool_choice": "auto", "seed": 1, "max_tokens": 40,
                                               "chat_template_kwargs": {}})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] in ("stop", "length"), r.text
    assert "tool_calls" not in choice["message"]


def test_streamed_forced_calls_equal_the_whole_answer(server):
    """Several calls (parallel_tool_calls): random weights may go on calling until max_tokens cuts
    the last call, which then stays content; the streamed deltas say the same."""
    body = {**BASE, "tool_choice": "required", "seed": 5, "parallel_tool_calls": True}
    answer = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    whole = answer["message"]["tool_calls"]
    for call in whole:
        _valid(call["function"]["name"], call["function"]["arguments"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
    extra = {k: body[k] for k in ("chat_template_kwargs",)}
    chunks = list(client.chat.completions.create(
        model="tiny", messages=body["messages"], tools=TOOLS, tool_choice="required", seed=5, temperature=1.0,
        max_tokens=600, stream=True, extra_body=extra))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert sorted(calls) == list(range(len(whole))) and chunks[-1].choices[0].finish_reason == answer["finish_reason"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (answer["message"]["content"] or "")


def test_forced_calls_with_thinking_on_come_after_the_reasoning(server):
    """The grammar leaves the reasoning free; cut before ``</think>``, the answer is all reasoning."""
    r = _post(server, "/v1/chat/completions", {**BASE, "tool_choice": NAMED, "seed": 0, "max_tokens": 12,
                                               "chat_template_kwargs": {}})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "length", r.text
    assert choice["message"]["reasoning_content"] and not choice["message"].get("tool_calls")


def test_langchain_bind_tools_and_with_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    model = lc.ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", max_tokens=600,
                          temperature=1.0, seed=3, extra_body={"chat_template_kwargs": NO_THINKING})
    reply = model.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    jsonschema.validate(reply.tool_calls[0]["args"], SCHEMAS["get_weather"])

    class Forecast(BaseModel):
        city: str = Field(json_schema_extra={"enum": ["Paris", "Rome"]})
        days: int = Field(ge=1, le=9)

    for method in ("function_calling", "json_schema"):  # a named tool_choice; response_format json_schema
        out = model.with_structured_output(Forecast, method=method).invoke("Weather in Paris?")
        assert isinstance(out, Forecast) and out.city in ("Paris", "Rome") and 1 <= out.days <= 9, method


def test_render_gives_the_ids_the_chat_route_runs(server):
    body = {**BASE, "tool_choice": "required", "seed": 0, "return_token_ids": True}
    rendered = _post(server, "/v1/chat/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    done = _post(server, "/v1/chat/completions", body).json()
    assert rendered.json()["token_ids"] == done["prompt_token_ids"]
    assert rendered.json()["sampling_params"]["max_tokens"] == 600
    assert len(done["choices"][0]["token_ids"]) == done["usage"]["completion_tokens"]


def test_a_five_turn_episode_is_the_concatenation_of_its_turns(server):
    """Turn by turn: the model's exact ids (thinking and tool calls as sampled) plus the new
    messages; a full re-render of the conversation would differ (earlier thinking stripped)."""
    turns = [([{"role": "user", "content": "Weather in Paris?"}], NAMED, NO_THINKING),
             ([{"role": "tool", "content": "sunny"}], "auto", {}),  # thinking on, cut short
             ([{"role": "user", "content": "And Rome?"}], "required", NO_THINKING),
             ([{"role": "tool", "content": "rain"}], "none", NO_THINKING),
             ([{"role": "user", "content": "Thanks."}], "auto", {})]
    episode: list[int] = []
    for n, (messages, tool_choice, kwargs) in enumerate(turns):
        body = {"model": "tiny", "messages": messages, "tools": TOOLS, "tool_choice": tool_choice, "seed": n,
                "temperature": 1.0, "max_tokens": 24 if tool_choice == "auto" else 600, "return_token_ids": True,
                "chat_template_kwargs": kwargs, **({"previous_token_ids": episode} if episode else {})}
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["prompt_token_ids"][:len(episode)] == episode  # turn n+1 extends turn n's ids exactly
        if n == 0:
            first = _post(server, "/tokenize", {"messages": messages, "tools": TOOLS,
                                                "chat_template_kwargs": kwargs}).json()["tokens"]
            assert out["prompt_token_ids"] == first
        episode = out["prompt_token_ids"] + out["choices"][0]["token_ids"]
        assert out["choices"][0]["finish_reason"] in (("tool_calls",) if n in (0, 2) else ("stop", "length"))
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": episode}).json()["prompt"]
    assert text.count("<think>") == 5 and "<function=get_weather>" in text  # every turn's thinking kept


def test_the_responses_api_runs_as_its_chat_request(server):
    """/v1/responses (stateless): input items with an earlier call and its output, flat function
    tools, a named tool_choice; the answer's call is a function_call item, valid; thinking on gives
    a reasoning item; what is not implemented is a 400 naming the field."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"top": true}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model="tiny", input=items, tools=flat, tool_choice={"type": "function",
                                "name": "get_weather"}, reasoning={"effort": "none"}, max_output_tokens=600,
                                instructions="Be brief.")
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
    assert r.output[0].name == "get_weather" and r.output[0].call_id.startswith("call_")
    _valid("get_weather", r.output[0].arguments)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    rendered = _post(server, "/tokenize", {"messages": [
        {"role": "system", "content": "Be brief."}, items[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"top": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": TOOLS,
        "chat_template_kwargs": NO_THINKING}).json()
    assert r.usage.input_tokens == rendered["count"]  # the items rendered as the chat messages they mean
    cut = client.responses.create(model="tiny", input="Hi", max_output_tokens=8)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in cut.output] == ["reasoning"] and cut.output[0].content[0].text
    for field, value in [("store", True), ("previous_response_id", "resp_1"),
                         ("reasoning", {"effort": "high"}), ("input", [{"type": "web_search_call"}])]:
        err = _post(server, "/v1/responses", {"model": "tiny", "input": "Hi", field: value})
        want = "input[0].type" if field == "input" else field
        assert err.status_code == 400 and err.json()["error"]["param"] == want, (field, err.text)


def test_litellm_forced_tool_call(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/tiny", api_base=f"{server.url}/v1", api_key="unused", max_tokens=600,
                           messages=BASE["messages"], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           seed=2, extra_body={"chat_template_kwargs": NO_THINKING})
    (call,) = r.choices[0].message.tool_calls
    _valid(call.function.name, call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"
