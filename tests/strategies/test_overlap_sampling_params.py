"""Overlapped decode with penalties and min_tokens: a step whose rows adjust their logits is
sampled by the row-by-row sampler, not by the step's device samples, so its tokens never fly; a
request past its min_tokens flies again. Outputs equal an engine without overlap. Negative control:
letting such rows fly (their device samples taken as the tokens) changes the outputs."""

from __future__ import annotations

import pytest
from test_overlap import engine, prompts, same

import bi_core.runtime.overlap as overlap
from bi_core import SamplingParams

PARAMS = [SamplingParams(max_new_tokens=24, ignore_eos=True, min_tokens=6, stop_token_ids=(3,)),
          SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=5, min_tokens=10),
          SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-1.0)]


def test_overlap_with_penalties_and_min_tokens_equals_no_overlap():
    ps = prompts(3)
    ref = engine(False).generate(ps, PARAMS)
    eng = engine(True)
    same(eng.generate(ps, PARAMS), ref)
    # the penalized request keeps every step of the three eager; the others fly past min_tokens alone
    alone = engine(True)
    same(alone.generate(ps[:2], PARAMS[:2]), ref[:2])
    assert alone.num_ahead > 0


def test_negative_control_adjusted_rows_flying(monkeypatch):
    ps = prompts(3)
    ref = engine(False).generate(ps, PARAMS)
    monkeypatch.setattr(overlap, "device_sampled", lambda seqs: True)
    with pytest.raises(AssertionError):
        same(engine(True).generate(ps, PARAMS), ref)
