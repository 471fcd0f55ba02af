"""Structured outputs on the GPU, 35B-A3B shape at 4 layers, invariant backend, graphs and
overlapped decode on, grammars over a Qwen3.5-sized vocabulary (``structured_bench``'s): a
JSON-schema request gives the same tokens and logprobs alone and among 255 unconstrained and
constrained requests (G1, bitwise), greedy and seeded, with its masks applied on the device (the
batched sampler after the step's graph) and with a top-N-logprobs request beside it (every step
on the row-by-row sampler); negative control: every constrained row of a step masked with the
step's first one's mask. MTP under a grammar emits AR's tokens and logprobs bitwise, with forced
drafts; negative control: verify rows masked without the drafts before them."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from helpers import benchmark_module
from test_engine_gpu import gpu_config

from bi_core import SamplingParams, build_engine
from bi_core.runtime import grammar_masks
from bi_core.structured import json_schema, regex

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["ab", "cd", "ef"]}, "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"], "additionalProperties": False}
CROWD = 255


@functools.cache
def bench():
    return benchmark_module("structured_bench")


@functools.cache
def vocab_tokens() -> list[bytes]:
    return bench().vocabulary()[0]


def engine(strategy: str = "ar", max_seqs: int = CROWD + 1):
    strat = {"name": "mtp", "num_speculative_tokens": 3} if strategy == "mtp" else {"name": "ar"}
    cfg = gpu_config("cuda_hopper_invariant", "qwen3.5-35b-a3b", layers=4, graphs=True, invariant=True,
                     strategy=strat)
    cfg = cfg.replace(scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": 8192},
                      cache={"num_blocks": 4096, "prefix_caching": False}, graph={"overlap": True})
    eng = build_engine(cfg)
    bench().with_vocabulary(eng, smoke=False)
    return eng


def text_of(ids: list[int]) -> str:
    return b"".join(vocab_tokens()[i] for i in ids).decode("utf-8", errors="replace")


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 64, (n,), generator=g).tolist()
    return [torch.randint(0, bench().SPECIAL_START, (m,), generator=g).tolist() for m in lens]


def fillers(seed: int, top_n: bool) -> list[SamplingParams]:
    """Unconstrained, same-schema and regex requests, seeded; with ``top_n`` the first wants top-2
    logprobs and outlives the needle (every step then takes the row-by-row sampler)."""
    out = []
    for i in range(CROWD):
        kind = i % 3
        if kind == 0:
            out.append(SamplingParams(max_new_tokens=24, temperature=0.9, seed=seed + i, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_new_tokens=48, temperature=1.0, seed=seed + i,
                                      structured=json_schema(SCHEMA, any_whitespace=False)))
        else:
            out.append(SamplingParams(max_new_tokens=24, temperature=0.8, seed=seed + i, structured=regex(r"[a-z]{4,24}")))
    if top_n:
        out[0] = SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=2)
    return out


def needle_run(eng, needle, params, crowd: list[SamplingParams]):
    """The needle's (tokens, logprobs), joining while half the crowd already runs."""
    ps = random_prompts(len(crowd), seed=len(crowd) + 1)
    half = len(crowd) // 2
    for p, c in zip(ps[:half], crowd[:half]):
        eng.add_request(p, c)
    eng.step()
    n = eng.add_request(needle, params)
    for p, c in zip(ps[half:], crowd[half:]):
        eng.add_request(p, c)
    while eng.scheduler.has_work():
        eng.step()
    assert n.finish_reason == "stop", (n.finish_reason, n.error)
    return n.output_ids, n.token_logprobs


@pytest.fixture(scope="module")
def ar_engine():
    """One AR engine for the module (prefix caching off: runs share nothing but the graphs)."""
    return engine()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_request_alone_and_among_255_bitwise(ar_engine, temperature, monkeypatch):
    params = SamplingParams(max_new_tokens=48, temperature=temperature, seed=11,
                            structured=json_schema(SCHEMA, any_whitespace=False))
    needle = random_prompts(1, seed=99)[0]
    eng = ar_engine
    alone = needle_run(eng, needle, params, [])
    doc = json.loads(text_of(alone[0][:-1]))  # the last token: EOS, where the grammar ends
    assert set(doc) == {"n", "tag", "ok"}
    masked = eng.runner.num_masked_rows
    assert masked >= len(alone[0]) - 1
    assert needle_run(eng, needle, params, fillers(7, top_n=False)) == alone
    assert eng.runner.num_masked_rows - masked > CROWD  # the crowd's constrained rows too, on the device
    masked = eng.runner.num_masked_rows
    assert needle_run(eng, needle, params, fillers(8, top_n=True)) == alone
    assert eng.runner.num_masked_rows == masked  # the row-by-row sampler drew every constrained row
    real = grammar_masks.fill_rows

    def first_mask_for_all(rows, out, threads=0):
        real(rows, out, threads)
        out[1:len(rows)] = out[0]
    monkeypatch.setattr(grammar_masks, "fill_rows", first_mask_for_all)
    leaky = eng
    crowd = fillers(7, top_n=False)
    crowd = [c if c.structured is None else SamplingParams(
        max_new_tokens=48, temperature=1.0, seed=c.seed, structured=regex(r"[a-z]{4,24}")) for c in crowd]
    try:
        got = needle_run(leaky, needle, params, crowd)
    except AssertionError:  # the needle drew a token its grammar refuses: it ended with an error
        got = None
    assert got != alone


def test_mtp_equals_ar_under_a_grammar_bitwise(ar_engine):
    """Forced drafts (right with probability 0.7): each verify row masked with the grammar state
    after the drafts before it; the tokens and logprobs are AR's, bitwise. Negative control: verify
    rows masked with the state before the step's drafts."""
    ps = random_prompts(12, seed=5)
    params = [SamplingParams(max_new_tokens=40, temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
                             structured=json_schema(SCHEMA, any_whitespace=False) if i % 2 == 0
                             else regex(r"([a-d]{2}-)+\d")) for i in range(len(ps))]
    params[5] = SamplingParams(max_new_tokens=30, temperature=0.8, seed=5, ignore_eos=True)  # one unconstrained
    ar = ar_engine.generate(ps, params)
    truth = {i: o.token_ids for i, o in enumerate(ar)}  # by the request's place (ids differ between engines)
    assert sum(o.finish_reason == "stop" for o in ar) >= 6
    eng = engine("mtp", max_seqs=16)

    def run(drafts_before: bool):
        rng, first = random.Random(3), eng.intake.next_id
        eng.strategy.draft_hook = lambda seq, d: [
            t if rng.random() < 0.7 else (t + 1) % bench().SPECIAL_START
            for t in truth[seq.request_id - first][len(seq.output_ids):][:len(d)]]
        if not drafts_before:
            sample = eng.runner.sample
            eng.runner.sample = lambda seqs, positions, logits, samples=None, before=None, masked=False: sample(
                seqs, positions, logits, samples, masked=masked)
        return eng.generate(ps, params)

    out = run(True)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids and m.token_logprobs == a.token_logprobs and m.finish_reason == a.finish_reason
    assert sum(o.num_accepted_draft_tokens for o in out) > 0
    assert any(m.token_ids != a.token_ids for a, m in zip(ar, run(False)))
