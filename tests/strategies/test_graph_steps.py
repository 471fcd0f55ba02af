"""The CUDA graph runner's bucketing, padding and static contexts, on the CPU: the runner in
``capture=False`` mode reruns each step on its static buffers instead of replaying a graph, so
everything but the capture itself runs against the reference backend. Decode (L=1), MTP verify
(L=1+N) and MTP head steps (catch-up L=1+N, chain L=1) go through padded buckets; the output must
be AR's, and the padding must land in the scratch page only."""

from __future__ import annotations

import gc
import random

import attrs
import pytest
import torch
from helpers import tiny_config
from test_mtp import N_SPEC, PARAMS, config, hook_for, prompts

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.runtime.graphs import CudaGraphRunner
from bi_core.runtime.runner import mtp_graph_spec


def rerun_runner(spec) -> CudaGraphRunner:
    return CudaGraphRunner(attrs.evolve(spec, use_graphs=True, capture=False))


def with_graph_runners(eng):
    """The engine's model runner with graph runners in rerun mode (main model, and MTP head)."""
    clear_scratch(eng)
    runner = eng.runner
    runner.main_graphs = rerun_runner(runner.spec)
    if runner.mtp_graphs is not None:
        runner.mtp_graphs = rerun_runner(mtp_graph_spec(runner.spec))
    return eng


def clear_scratch(eng) -> None:
    """Zero the scratch page: the cache is allocated with ``torch.empty``, so it may hold garbage
    (NaN included) until a padding row writes it."""
    for k in eng.cache.main.k:
        k[eng.cache.scratch_page].zero_()


def scratch_written(eng) -> bool:
    """A padding row wrote its key at position 0 of the scratch page (cleared by ``with_graph_runners``)."""
    page = eng.cache.scratch_page
    return any(bool(k[page, 0].abs().sum() > 0) for k in eng.cache.main.k)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_padded_decode_steps_equal_eager(preset):
    ps, params = prompts()[:3], PARAMS["sampled"]  # 3 sequences: bucket 4, one padding sequence
    eager = build_engine(config(preset, "ar")).generate(ps, params)
    eng = with_graph_runners(build_engine(config(preset, "ar")))
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    assert eng.runner.main_graphs.num_replays[1] > 0 and (1, 4) in eng.runner.main_graphs.graphs
    assert scratch_written(eng)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_padded_mtp_steps_equal_ar(preset, mode):
    ps, params = prompts()[:3], PARAMS[mode]
    ar = build_engine(config(preset, "ar")).generate(ps, params)
    truth = {i: o.token_ids for i, o in enumerate(ar)}
    eng = with_graph_runners(build_engine(config(preset, "mtp")))
    eng.strategy.draft_hook = hook_for("partial", truth, random.Random(11))
    out = eng.generate(ps, params)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-5, rtol=1e-5)
    verify = 1 + N_SPEC
    assert eng.runner.main_graphs.num_replays[verify] > 0, "verify steps never replayed a graph"
    assert eng.runner.mtp_graphs.num_replays[verify] > 0, "MTP catch-up never replayed a graph"
    assert eng.runner.mtp_graphs.num_replays[1] > 0, "MTP chain steps never replayed a graph"
    assert scratch_written(eng)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_chain_steps_advanced_on_the_device_propose_the_packed_steps_drafts(preset):
    """Draft chain steps after the first advance the last step's graph inputs on the device
    (``ModelRunner.advance_mtp``): the head proposes the same drafts, bitwise, as when every
    chain step is packed on the host. The drafts are what is compared (MTP's output equals AR's
    whatever they are); negative control: drafts from positions not advanced differ."""
    ps, params = prompts()[:3], PARAMS["greedy"]

    def proposals(mode: str) -> tuple[list, int]:
        eng = with_graph_runners(build_engine(config(preset, "mtp")))
        runner, calls, seen = eng.runner, [0], []
        advance = runner.advance_mtp
        if mode == "packed":
            runner.advance_mtp = lambda ids, hidden: None
        else:
            def counted(ids, hidden):
                out = advance(ids, hidden)
                calls[0] += out is not None
                return out
            runner.advance_mtp = counted
            if mode == "stuck":  # positions, slots and context lengths not advanced
                runner.mtp_graphs.advance = lambda ctx: attrs.evolve(ctx, step_tensors={})
        eng.strategy.draft_hook = lambda seq, d: seen.append((seq.request_id, len(seq.output_ids), d)) or d
        eng.generate(ps, params)
        return seen, calls[0]

    packed, _ = proposals("packed")
    advanced, calls = proposals("advanced")
    assert calls > 0 and len(packed) > 3
    assert advanced == packed
    stuck, _ = proposals("stuck")
    assert stuck != packed


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_the_head_launched_behind_the_verify_proposes_the_committed_paths_drafts(preset, mode):
    """Where a verify's samples fly (every request sampled on the device), the head's catch-up and
    draft chain run before the commit, from the verify's device outputs, the chain moved by the
    accept count computed on the device (``MTPStrategy.launch_behind``). Its proposals equal,
    bitwise, those of the head run after the commit (the host path), the output is AR's, and the
    path ran. Drafts are forced right up to a random point, so accept counts vary. Negative
    control: a chain that ignores the accept count proposes other drafts."""
    ps = prompts()[:3]
    params = {"greedy": SamplingParams(max_new_tokens=14, ignore_eos=True),
              "sampled": SamplingParams(max_new_tokens=14, temperature=0.9, seed=77, ignore_eos=True)}[mode]
    ar = build_engine(config(preset, "ar")).generate(ps, params)
    truth = {i: o.token_ids for i, o in enumerate(ar)}

    def proposals(path: str) -> tuple[list, int, list]:
        eng = with_graph_runners(build_engine(config(preset, "mtp")))
        eng.overlap.behind = path != "after commit"
        if path == "ignores the accept count":
            eng.strategy.launch_behind = _ignoring_accepts(eng.strategy)
        forced, seen = hook_for("partial", truth, random.Random(3)), []

        def hook(seq, proposed):
            seen.append((seq.request_id, len(seq.output_ids), proposed))
            return forced(seq, proposed)
        eng.strategy.draft_hook = hook
        out = eng.generate(ps, params)
        return seen, eng.overlap.num_behind, [o.token_ids for o in out]

    after, none_behind, after_tokens = proposals("after commit")
    behind, launched, behind_tokens = proposals("behind the verify")
    assert none_behind == 0 and launched > 3 and len(after) > 6
    assert behind_tokens == after_tokens == [o.token_ids for o in ar]
    assert behind == after
    ignoring, _, ignoring_tokens = proposals("ignores the accept count")
    assert ignoring_tokens == after_tokens  # drafts never change the output...
    assert ignoring != after  # ...but these are not the head's drafts


def test_a_stop_token_inside_drafts_run_behind_ends_the_sequence_as_ar_does():
    """A sequence that a stop token ends inside a verify whose head already ran behind it: its
    output stops where AR's does (accepted drafts past the stop are dropped), the others go on,
    and no drafts are kept for it."""
    ps = prompts()[:3]
    free = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ar_free = build_engine(config("tiny-dense", "ar")).generate(ps, free)
    stop = ar_free[1].token_ids[4]  # ends request 1 at its 5th token (others where it occurs)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True, stop_token_ids=[stop])
    ar = build_engine(config("tiny-dense", "ar")).generate(ps, params)
    assert len(ar[1].token_ids) <= 5 and any(len(o.token_ids) == 14 for o in ar)
    truth = {i: o.token_ids for i, o in enumerate(ar_free)}  # drafts run past the stop token
    eng = with_graph_runners(build_engine(config("tiny-dense", "mtp")))
    eng.strategy.draft_hook = lambda seq, d: truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + len(d)]
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert eng.overlap.num_behind > 0 and not eng.strategy.drafts


def _ignoring_accepts(strategy):
    """``launch_behind`` with every accept count read as 0 (the negative control)."""
    import bi_core.strategies.mtp as mtp

    def launch(plan, out):
        real = mtp.accepted_on_device
        mtp.accepted_on_device = lambda drafts, sampled: torch.zeros_like(real(drafts, sampled))
        try:
            return type(strategy).launch_behind(strategy, plan, out)
        finally:
            mtp.accepted_on_device = real
    return launch


def test_mirror_check_reads_device_lengths_where_the_host_has_none():
    """A draft chain moved on a GPU by a device-side accept count has no host mirror of its
    context lengths (``CudaGraphRunner.shift``); the rerun stand-in's mirror check then
    checks the block table against the device lengths instead of failing on None (the kernels'
    engine test on a GPU hit that). Negative control: a block table that disagrees still fails."""
    from bi_core.runtime.batch import build_context
    from bi_core.runtime.graphs.cuda import check_mirrors

    _, ctx = build_context([[5], [6]], [20, 3], [[4, 9], [7]], [0, 1], [True, True], block_size=16,
                           device=torch.device("cpu"))
    unknown = attrs.evolve(ctx, context_lens_host=None)
    check_mirrors(unknown)
    unknown.block_tables[0, 1] = 8
    with pytest.raises(AssertionError, match="block_tables"):
        check_mirrors(unknown)


def test_short_drafts_are_padded_to_a_uniform_verify():
    """Drafts cut short (here: at most one draft) still verify as 1+N rows per sequence, and only
    the real drafts are sampled and counted."""
    ps, params = prompts()[:2], PARAMS["greedy"]
    ar = build_engine(config("tiny-dense", "ar")).generate(ps, params)
    truth = {i: o.token_ids for i, o in enumerate(ar)}
    eng = with_graph_runners(build_engine(config("tiny-dense", "mtp")))
    eng.strategy.draft_hook = lambda seq, d: truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + 1]
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert all(o.num_accepted_draft_tokens == o.num_draft_tokens > 0 for o in out)
    assert eng.runner.main_graphs.num_replays[1 + N_SPEC] > 0


def test_random_scenarios_equal_ar():
    """Random mixes: N=1..4, dense/MoE, 1..9 prompts of 1..60 tokens, 1..20 new tokens (drafts cut
    by max_new_tokens), EOS on or off, greedy or sampled, a KV cache small enough to preempt
    (default mode recomputes), graph runners in rerun mode or eager; MTP output == AR output."""
    preemptions = replays = 0
    for trial in range(14):
        rng = random.Random(trial)
        n, preset = rng.randint(1, 4), rng.choice(["tiny-dense", "tiny-moe"])
        ps = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 9))]
        params = [SamplingParams(max_new_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.7,
                                 temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(100)) for _ in ps]

        def cfg(strategy, blocks, n=n, preset=preset):
            strat = {"name": "mtp", "num_speculative_tokens": n} if strategy == "mtp" else {"name": "ar"}
            return EngineConfig.from_dict(tiny_config(
                model={"random": {"preset": preset, "seed": 1}, "max_model_len": 128}, strategy=strat,
                scheduler={"prefill_chunk_size": 16, "max_num_seqs": 6, "max_num_batched_tokens": 48},
                cache={"num_blocks": blocks}))

        ar = build_engine(cfg("ar", 256)).generate(ps, params)
        eng = build_engine(cfg("mtp", rng.choice([10, 14, 256])))
        if rng.random() < 0.7:
            with_graph_runners(eng)
        truth, cuts = {i: o.token_ids for i, o in enumerate(ar)}, random.Random(trial + 100)

        def hook(seq, d, truth=truth, cuts=cuts):
            right = truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + len(d)]
            cut = cuts.randint(0, len(right))
            return right[:cut] + [(t + 1) % 260 for t in right[cut:]]

        eng.strategy.draft_hook = hook
        out = eng.generate(ps, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ar], trial
        preemptions += eng.scheduler.num_preemptions
        replays += sum(getattr(eng.runner.main_graphs, "num_replays", {0: 0}).values())
    assert preemptions > 0 and replays > 0  # the mix covered recompute and graph replays


def test_only_uniform_recurrent_steps_replay():
    """Graph keys: (L, smallest bucket >= B) for uniform recurrent steps with a captured L; any
    other step (prefill rows, mixed lengths, another L, more sequences than the largest bucket,
    a different state ring) runs eagerly."""
    from bi_core.runtime.batch import plan_batch
    from bi_core.runtime.graphs.static_batch import buckets

    eng = build_engine(config("tiny-dense", "mtp"))
    runner = rerun_runner(eng.runner.spec)  # query_lens (1, 4), max bucket 8, ring 4
    assert buckets(8) == [1, 2, 4, 8] and buckets(40) == [1, 2, 4, 8, 16, 32, 40]

    def key(lens, recurrent=True, ring=4):
        hb = plan_batch([[1] * q for q in lens], [5] * len(lens), [[0]] * len(lens), list(range(len(lens))),
                        [recurrent] * len(lens), block_size=16, ring=ring)
        return runner.graph_key(hb)

    assert key([1]) == (1, 1) and key([4, 4, 4]) == (4, 4) and key([1] * 5) == (1, 8)
    assert key([4, 1]) is None and key([2, 2]) is None and key([1] * 9) is None
    assert key([4, 4], recurrent=False) is None and key([1], ring=1) is None


@pytest.mark.parametrize("strategy", ["ar", "mtp"])
def test_warm_up_captures_every_bucket_and_changes_no_output(strategy):
    """The start-up warm-up (bi_core/runtime/warmup.py) captures every (L, bucket) graph of both
    runners before any request, runs its dummy prompts, and leaves nothing behind: outputs equal
    an engine that never warmed up, and no graph is captured while requests run; its end freezes
    the start's objects out of the cyclic GC."""
    from bi_core.runtime.graphs.static_batch import buckets
    from bi_core.runtime.warmup import warm_up

    ps, params = prompts()[:3], PARAMS["sampled"]
    cold = with_graph_runners(build_engine(config("tiny-moe", strategy))).generate(ps, params)
    eng = with_graph_runners(build_engine(config("tiny-moe", strategy)))
    try:
        report = warm_up(eng)
        # the start's objects leave the cyclic GC (runtime/gc_heap.py); nothing else in the
        # suite freezes, so a count of 0 here means the warm-up no longer does
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    runners = [eng.runner.main_graphs] + ([eng.runner.mtp_graphs] if strategy == "mtp" else [])
    want = {(q, b) for q in eng.runner.spec.query_lens for b in buckets(eng.runner.spec.max_batch_size)}
    assert all(set(r.graphs) == want for r in runners)
    assert report.graphs == len(want) * len(runners) and report.prompts > 0
    assert not eng.requests and eng.num_prompt_tokens_computed == 0
    captured = [dict(r.graphs) for r in runners]
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in cold]
    for a, b in zip(out, cold):
        torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-5, rtol=1e-5)
    assert all(r.graphs == c for r, c in zip(runners, captured)), "a graph was captured while requests ran"
