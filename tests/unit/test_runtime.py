"""Engine behaviour: too-long prompts, bad requests, stop tokens, preemption without loss, long prompts
beside decoding streams, the invariant rebuild after preemption (the scheduler alone: tests/runtime)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, PromptTooLongError, RequestError, SamplingParams, build_engine


def engine(**overrides):
    return build_engine(EngineConfig.from_dict(tiny_config(**overrides)))


def prompts(n, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def test_too_long_prompt_is_rejected_while_others_go_on():
    e = engine()
    ps = [[1, 2, 3], list(range(256)) * 2 + [1], [4, 5]]  # 513 tokens > max_model_len 512
    out = e.generate(ps, SamplingParams(max_new_tokens=4))
    assert out[1].finish_reason == "error" and out[1].token_ids == []
    assert out[1].error == ("prompt has 513 tokens; the model's limit (max_model_len) is 512 including at least "
                            "one generated token")
    assert [len(o.token_ids) for o in (out[0], out[2])] == [4, 4]
    with pytest.raises(PromptTooLongError, match="prompt has 513 tokens"):
        e.add_request(ps[1], SamplingParams())


def test_bad_requests():
    e = engine()
    with pytest.raises(RequestError, match=r"token ids outside the vocabulary \[0, 260\): \[999\]"):
        e.add_request([1, 999], SamplingParams())
    with pytest.raises(RequestError, match="SamplingParams: top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="prompt is empty"):
        e.add_request([], SamplingParams())


def test_generation_stops_at_max_model_len():
    e = engine(model={"max_model_len": 40})
    out = e.generate([list(range(30))], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert len(out[0].token_ids) == 10 and out[0].finish_reason == "length"


def test_stop_token_ids():
    e = engine()
    first = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6))[0].token_ids
    out = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, stop_token_ids=(first[2],)))[0]
    assert out.token_ids == first[:3] and out.finish_reason == "stop"


def test_preemption_loses_no_request_and_keeps_greedy_tokens():
    ps = prompts(6, [100, 120, 90])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = engine().generate(ps, params)
    tight = engine(cache={"num_blocks": 33})  # 528 tokens: one max_model_len sequence, not all six
    out = tight.generate(ps, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "length" for o in out)


def test_a_long_prompt_gets_its_first_token_while_streams_decode():
    """The issue's reproduction: tiny-moe, max_num_batched_tokens 64, four requests decoding 120
    tokens, then a 200-token prompt. Its first token came after 121 steps (when the four had
    finished); now after one chunk per step, the four decoding all along."""
    e = engine(model={"random": {"preset": "tiny-moe", "seed": 0}}, scheduler={"max_num_batched_tokens": 64})
    streams = [e.add_request(p, SamplingParams(max_new_tokens=120, ignore_eos=True)) for p in prompts(4, [10])]
    while not all(s.output_ids for s in streams):
        e.step()
    long = e.add_request(prompts(1, [200], seed=1)[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    steps = 0
    while not long.output_ids:
        e.step()
        steps += 1
    assert e.scheduler.chunk_size == 16 and steps == -(-200 // 16)
    assert all(len(s.output_ids) == 1 + steps for s in streams)


def test_invariant_preemption_resumes_with_what_it_had():
    """``exact_rebuild`` (what invariant mode turns on): a preempted sequence recomputes its
    generated tokens in decode arithmetic, so its tokens and logprobs continue as if it had never
    been preempted (bitwise on the invariant GPU backend, tests/gpu; here the reference backend's
    CPU GEMMs are not row-invariant, so logprobs to tolerance); the rebuild runs recurrent steps."""
    ps = prompts(6, [100, 120, 90])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = engine().generate(ps, params)
    tight = engine(cache={"num_blocks": 33})
    tight.scheduler.exact_rebuild = True
    shapes = []
    execute = tight.runner.execute
    tight.runner.execute = lambda fwd, **kw: (shapes.extend(
        (r.seq.request_id, len(r.tokens), r.recurrent) for r in fwd.rows), execute(fwd, **kw))[1]
    out = tight.generate(ps, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in roomy]
    for o, r in zip(out, roomy):
        torch.testing.assert_close(torch.tensor(o.token_logprobs), torch.tensor(r.token_logprobs), atol=2e-5, rtol=0)
    rebuilt = [o.request_id for o in out if o.num_preemptions]
    assert rebuilt and all(tight.requests.get(r) is None for r in rebuilt)
    # past a rebuilt sequence's prompt, every step it ran was recurrent (decode arithmetic)
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in out}
    for rid in rebuilt:
        runs = [(n, rec) for r, n, rec in shapes if r == rid]
        assert any(n > 1 and rec for n, rec in runs)  # generated tokens recomputed several per step
        assert sum(n for n, rec in runs if not rec) % prompt_len[rid] == 0  # only prompts ran as chunks
