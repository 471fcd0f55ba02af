"""SamplingParams checks: a bad value is one RequestError naming the field (never a TypeError, never
a silently accepted value), and stop token ids outside the vocabulary are refused when added."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_config

from bi_core import EngineConfig, RequestError, SamplingParams, build_engine


def test_stop_token_ids_take_one_id_or_a_list_of_ints():
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=[5, np.int64(7)]).stop_token_ids == (5, 7)
    assert all(type(t) is int for t in SamplingParams(stop_token_ids=np.array([1, 2])).stop_token_ids)
    for bad in ("5", 5.0, True, [1, True], [1, 2.5], None, b"ab"):
        with pytest.raises(RequestError, match="SamplingParams: stop_token_ids must be"):
            SamplingParams(stop_token_ids=bad)


def test_stop_must_be_strings():
    assert SamplingParams(stop="ab").stop == ("ab",)
    for bad in (5, [1], ["a", None]):
        with pytest.raises(RequestError, match="SamplingParams: stop must be"):
            SamplingParams(stop=bad)


@pytest.mark.parametrize("field,value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", "0.5"), ("temperature", True),
    ("top_p", float("nan")), ("top_p", "1"),
    ("seed", 2**64), ("seed", -1), ("seed", True), ("seed", 1.0),
    ("n", True), ("max_new_tokens", 2.0), ("top_k", True), ("logprobs", True), ("prompt_logprobs", 21),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("return_routed_experts", None),
    ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("frequency_penalty", "1"),
    ("min_tokens", -1), ("min_tokens", 1.0),
])
def test_bad_values_are_one_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})


def test_min_tokens_at_most_max_new_tokens():
    assert SamplingParams(min_tokens=16, max_new_tokens=16).min_tokens == 16
    with pytest.raises(RequestError, match=r"min_tokens \(17\) must be at most max_new_tokens \(16\)"):
        SamplingParams(min_tokens=17, max_new_tokens=16)


def test_edge_values_are_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    p = SamplingParams(temperature=2, top_p=1, logprobs=np.int32(20), seed=np.uint64(3))
    assert type(p.seed) is int and type(p.logprobs) is int  # numpy's would overflow when seeds are mixed


def test_stop_token_ids_outside_the_vocabulary_are_refused_when_added():
    e = build_engine(EngineConfig.from_dict(tiny_config()))
    message = r"stop_token_ids has ids outside the vocabulary \[0, 260\): \[260, -1\]"
    with pytest.raises(RequestError, match=message):
        e.add_request([1, 2], SamplingParams(stop_token_ids=[5, 260, -1]))
    with pytest.raises(RequestError, match=message):
        e.add_request([1, 2], SamplingParams(n=3, stop_token_ids=[5, 260, -1]))
    bad, good = e.generate([[1, 2], [3, 4]], [SamplingParams(n=2, stop_token_ids=[260, -1]),
                                             SamplingParams(max_new_tokens=2, stop_token_ids=259)])
    assert bad.finish_reason == "error" and "[0, 260): [260, -1]" in bad.error
    assert good.finish_reason in ("stop", "length") and good.error is None
