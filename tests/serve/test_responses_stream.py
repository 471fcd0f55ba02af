"""``/v1/responses`` with ``stream: true`` through a real ``bi-engine serve`` and the openai SDK
(``responses.create(stream=True)`` and ``responses.stream``): text, reasoning and a tool call, each
stream's events in the protocol's order with consecutive sequence numbers, its deltas joined equal
to its items, and its final response equal to the non-streamed one (greedy, so the same tokens)."""

from __future__ import annotations

import json

import pytest
import serve_helpers

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

CONFIG = serve_helpers.CONFIG.replace("max_model_len: 512", "max_model_len: 4096")
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
OFF = {"effort": "none"}
# greedy, the random model ends at once; a schema makes it write text (a JSON object)
SCHEMA = {"format": {"type": "json_schema", "name": "note", "strict": True, "schema": {
    "type": "object", "properties": {"note": {"type": "string", "maxLength": 12}}, "required": ["note"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = serve_helpers.ServerProcess(tmp_path_factory.mktemp("responses_stream"), config=CONFIG,
                                    env={"OMP_NUM_THREADS": "1"})
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", timeout=300, max_retries=0)
    s.stop()


def _same_but_ids(response) -> dict:
    """A response without what is fresh on every request: ids, call ids, the creation time."""
    body = response.model_dump(exclude_none=True)
    body.pop("id"), body.pop("created_at")
    for item in body["output"]:
        item.pop("id"), item.pop("call_id", None)
    return body


def _check_protocol(events: list) -> None:
    """Sequence numbers 0, 1, ...; created and in_progress first, the end last; every item added,
    then its deltas, then done; the deltas joined are the item's final text."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    texts: dict[int, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index not in texts and e.item.status == "in_progress"
            texts[e.output_index] = ""
        elif e.type.endswith(".delta"):
            texts[e.output_index] += e.delta
        elif e.type == "response.output_item.done":
            item = e.item
            done, at_end = item.model_dump(), final.output[e.output_index].model_dump()
            assert done == {k: at_end[k] for k in done}  # the SDK's helper adds parsed_arguments
            whole = item.arguments if item.type == "function_call" else item.content[0].text
            assert texts.pop(e.output_index) == whole
    assert not texts  # every item was done
    assert len(final.output) == len({e.output_index for e in events if e.type == "response.output_item.done"})


def test_streamed_text_is_the_non_streamed_response(client):
    body = {"model": "tiny", "input": "Hi", "reasoning": OFF, "text": SCHEMA, "max_output_tokens": 64,
            "temperature": 0}
    events = list(client.responses.create(stream=True, **body))
    _check_protocol(events)
    types = [e.type for e in events]
    assert "response.output_text.delta" in types and "response.reasoning_text.delta" not in types
    whole = client.responses.create(**body)
    assert [o.type for o in whole.output] == ["message"] and whole.output_text.startswith("{")
    assert _same_but_ids(events[-1].response) == _same_but_ids(whole)
    assert events[-1].type == f"response.{whole.status}"


def test_streamed_reasoning_cut_by_max_output_tokens(client):
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 12, "temperature": 0}
    events = list(client.responses.create(stream=True, **body))
    _check_protocol(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert events[3].part.type == "reasoning_text"
    whole = client.responses.create(**body)
    assert [o.type for o in whole.output] == ["reasoning"] and whole.output[0].status == "incomplete"
    assert _same_but_ids(events[-1].response) == _same_but_ids(whole)


def test_streamed_tool_call_through_the_sdk_stream_helper(client):
    """Sampled (greedy never closes a call on random weights), so the tokens differ from a second
    request's: the equality with the non-streamed response is the unit test's below."""
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [WEATHER], "reasoning": OFF,
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 600, "temperature": 1}
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _check_protocol(events)
    assert events[-1].type == "response.completed"
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types


ANSWER = ("Let me check.</think>\n\nSure: Paris.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"
          "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
          "</parameter>\n</function>\n</tool_call>")
CALL_FIRST = ("Hm.</think><tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
              "</tool_call>\nThen text.")


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("answer", [ANSWER, CALL_FIRST, "Thinking only, cut", "Short.</think>Just text."],
                         ids=["reasoning_text_calls", "call_then_text", "reasoning", "reasoning_text"])
def test_events_end_in_the_non_streamed_response_however_the_text_is_cut(answer, finish):
    """Fed one piece at a time (pieces of 1 to 7 characters), the events' final response is the
    non-streamed response of the same answer, its items in the answer's order and with the chat
    route's reasoning, text and calls; in a cut answer the item the cut fell in is incomplete."""
    from bi_core.models.chat_template import ChatPrompt
    from bi_core.runtime.sequence import RequestOutput
    from bi_core.serve.chat import ChatTurn
    from bi_core.serve.response_items import ResponseHead
    from bi_core.serve.responses import ResponsesRequest, echoed_settings
    from bi_core.serve.responses_stream import ResponseEvents, whole_response
    from bi_core.serve.server import Choice

    req = ResponsesRequest.model_validate({"model": "tiny", "input": "Weather?", "tools": [WEATHER]})
    turn = ChatTurn(req.as_chat(), ChatPrompt([1, 2], "<|im_start|>assistant\n<think>\n", ()))
    out = RequestOutput(request_id=0, prompt_token_ids=[1, 2], token_ids=[5] * 9, text=answer, token_logprobs=[],
                        logprobs=None, finish_reason=finish)
    choice = Choice(0, 2, 0, output=out)
    head = ResponseHead(echoed_settings(req), "resp_x", "tiny", 0)
    whole = whole_response(turn, head, choice)
    for size in range(1, 8):
        events, parser = ResponseEvents(head), turn.parser()
        streamed = [*events.start()]
        pieces = [answer[i:i + size] for i in range(0, len(answer), size)]
        for i, piece in enumerate(pieces):
            streamed += events.feed(parser.feed(piece, final=i == len(pieces) - 1))
        streamed += events.finish(choice)
        assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
        last = streamed[-1]
        assert last["type"] == ("response.incomplete" if finish == "length" else "response.completed")
        assert _without_ids(last["response"]["output"]) == _without_ids(whole["output"]), size
    message, _ = turn.message(out)
    items = {item["type"]: item for item in whole["output"]}
    assert items["reasoning"]["content"][0]["text"] == message["reasoning_content"]
    assert items.get("message", {"content": [{"text": None}]})["content"][0]["text"] == (message["content"] or None)
    assert [(o["name"], o["arguments"]) for o in whole["output"] if o["type"] == "function_call"] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    if answer == CALL_FIRST:  # the text came after the call: so does its item
        assert [o["type"] for o in whole["output"]] == ["reasoning", "function_call", "message"]
    if finish == "length":
        texts = [item["status"] for item in whole["output"] if item["type"] != "function_call"]
        assert texts[-1] == "incomplete" and set(texts[:-1]) <= {"completed"}


def test_an_engine_failure_is_an_error_event_and_the_stream_ends():
    """The stream's last event is OpenAI's ``error`` (type, message), after the reasoning so far;
    the request is untracked and aborted."""
    import asyncio

    from bi_core.models.chat_template import ChatPrompt
    from bi_core.runtime.sequence import RequestOutput
    from bi_core.serve.chat import ChatTurn
    from bi_core.serve.client import Delta
    from bi_core.serve.response_items import ResponseHead
    from bi_core.serve.responses import ResponsesRequest, echoed_settings
    from bi_core.serve.responses_stream import stream_response
    from bi_core.serve.server import Choice

    class FakeServer:
        shutting_down = False
        calls: list = []

        def untrack(self, ids):
            self.calls.append(("untrack", ids))

        def abort(self, choices):
            self.calls.append(("abort", len(choices)))

    req = ResponsesRequest.model_validate({"model": "tiny", "input": "Hi", "stream": True})
    turn = ChatTurn(req.as_chat(), ChatPrompt([1, 2], "<|im_start|>assistant\n<think>\n", ()))
    failed = RequestOutput(request_id=0, prompt_token_ids=[1, 2], token_ids=[5], text="a", token_logprobs=[],
                           logprobs=None, finish_reason="error", error="the engine failed: boom")
    server = FakeServer()

    async def run():
        queue = asyncio.Queue()
        queue.put_nowait((0, Delta([5], [0.0], [], "Thinking")))
        queue.put_nowait((0, Delta([5], [0.0], [], "a", output=failed)))
        response = stream_response(server, queue, [Choice(0, 2, 0)], turn, ResponseHead(echoed_settings(req), "resp_x", "tiny", 0))
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(run())
    events = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert all(c.startswith(f"event: {e['type']}\n") for c, e in zip(chunks, events))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.reasoning_text.delta", "error"]
    assert events[-1]["message"] == "the engine failed: boom" and events[-1]["code"] == "server_error"
    assert [e["sequence_number"] for e in events] == list(range(6))
    assert server.calls == [("untrack", ["resp_x"]), ("abort", 1)]
