"""Grammar masks as a device input of the batched sampler (``runtime/grammar_masks.py``), on the
reference backend with graph steps rerun on their static buffers and overlapped decode: a
constrained request's rows are drawn again with their masks after the step's device samples, its
steps fly, and its tokens and logprobs are the bits the row-by-row sampler gives the same steps.
Negative controls: every constrained row of a step given the step's first mask, and no masked
draw at all. ``fill_rows``
(xgrammar's batch fill) gives each row its own state's mask, bitwise."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.runtime import grammar_masks
from bi_core.runtime.graphs import CudaGraphRunner
from bi_core.structured import json_schema, regex
from bi_core.structured.grammars import fill_rows

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["ab", "cd", "ef"]}}, "required": ["n", "tag"]}
PROMPTS = [[5, 6, 7, 8], [9, 3, 41, 7, 7, 2, 11], [100, 3], [17, 18, 19, 20, 21]]


def engine(overlap: bool = False):
    """Graph steps rerun on their static buffers (tests/strategies/test_graph_steps.py)."""
    cfg = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 1}}, graph={"overlap": overlap},
                      scheduler={"prefill_chunk_size": 32})
    eng = build_engine(EngineConfig.from_dict(cfg))
    for k in eng.cache.main.k:  # the scratch page is allocated with torch.empty: padding rows read it
        k[eng.cache.scratch_page].zero_()
    eng.runner.main_graphs = CudaGraphRunner(attrs.evolve(eng.runner.spec, use_graphs=True, capture=False))
    return eng


def needle(temperature: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=40, temperature=temperature, seed=41,
                          structured=json_schema(SCHEMA, any_whitespace=False))


def run(params: list[SamplingParams], prompts=PROMPTS, *, device_masks: bool = True, overlap: bool = False):
    eng = engine(overlap)
    eng.strategy.masks_device_samples = device_masks  # False: constrained rows take the row-by-row sampler
    return eng.generate(prompts[:len(params)], params), eng


def others() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=30, ignore_eos=True),
            SamplingParams(max_new_tokens=30, temperature=1.0, seed=5, structured=regex(r"[a-z]{3,30}")),
            SamplingParams(max_new_tokens=30, temperature=0.8, seed=7, ignore_eos=True)]


def same(a, b) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert a.token_logprobs == b.token_logprobs  # float equality: bitwise


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_masked_device_draw_equals_the_row_by_row_samplers_and_flies(temperature):
    """The same steps (one batch, no overlap) with constrained rows drawn on the device and by the
    row-by-row sampler: the same bits; with overlap their steps fly. (The reference backend's
    forward is not batch-invariant: a step's wasted rows change the others' bits, and alone vs in a
    batch is checked on the Triton engine: tests/kernels/test_structured_sampler_interp.py.)"""
    hot, rest = needle(temperature), others()
    batch, eng = run([rest[0], rest[1], hot, rest[2]])
    assert eng.runner.num_masked_rows >= len(batch[2].token_ids)
    row_by_row, eng = run([rest[0], rest[1], hot, rest[2]], device_masks=False)
    assert eng.runner.num_masked_rows == 0
    for a, b in zip(batch, row_by_row):
        same(a, b)
    assert set(json.loads(batch[2].text)) == {"n", "tag"} and batch[2].finish_reason == "stop"
    assert all(c.isascii() and c.islower() for c in batch[1].text)
    flying, eng = run([rest[0], rest[1], hot, rest[2]], overlap=True)
    assert eng.num_ahead > len(flying[2].token_ids) and [o.token_ids for o in flying] == [o.token_ids for o in batch]


def test_negative_controls_one_mask_a_step_and_no_masked_draw(monkeypatch):
    hot, rest = needle(0.9), others()
    params = [rest[0], rest[1], hot, rest[2]]
    good, _ = run(params)
    real = grammar_masks.fill_rows

    def first_mask_for_all(rows, out, threads=0):
        real(rows, out, threads)
        out[1:len(rows)] = out[0]
    monkeypatch.setattr(grammar_masks, "fill_rows", first_mask_for_all)
    (alone,), _ = run([hot], [PROMPTS[2]])  # one constrained row a step: the leak changes nothing
    leaky, _ = run(params)
    assert alone.token_ids == good[2].token_ids and leaky[2].token_ids != good[2].token_ids
    monkeypatch.setattr(grammar_masks.DeviceMasks, "_draw", lambda self, todo, out: None)
    unmasked, _ = run(params)
    assert unmasked[2].token_ids != good[2].token_ids


def test_fill_rows_gives_each_row_its_own_states_mask():
    eng = engine()
    grammars = eng.intake.grammars
    spec = regex(r"(ab|ac)d+")
    states = [grammars.state(spec) for _ in range(4)]
    ids = [[], [ord("a")], [ord("a"), ord("c")], [ord("a"), ord("b"), ord("d"), 256]]  # the last: terminated
    words = (eng.model.args.vocab_size + 31) // 32
    for threads in (1, 2):
        out = torch.full((6, words), 7, dtype=torch.int32)
        fill_rows([(s, i) for s, i in zip(states, ids)], out, threads)
        fresh = [grammars.state(spec) for _ in range(4)]
        for k, (s, i) in enumerate(zip(fresh, ids)):
            assert torch.equal(out[k], s.mask(i)), (threads, k)
        assert (out[4:] == 7).all()  # rows past the batch untouched
    assert not torch.equal(out[0], out[1])


def test_the_warm_up_draws_once_with_an_all_allowed_mask():
    """What the engine's warm-up runs to compile the sampler's masked variant (on a GPU): an
    all-allowed mask draws what no mask does."""
    from bi_core.runtime.warmup import warm_masked_sampler

    eng = engine()
    with torch.inference_mode():
        drawn = warm_masked_sampler(eng)
        logits = eng.model.compute_logits(torch.zeros((1, eng.args.hidden_size)))
        plain = eng.model.sampler.sample_device(logits, torch.zeros(1, dtype=torch.int64),
                                                torch.ones(1, dtype=torch.float64))
    assert drawn.shape == (1, 2) and torch.equal(drawn, plain)
