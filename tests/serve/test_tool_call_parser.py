"""Qwen3.5's answers parsed into reasoning, content and tool calls (bi_core/serve/tool_call_parser.py,
chat_output.py), on hand-written outputs in the format its chat template teaches: typed values,
nested JSON, several calls, calls after thinking, truncated and malformed calls; and streamed in
every split, the pieces joined equal the whole answer parsed at once."""

from __future__ import annotations

import json
import logging

import pytest

from bi_core.serve.chat_output import OutputParser, parse_all
from bi_core.serve.tool_call_parser import MalformedToolCall, parse_block, tool_parameters

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
            "ratio": {"type": "number"}, "where": {"type": "object"}, "hours": {"type": "array"},
            "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "noop"}},
]
SCHEMAS = tool_parameters(TOOLS)


def call(name: str, **params: str) -> str:
    """A call as Qwen3.5's template writes one (each value between newlines)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, reasoning: bool = False, tools=SCHEMAS, **kw):
    return parse_all(OutputParser(reasoning=reasoning, tools=tools, **kw), text)


def args(c) -> dict:
    return json.loads(c.arguments)


def test_values_are_typed_by_the_tools_schema():
    text = call("get_weather", city="Paris", days="3", celsius="true", ratio="0.5",
                where='{"lat": 48.8, "tags": ["a", {"b": null}]}', hours="[1, 2, [3]]", note="null", limit="null")
    (c,) = parse(text).calls
    assert c.name == "get_weather" and c.id.startswith("call_")
    assert args(c) == {"city": "Paris", "days": 3, "celsius": True, "ratio": 0.5,
                       "where": {"lat": 48.8, "tags": ["a", {"b": None}]}, "hours": [1, 2, [3]], "note": None,
                       "limit": None}


def test_whitespace_the_grammar_allows_around_a_value_is_not_the_value():
    """structured/tool_calls.py (xgrammar's qwen_xml) lets whitespace surround every value but a
    plain string's; the parser strips it there and only there."""
    schema = {"pick": {"properties": {"city": {"enum": ["Paris", "Rome", 3]}, "code": {"type": "string", "maxLength": 4},
                                      "n": {"type": "integer"}, "text": {"type": "string"}}}}
    body = ("<tool_call>\n<function=pick>\n<parameter=city>\t Rome \r\n</parameter>\n<parameter=code>  ab \n"
            "</parameter><parameter=n> 7\t</parameter>\n<parameter=text>\n  indented\n\n</parameter>\n</function>\n"
            "</tool_call>")
    (c,) = parse(body, tools=schema).calls
    assert args(c) == {"city": "Rome", "code": "ab", "n": 7, "text": "  indented\n"}
    (c,) = parse(call("pick", city="3"), tools=schema).calls
    assert args(c)["city"] == 3  # a member that is not a string, as JSON


def test_strings_stay_raw_and_unknown_parameters_are_strings():
    value = 'line one\n  "quoted" {not json}\n<parameter=fake>\n</parameter> inside'
    (c,) = parse(call("search", query=value)).calls
    assert args(c) == {"query": value}  # a literal </parameter> not followed by a parameter is text
    (c,) = parse(call("noop", anything="42")).calls
    assert args(c) == {"anything": "42"}


def test_a_value_that_is_not_its_type_stays_a_string(caplog):
    with caplog.at_level(logging.WARNING):
        (c,) = parse(call("get_weather", city="x", days="three", celsius="maybe", where="[1]")).calls
    assert args(c) == {"city": "x", "days": "three", "celsius": "maybe", "where": "[1]"}
    assert "days is not a JSON integer" in caplog.text


def test_several_calls_and_content_before_them():
    text = "Let me check both.\n\n" + call("get_weather", city="Paris") + "\n" + call("search", query="rain")
    p = parse(text)
    assert [c.name for c in p.calls] == ["get_weather", "search"]
    assert p.content == "Let me check both."  # the blank line before the call is dropped
    assert len({c.id for c in p.calls}) == 2


def test_calls_after_thinking_and_the_implicit_end_of_thinking():
    p = parse("I need the weather.\n</think>\n\n" + call("get_weather", city="Oslo"), reasoning=True)
    assert p.reasoning == "I need the weather.\n" and p.content == "" and args(p.calls[0]) == {"city": "Oslo"}
    # Qwen3.5 sometimes calls without closing its thinking: <tool_call><function=...> ends it
    p = parse("Thinking about it\n" + call("search", query="q"), reasoning=True)
    assert p.reasoning == "Thinking about it\n" and [c.name for c in p.calls] == ["search"]
    # a <tool_call> mentioned in reasoning, not followed by <function=, stays reasoning
    p = parse("the tag <tool_call> is how I call.</think>ok", reasoning=True)
    assert p.reasoning == "the tag <tool_call> is how I call." and p.content == "ok" and not p.calls


def test_reasoning_without_its_end_is_all_reasoning_and_thinking_off_is_content():
    assert parse("still thinking", reasoning=True).reasoning == "still thinking"
    p = parse("plain answer</think>", reasoning=False, tools=None)
    assert p.content == "plain answer</think>" and p.reasoning == ""
    p = parse("<think>\nhmm\n</think>\n\nanswer", reasoning=False, tools=None)  # the model opens its own
    assert (p.reasoning, p.content) == ("\nhmm\n", "\n\nanswer")
    p = parse("hmm</think>answer", reasoning=True, split_reasoning=False)  # SGLang's separate_reasoning off
    assert (p.reasoning, p.content) == ("", "hmm</think>answer")


@pytest.mark.parametrize("text,why", [
    (call("get_weather", city="Paris")[:-20], "cut off"),  # max_tokens ended it mid-call
    ("<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>", "not a call"),  # Qwen3's JSON form
    (call("delete_everything", path="/"), "not a call"),  # a tool the request did not offer
    ("<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>", "not a call"),
    ("<tool_call>\n<function=search>\nstray text<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
     "not a call"),
    ("<tool_call>\n<function=search>\n<parameter=query>\na\n</parameter>\n<parameter=query>\nb\n</parameter>\n"
     "</function>\n</tool_call>", "not a call"),
])
def test_malformed_or_truncated_calls_stay_content_and_are_logged(caplog, text, why):
    with caplog.at_level(logging.WARNING):
        p = parse("Sure. " + text)
    assert p.calls == [] and p.content == "Sure. " + text
    assert why in caplog.text


def test_a_well_formed_call_after_a_malformed_one_is_still_a_call():
    bad = "<tool_call>\nnot xml\n</tool_call>"
    p = parse(bad + call("search", query="q"))
    assert p.content == bad and [c.name for c in p.calls] == ["search"]


def test_parse_block_names_what_is_wrong():
    with pytest.raises(MalformedToolCall, match="not among the request's tools"):
        parse_block("<function=nope>\n</function>", SCHEMAS)
    with pytest.raises(MalformedToolCall, match="has no name"):
        parse_block("<function=>\n</function>", SCHEMAS)
    assert parse_block("\n<function=noop>\n</function>\n", SCHEMAS).arguments == "{}"


def test_parallel_tool_calls_false_keeps_the_first_call():
    p = parse(call("search", query="a") + call("search", query="b"), max_calls=1)
    assert [args(c) for c in p.calls] == [{"query": "a"}]


def test_no_tools_means_no_parsing_and_blank_content_around_calls_is_dropped():
    text = "\n\n" + call("search", query="q") + "\n"
    assert parse(text, tools=None).content == text
    p = parse(text)
    assert p.content == "" and len(p.calls) == 1
    assert parse("\n\n", tools=SCHEMAS).content == "\n\n"  # blank content without calls stays


ANSWERS = [
    ("Need data.\n</think>\n\nChecking.\n" + call("get_weather", city="Rome", days="2") + "\n"
     + call("search", query="<b>x</b>") + "\nextra", True),
    ("Thinking <tool_call> mention\n" + call("search", query="q"), True),
    ("<think>\nself opened</think>\n\n" + call("noop") + call("get_weather", city="cut")[:-5], False),
    ("plain </thin answer with <tool_ca and < signs", False),
]


@pytest.mark.parametrize("text,reasoning", ANSWERS)
def test_streaming_in_any_split_gives_the_whole_answers_parse(text, reasoning):
    whole = parse(text, reasoning)
    for step in (1, 2, 3, 7, 13):
        parser = OutputParser(reasoning=reasoning, tools=SCHEMAS)
        pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.feed("", final=True)]
        assert "".join(p.reasoning for p in pieces) == whole.reasoning
        assert "".join(p.content for p in pieces) == whole.content
        calls = [c for p in pieces for c in p.calls]
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]


def test_the_parser_holds_back_only_what_could_still_be_a_tag_or_blank_before_a_call():
    parser = OutputParser(reasoning=True, tools=SCHEMAS)
    assert parser.feed("step one, step two </thi").reasoning == "step one, step two "
    assert parser.feed("nk>\n\nThe answer <tool").content == "\n\nThe answer"  # " " waits: a call may follow
    p = parser.feed("_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n")
    assert p.content == "" and p.calls == []  # a call is emitted whole, once its end arrived
    assert [c.name for c in parser.feed("</tool_call>").calls] == ["search"]
