"""Overlapped decode (``graph.overlap``, strategies/ar.py): the next decode step is launched
before this step's tokens reach the host, its input ids gathered from this step's samples on the
device. On the CPU the graph runner reruns steps on its static buffers (test_graph_steps.py), so
the whole flow runs against the reference backend: outputs must equal an engine without overlap,
through stop tokens (wasted rows), page allocation at page boundaries, aborts and arrivals
between steps, with every page and slot released at the end."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import tiny_config
from test_graph_steps import with_graph_runners

from bi_core import EngineConfig, SamplingParams, build_engine


def engine(overlap: bool, preset: str = "tiny-moe", **scheduler):
    cfg = tiny_config(model={"random": {"preset": preset, "seed": 1}}, graph={"overlap": overlap},
                      scheduler={"prefill_chunk_size": 32, **scheduler})
    return with_graph_runners(build_engine(EngineConfig.from_dict(cfg)))


def prompts(n: int = 5):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for length in (9, 30, 17, 44, 3, 25)[:n]]


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-5, rtol=1e-5)


def params_with_stops(plain):
    """Greedy and sampled requests of different lengths; two end on a stop token mid-run (the
    token they drew at steps 3 and 7 without it), so the steps after carry wasted rows."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=5)
              for n, t in zip((20, 33, 12, 26, 18), (0.0, 0.9, 0.0, 0.8, 0.0))]
    params[1] = attrs.evolve(params[1], stop_token_ids=(plain[1].token_ids[3],))
    params[3] = attrs.evolve(params[3], stop_token_ids=(plain[3].token_ids[7],))
    return params


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_overlap_equals_no_overlap(preset):
    ps = prompts()
    base = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=5)
            for n, t in zip((20, 33, 12, 26, 18), (0.0, 0.9, 0.0, 0.8, 0.0))]
    plain = engine(False, preset).generate(ps, base)
    params = params_with_stops(plain)
    ref_eng = engine(False, preset)
    ref = ref_eng.generate(ps, params)
    assert ref_eng.num_ahead == 0
    assert [o.finish_reason for o in ref].count("stop") == 2
    eng = engine(True, preset)
    out = eng.generate(ps, params)
    same(out, ref)
    assert eng.num_ahead > 10, "no decode step was launched ahead"
    assert eng.cache.num_pages_in_use == 0 and eng.cache.slots.num_free == ref_eng.cache.slots.num_free


def test_gather_is_what_feeds_the_next_step():
    """Negative control: with the device gather of the sampled tokens switched off, the steps
    launched ahead read their source row numbers as tokens, and the outputs must change."""
    import bi_core.runtime.graphs.cuda as gr

    ps, params = prompts(), SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = engine(False).generate(ps, params)
    eng = engine(True)
    real = gr.gather_ids
    gr.gather_ids = lambda ids, src, host=None: ids.copy_((-1 - ids).clamp(min=0))  # the row numbers, not their tokens
    try:
        out = eng.generate(ps, params)
    finally:
        gr.gather_ids = real
    assert eng.num_ahead > 0
    assert [o.token_ids for o in out] != [o.token_ids for o in ref]


def test_page_boundaries_in_default_mode():
    """Default mode takes pages as sequences grow: the plan of a step launched ahead takes the
    page a row crosses into (here every 16 tokens); a cache too small to plan falls back to the
    ordinary schedule (which may preempt) and still gives the same outputs."""
    ps = [list(range(1, n + 1)) for n in (14, 15, 16, 31)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = engine(False).generate(ps, params)
    for blocks in (256, 12):
        cfg = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 1}, "max_model_len": 128},
                          graph={"overlap": True},
                          scheduler={"prefill_chunk_size": 32}, cache={"num_blocks": blocks})
        eng = with_graph_runners(build_engine(EngineConfig.from_dict(cfg)))
        plan, taken = eng.scheduler.plan_decode, []

        def spy(continuing, ending, plan=plan, taken=taken):
            before = sum(len(s.blocks) for s in continuing)
            out = plan(continuing, ending)
            taken.append(sum(len(s.blocks) for s in continuing) - before)
            return out

        eng.scheduler.plan_decode = spy
        same(eng.generate(ps, params), ref)
        assert sum(taken) > 0, "no step launched ahead took a page"
        assert eng.num_ahead > 0
        assert eng.cache.num_pages_in_use == 0
        if blocks == 12:
            assert eng.scheduler.num_preemptions > 0


def test_abort_and_arrivals_between_steps():
    """A request aborted while a step holding it is in flight is dropped (its row's output is
    not booked; nothing leaks); one added between steps waits for the next schedule. The others'
    outputs are those of an engine without overlap serving the same calls."""
    ps = prompts(4)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.7, seed=2)
    late = list(range(40, 60))

    def run(overlap: bool):
        eng = engine(overlap)
        seqs = [eng.add_request(p, params) for p in ps]
        for _ in range(6):
            eng.step()
        in_flight = eng.in_flight if overlap else None
        eng.abort(seqs[2].request_id)
        extra = eng.add_request(late, params)
        while eng.scheduler.has_work():
            eng.step()
        return eng, [eng.output_of(s) for s in seqs + [extra]], in_flight

    ref_eng, ref, _ = run(False)
    eng, out, in_flight = run(True)
    assert in_flight and any(s.seq.request_id == 2 for s in in_flight), "the aborted request was not in flight"
    same([o for i, o in enumerate(out) if i != 2], [o for i, o in enumerate(ref) if i != 2])
    assert out[2].finish_reason == "abort" and len(out[2].token_ids) <= len(ref[2].token_ids)
    assert eng.cache.num_pages_in_use == 0 and eng.cache.slots.num_free == ref_eng.cache.slots.num_free


def test_a_gather_of_few_runs_is_a_copy_per_run():
    """``gather_ids`` with the host's packed ids: staged ids in at most ``MAX_RUNS`` runs (position
    and source index both going up by one) are copied run by run (samples [R, 2] or ids [R]), and
    give what the general gather gives; more runs go through the general gather."""
    from bi_core.runtime.batch import MAX_RUNS, gather_ids, staged_runs

    samples = torch.arange(40, dtype=torch.float64).view(20, 2) * 10
    cases = ([-1, -2, -3], [7, -1, -2, -3, 0], [-2, -1, -3], [-1, 5, -3], [4, -1], [3, 4],
             [9, -5, -6, 9, -9, -10, 0, -11, 1, -12, 2, -1, 3, -2])  # the last: six runs
    for host in cases:
        fast, slow = torch.tensor(host + [0]), torch.tensor(host + [0])
        gather_ids(fast, samples, host)
        gather_ids(slow, samples)
        assert torch.equal(fast, slow), host
    assert staged_runs([7, -1, -2, -3, 0]) == [[1, 0, 3]]
    assert staged_runs([9, -5, -6, 5, -1, -2]) == [[1, 4, 2], [4, 0, 2]]
    assert staged_runs([-2, -1]) == [[0, 1, 1], [1, 0, 1]] and staged_runs([3, 4]) == []
    assert len(staged_runs(cases[-1])) > MAX_RUNS
    ids = torch.zeros(2, dtype=torch.int64)
    gather_ids(ids, torch.tensor([11, 12]), [-1, -2])
    assert ids.tolist() == [11, 12]


def test_a_queue_behind_a_full_batch_keeps_decode_overlapped():
    """RL's steady state: more requests than max_num_seqs. While the batch is full and no row ends
    by length, nothing queued can be admitted, so the next decode step is launched ahead anyway
    (before, any queued request stopped it: the host planned every step in series). Admissions
    come where they came without overlap: the outputs are that engine's."""
    ps = prompts(6)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 9, 20, 6, 11, 8)]
    ref = engine(False, max_num_seqs=2).generate(ps, params)
    eng = engine(True, max_num_seqs=2)
    plan, queued_ahead = eng.scheduler.plan_decode, []

    def spy(continuing, ending):
        out = plan(continuing, ending)
        queued_ahead.append(bool(eng.scheduler.waiting) and out is not None)
        return out

    eng.scheduler.plan_decode = spy
    same(eng.generate(ps, params), ref)
    assert sum(queued_ahead) > 10, "no step was launched ahead while requests waited"
    assert eng.cache.num_pages_in_use == 0
