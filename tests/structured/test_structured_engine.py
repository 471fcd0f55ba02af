"""Structured outputs through the engine (the embedded random-weight model, reference backend):
JSON-schema, JSON-object, regex, choice and grammar outputs are valid for many seeds, and so are
required and named Qwen3.5 XML tool calls (parsed, parameters validated against their schemas);
the request ends where its grammar ends; logprobs are raw by default and of the masked
distribution on request; n samples and preempted sequences keep their own grammar state; grammars
compile once per spec; a bad grammar or a missing xgrammar is one RequestError."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.ops.sampling import sample_seed
from bi_core.structured import choice, grammar, json_object, json_schema, regex, tool_call_spec

SEEDS = range(12)
PROMPT = [5, 6, 7, 8]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["id", "name", "color", "ok", "tags", "point"],
    "additionalProperties": False,
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                     "top": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query"]}}}


@pytest.fixture(scope="module")
def eng():
    return build_engine(EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 16})))


def sampled(spec, seed, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 300), temperature=1.0, seed=seed, structured=spec,
                          **kw)


def test_json_schema_outputs_validate_for_many_seeds(eng):
    outs = eng.generate([PROMPT] * len(SEEDS), [sampled(json_schema(SCHEMA), s) for s in SEEDS])
    for o in outs:
        assert o.finish_reason == "stop" and o.stop_reason == 256, o.text  # the grammar's end: EOS
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > len(SEEDS) // 2  # the draws differ: the mask is not one fixed path
    compact = eng.generate([PROMPT] * 4, [sampled(json_schema(SCHEMA, any_whitespace=False), s) for s in range(4)])
    for o in compact:
        assert json.dumps(json.loads(o.text), separators=(",", ":")) == o.text


def test_json_object_regex_choice_and_grammars_for_many_seeds(eng):
    cases = [
        (json_object(any_whitespace=False), lambda t: isinstance(json.loads(t), dict)),
        (regex(r"[A-Z][a-z]{1,5}-(19|20)\d\d"), lambda t: re.fullmatch(r"[A-Z][a-z]{1,5}-(19|20)\d\d", t)),
        (choice(["yes", "no", "a \"quoted\"\nline"]), lambda t: t in ("yes", "no", "a \"quoted\"\nline")),
        (grammar('root ::= "(" digit ("," digit){0,3} ")"\ndigit ::= [0-9]'), lambda t: re.fullmatch(r"\(\d(,\d){0,3}\)", t)),
        (grammar('start: "x" ("+" DIGIT)*\nDIGIT: /[0-9]/'), lambda t: re.fullmatch(r"x(\+\d)*", t)),  # Lark
    ]
    for spec, valid in cases:
        outs = eng.generate([PROMPT] * len(SEEDS), [sampled(spec, s) for s in SEEDS])
        stopped = [o for o in outs if o.finish_reason == "stop"]
        assert len(stopped) >= len(SEEDS) - 2, (spec.kind, [o.text for o in outs])  # JSON objects may nest deep
        for o in stopped:
            assert valid(o.text), (spec, o.text)


def test_the_request_ends_where_its_grammar_ends_even_with_ignore_eos(eng):
    out, = eng.generate([PROMPT], SamplingParams(max_new_tokens=50, ignore_eos=True, structured=choice(["done"])))
    assert out.text == "done" and out.finish_reason == "stop" and out.token_ids[-1] == 256  # EOS, the grammar's end
    plain, = eng.generate([PROMPT], SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert plain.finish_reason == "length"


def parse_tool_calls(text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    """Qwen3.5 XML tool calls, strictly: only calls (whitespace between them), each
    ``<tool_call>\\n<function=NAME>\\n`` parameters ``\\n</function>\\n</tool_call>``, a value
    stripped of the whitespace around it and typed by the function's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    call = re.compile(r"<tool_call>\n<function=([A-Za-z0-9_]+)>\n(.*?)\n</function>\n</tool_call>", re.S)
    calls, end = [], 0
    for m in call.finditer(text):
        assert not text[end:m.start()].strip(), f"text outside the calls: {text[end:m.start()]!r}"
        name, body = m.group(1), m.group(2)
        params, rest = {}, body
        for p in re.finditer(r"<parameter=([A-Za-z0-9_]+)>(.*?)</parameter>", body, re.S):
            rest = rest.replace(p.group(0), "", 1)
            schema = schemas[name]["properties"][p.group(1)]
            raw = p.group(2).strip()
            params[p.group(1)] = raw if schema.get("type") == "string" or "enum" in schema and \
                all(isinstance(e, str) for e in schema["enum"]) else json.loads(raw)
        assert not rest.strip(), f"stray text in a call: {rest!r}"
        calls.append((name, params))
        end = m.end()
    assert not text[end:].strip() and calls, text
    return calls


@pytest.mark.parametrize("choice_, parallel", [("required", False), ("required", True),
                                              ({"type": "function", "function": {"name": "search"}}, True)])
def test_required_and_named_tool_calls_are_valid_for_many_seeds(eng, choice_, parallel):
    tools = [WEATHER, SEARCH]
    spec = tool_call_spec(tools, choice_, parallel_tool_calls=parallel)
    outs = eng.generate([PROMPT] * len(SEEDS), [sampled(spec, s, max_new_tokens=500) for s in SEEDS])
    names = set()
    for o in outs:
        assert o.finish_reason == "stop", o.text
        calls = parse_tool_calls(o.text, tools)
        assert parallel or len(calls) == 1
        for name, params in calls:
            fn = next(t["function"] for t in tools if t["function"]["name"] == name)
            jsonschema.validate(params, fn["parameters"])
            names.add(name)
    assert names == ({"search"} if isinstance(choice_, dict) else {"get_weather", "search"})


def test_tool_choice_none_and_auto_constrain_nothing_and_bad_choices_are_refused():
    assert tool_call_spec([WEATHER], "none") is None and tool_call_spec([WEATHER], "auto") is None
    with pytest.raises(RequestError, match="names function 'nope', which is not among the tools"):
        tool_call_spec([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestError, match="needs tools"):
        tool_call_spec([], "required")
    with pytest.raises(RequestError, match=r"tools\[0\].function.name must be a non-empty string"):
        tool_call_spec([{"type": "function", "function": {}}], "required")
    # descriptions change no grammar: the same cache key
    plain = {"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "description"}}
    assert tool_call_spec([WEATHER], "required") == tool_call_spec([plain], "required")


def test_logprobs_are_raw_by_default_and_masked_on_request(eng):
    seen = []
    eng.runner.on_logits = lambda seqs, logits: seen.append(logits[0].float().clone())
    try:
        kw = dict(max_new_tokens=8, temperature=0.7, seed=3, logprobs=5, structured=regex(r"[ab]{8}"))
        raw, = eng.generate([PROMPT], SamplingParams(**kw))
        n_raw = len(seen)
        hot, = eng.generate([PROMPT], SamplingParams(**kw, masked_logprobs=True))
    finally:
        eng.runner.on_logits = None
    assert raw.token_ids == hot.token_ids and set(raw.text) <= {"a", "b"}
    allowed = torch.zeros(seen[0].shape[0], dtype=torch.bool)
    allowed[[ord("a"), ord("b")]] = True
    for j, t in enumerate(raw.token_ids):
        want_raw = torch.log_softmax(seen[j], dim=-1)[t].item()
        want_masked = torch.log_softmax(seen[n_raw + j].masked_fill(~allowed, float("-inf")), dim=-1)[t].item()
        assert raw.token_logprobs[j] == pytest.approx(want_raw, abs=1e-5)
        assert hot.token_logprobs[j] == pytest.approx(want_masked, abs=1e-5) and hot.token_logprobs[j] > want_raw
        assert set(hot.logprobs[j]) <= {ord("a"), ord("b")}  # top-5 of two allowed tokens: those two
        assert len(raw.logprobs[j]) >= 5


def test_n_samples_each_keep_their_own_grammar_state(eng):
    spec = json_schema(SCHEMA)
    group, = eng.generate([PROMPT], SamplingParams(max_new_tokens=300, temperature=1.0, seed=9, n=3, structured=spec))
    for i, s in enumerate(group.outputs):
        alone, = eng.generate([PROMPT], sampled(spec, sample_seed(9, i)))
        assert s.token_ids == alone.token_ids and s.finish_reason == "stop"
        jsonschema.validate(json.loads(s.text), SCHEMA)
    assert len({s.text for s in group.outputs}) > 1


def test_preempted_sequences_rebuild_their_grammar_state():
    """A cache too small for all six: preempted requests resume with the grammar state their
    tokens give (greedy: the roomy engine's tokens)."""
    ps = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate([100, 120, 90, 100, 120, 90])]
    params = SamplingParams(max_new_tokens=40, structured=regex(r"[a-z ]{40}"))
    roomy = build_engine(EngineConfig.from_dict(tiny_config())).generate(ps, params)
    tight_engine = build_engine(EngineConfig.from_dict(tiny_config(cache={"num_blocks": 33})))
    tight = tight_engine.generate(ps, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(re.fullmatch(r"[a-z ]{40}", o.text) for o in tight)


def test_a_grammar_compiles_once_per_spec(eng):
    before = eng.intake.grammars.num_compiled
    spec = json_schema({"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"]})
    eng.generate([PROMPT] * 3, [sampled(spec, s) for s in range(3)])
    eng.generate([PROMPT], sampled(json_schema({"type": "object", "properties": {"k": {"enum": ["v", "w"]}},
                                                "required": ["k"]}), 5))
    assert eng.intake.grammars.num_compiled == before + 1


def test_a_bad_grammar_is_one_request_error_before_the_request_gets_an_id(eng):
    next_id = eng.intake.next_id
    for spec, message in [(json_schema({"type": "nope"}), "the json schema does not compile: Unsupported type"),
                          (regex("[a-"), "the regex does not compile: Regex parsing error"),
                          (grammar('root ::= "a'), "the grammar does not compile: EBNF lexer error")]:
        with pytest.raises(RequestError, match=message):
            eng.add_request(PROMPT, SamplingParams(structured=spec))
    assert eng.intake.next_id == next_id
    with pytest.raises(RequestError, match="not valid JSON"):
        json_schema("{not json")
    with pytest.raises(RequestError, match="min_tokens must be 0 with structured outputs"):
        SamplingParams(min_tokens=2, structured=json_object())


def test_without_xgrammar_a_structured_request_names_the_extra(monkeypatch):
    e = build_engine(EngineConfig.from_dict(tiny_config()))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now fails
    with pytest.raises(RequestError, match=r"optional package xgrammar.*pip install 'bi-engine\[structured\]'"):
        e.add_request(PROMPT, SamplingParams(structured=json_object()))
    assert e.generate([PROMPT], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"  # the rest works


def test_the_grammar_state_follows_the_tokens_it_is_given(eng):
    """A state replays whatever tokens it is given: caught up incrementally, or rebuilt from the
    start when they are not the ones it saw (a rollback), the same masks either way."""
    grammars = eng.intake.grammars
    spec = regex(r"(ab|ac)d+")
    a, b = grammars.state(spec), grammars.state(spec)
    a.mask([ord("a")])
    a.mask([ord("a"), ord("b")])
    assert torch.equal(a.mask([ord("a"), ord("c")]), b.mask([ord("a"), ord("c")]))  # rolled back, replayed
    assert torch.equal(a.mask([ord("a")], before=[ord("b")]), b.mask([ord("a"), ord("b")]))  # a draft, on a copy
    assert torch.equal(a.mask([ord("a")]), b.mask([ord("a")]))  # the draft left the state alone
    assert not a.ended_by([ord("a"), ord("b"), ord("d")]) and a.ended_by([ord("a"), ord("b"), ord("d"), 256])


def test_the_grammar_vocabulary_leaves_special_tokens_out(tmp_path):
    """A special token (whose text skip_special_tokens drops) is never matched by a grammar, so the
    text holds what the grammar matched; an added token that is not special (Qwen's <tool_call>)
    is matched as its text; ids past the tokenizer (the embedding's padding) never."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from bi_core.models.tokenizer import HFTokenizer
    from bi_core.structured.grammars import vocabulary

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["a tool call"] * 5, trainer)
    bpe.add_tokens([AddedToken("<tool_call>", special=False)])
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>").save_pretrained(str(tmp_path))
    tok = HFTokenizer(tmp_path)
    end, call = (tok._tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<tool_call>"))
    vocab = vocabulary(tok, len(tok._tok) + 3)
    assert vocab[end] == b"" and vocab[call] == b"<tool_call>" and vocab[-3:] == [b"", b"", b""]
    assert vocab[tok.encode("a")[0]] == b"a"
