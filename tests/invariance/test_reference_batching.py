"""On the reference backend (float32) a request's greedy tokens do not change when it runs
alone, in a batch, or beside requests arriving mid-run; seeded samples likewise (G4's shape).
The reference backend promises no bitwise invariance, so logprobs are compared with a
tolerance here (relative too: float32 logprobs of magnitude ~5 differ by tens of ulps when CPU
BLAS blocks a batch differently); the bitwise checks live with the invariant backend."""

from __future__ import annotations

import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine

LENGTHS = [3, 40, 17, 90, 1, 66, 8, 25]


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def engine(preset):
    return build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": preset, "seed": 1}},
                                                           scheduler={"prefill_chunk_size": 32})))


def check(preset, params):
    ps = prompts()
    together = engine(preset).generate(ps, params)
    for p, t in zip(ps, together):
        alone = engine(preset).generate([p], params)[0]
        assert alone.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(alone.token_logprobs), torch.tensor(t.token_logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_greedy_alone_vs_batched_dense():
    check("tiny-dense", SamplingParams(max_new_tokens=12, ignore_eos=True))


def test_greedy_alone_vs_batched_moe():
    check("tiny-moe", SamplingParams(max_new_tokens=12, ignore_eos=True))


def test_seeded_sampling_alone_vs_batched():
    check("tiny-moe", SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True))


def test_requests_arriving_mid_run_mix_prefill_and_decode():
    ps = prompts(2)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = engine("tiny-moe")
    needle = eng.add_request(ps[0], params)
    eng.step()
    eng.step()  # the needle is decoding now
    fillers = [eng.add_request(p, params) for p in ps[1:]]
    while eng.scheduler.has_work():
        eng.step()
    alone = engine("tiny-moe").generate([ps[0]], params)[0]
    assert needle.output_ids == alone.token_ids
    assert all(len(f.output_ids) == 10 for f in fillers)
