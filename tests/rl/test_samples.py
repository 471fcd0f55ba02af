"""n samples per prompt: one prefill, pages shared, the last prompt page and the GDN state copied,
each sample keyed by sample_seed(seed, i). On the reference backend a sample matches the same
request sent alone in tokens and to float tolerance in logprobs; bitwise on the GPU
(tests/gpu/test_rl_gpu.py)."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import RequestError
from bi_core.ops.sampling import sample_seed

PROMPT = [(7 * j) % 250 + 1 for j in range(41)]  # 41 tokens: two shared 16-token pages, the third copied


def engine(max_model_len: int = 512, **overrides):
    cfg = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 0}, "max_model_len": max_model_len},
                      scheduler={"max_num_batched_tokens": 64, "prefill_chunk_size": 16}, **overrides)
    return build_engine(EngineConfig.from_dict(cfg))


def prompt_tokens_run(eng) -> dict[int, int]:
    """Prompt tokens the main model runs for each request from now on."""
    counts: dict[int, int] = {}
    execute = eng.runner.execute

    def spy(fwd, **kw):
        for r in fwd.rows:
            if fwd.head == "model" and r.start < len(r.seq.prompt_ids):
                counts[r.seq.request_id] = counts.get(r.seq.request_id, 0) + min(len(r.tokens),
                                                                                 len(r.seq.prompt_ids) - r.start)
        return execute(fwd, **kw)

    eng.runner.execute = spy
    return counts


def assert_same(got, want):
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs), atol=2e-5, rtol=0)


@pytest.mark.parametrize("strategy", [{"name": "ar"}, {"name": "mtp", "num_speculative_tokens": 2}],
                         ids=["ar", "mtp"])
def test_each_sample_equals_the_request_sent_alone(strategy):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, n=4, ignore_eos=True, logprobs=1,
                            prompt_logprobs=0)
    eng = engine(strategy=strategy)
    counts = prompt_tokens_run(eng)
    other = eng.add_request([9, 8, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))  # something beside it
    out = eng.generate([PROMPT], params)[0]
    assert other.status.value == "finished"
    assert [s.sample_index for s in out.outputs] == [0, 1, 2, 3] and out.token_ids == out.samples[0].token_ids
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # different seeds, different samples
    assert counts == {other.request_id: 3, out.request_id: 41}  # the prompt ran once, for the leader
    alone = engine(strategy=strategy)
    for i, s in enumerate(out.outputs):
        want = alone.generate([PROMPT], [attrs.evolve(params, n=1, seed=sample_seed(11, i))])[0]
        assert_same(s, want)
        assert s.prompt_logprobs == out.prompt_logprobs and len(s.prompt_logprobs) == 41
    assert eng.scheduler.num_pages_used == 0 and not eng.requests and eng.cache.slots.num_free == 8


def test_samples_share_the_prompt_pages_and_copy_the_last():
    eng = engine(cache={"block_size": 16, "num_blocks": 256, "prefix_caching": False})  # only the samples hold pages
    lead = eng.add_request(PROMPT, SamplingParams(max_new_tokens=30, temperature=1.0, n=3, ignore_eos=True))
    assert len(eng.requests) == 3 and [f.fork_pending for f in lead.group] == [False, True, True]
    while not lead.output_ids:
        eng.step()
    shared = lead.blocks[:2]
    for f in lead.group[1:]:
        assert not f.fork_pending and f.blocks[:2] == shared and f.blocks[2] != lead.blocks[2]
        assert f.num_computed == 41 and len(f.output_ids) == 1
        for k in eng.cache.main.k:  # the copied page holds the prompt's last 9 tokens of KV
            torch.testing.assert_close(k[f.blocks[2], :9], k[lead.blocks[2], :9], atol=0, rtol=0)
    assert [eng.cache.blocks.refs[b] for b in shared] == [3, 3]
    while eng.scheduler.has_work():
        eng.step()
    assert eng.scheduler.num_pages_used == 0 and all(r == 0 for r in eng.cache.blocks.refs)


def test_abort_before_the_fork_and_errors():
    eng = engine()
    lead = eng.add_request(PROMPT, SamplingParams(max_new_tokens=5, n=3))
    eng.step()  # the first prompt chunk: the group holds its slots and pages
    assert eng.cache.slots.num_free == 5
    assert eng.abort(lead.group[2].request_id) and lead.followers == [lead.group[1]]
    assert eng.abort(lead.request_id)  # the leader takes its waiting samples with it
    assert all(s.finish_reason == "abort" for s in lead.group) and not eng.requests
    assert eng.scheduler.num_pages_used == 0 and eng.cache.slots.num_free == 8
    with pytest.raises(RequestError, match="n=9 samples exceed scheduler.max_num_seqs=8"):
        eng.add_request(PROMPT, SamplingParams(n=9))
    with pytest.raises(RequestError, match="n must be a positive int"):
        SamplingParams(n=0)


@pytest.mark.parametrize("exact_rebuild", [False, True], ids=["default", "invariant-rebuild"])
def test_samples_survive_preemption(exact_rebuild):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=3, ignore_eos=True)
    want = engine().generate([PROMPT], params)[0]
    small = engine(128, cache={"block_size": 16, "num_blocks": 11})  # 6 + 4 + 4 + 4 pages wanted: preemptions
    small.scheduler.exact_rebuild = exact_rebuild
    out = small.generate([PROMPT, PROMPT[:20]], [params, SamplingParams(max_new_tokens=40, ignore_eos=True)])
    assert small.scheduler.num_preemptions > 0
    for got, exp in zip(out[0].outputs, want.outputs):
        assert_same(got, exp)
    assert small.scheduler.num_pages_used == 0
