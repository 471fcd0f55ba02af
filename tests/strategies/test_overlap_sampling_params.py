"""Overlapped decode with penalties and min_tokens: a step whose rows adjust their logits is
sampled by the row-by-row sampler, not by the step's device samples, so its tokens never fly; a
request past its min_tokens flies again; a grammar's rows fly (masked on the device). Outputs equal an engine without overlap. Negative control:
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
    monkeypatch.setattr(overlap, "device_sampled", lambda seqs, masked=False: True)
    with pytest.raises(AssertionError):
        same(engine(True).generate(ps, PARAMS), ref)


def test_overlap_with_a_grammar_equals_no_overlap_and_flies(monkeypatch):
    """A structured output's rows are drawn again on the device with their grammar masks
    (``runtime/grammar_masks.py``) before the step's samples fly, so its steps fly and launch the
    next ahead like plain ones, with the tokens of an engine without overlap; negative control:
    skipping that masked draw takes the unmasked device samples, and the output no longer matches."""
    from bi_core.runtime.grammar_masks import DeviceMasks
    from bi_core.structured import regex

    ps = prompts(3)
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=4, structured=regex(r"[a-f]{12}")),
              SamplingParams(max_new_tokens=24, ignore_eos=True), SamplingParams(max_new_tokens=30, ignore_eos=True)]
    ref = engine(False).generate(ps, params)
    eng = engine(True)
    flown, launch = [], eng.overlap.launch_next

    def launch_next(plan, out):  # records whether a step with a constrained row flew
        landed = launch(plan, out)
        flown.append(landed is not None and any(r.seq.grammar is not None for r in plan.forward.rows))
        return landed

    eng.overlap.launch_next = launch_next
    same(eng.generate(ps, params), ref)
    assert eng.num_ahead > 0 and sum(flown) >= 5 and eng.runner.num_masked_rows >= 10
    assert all(c in "abcdef" for c in ref[0].text) and len(ref[0].text) == 12
    monkeypatch.setattr(DeviceMasks, "_draw", lambda self, todo, out: None)
    with pytest.raises(AssertionError):
        same(engine(True).generate(ps, params), ref)
