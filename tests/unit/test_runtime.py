"""Scheduler and engine behaviour: too-long prompts, preemption without loss, reservation mode."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, PromptTooLongError, RequestError, SamplingParams, build_engine
from bi_core.config import CacheConfig, SchedulerConfig
from bi_core.models.presets import preset_args
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.scheduler import Scheduler
from bi_core.runtime.sequence import Sequence


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


def _scheduler(reserve_full, num_blocks, chunk=None, budget=64):
    args = preset_args("tiny-dense")
    cache = CacheManager(args, CacheConfig(block_size=16, num_blocks=num_blocks), num_slots=4, max_model_len=512,
                         dtype=torch.float32, device=torch.device("cpu"), with_mtp=False)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, prefill_chunk_size=chunk)
    return Scheduler(cfg, cache, reserve_full=reserve_full)


def _seq(rid, n, max_new=8):
    return Sequence(request_id=rid, prompt_ids=list(range(n)), params=SamplingParams(max_new_tokens=max_new),
                    seed=0, max_total_len=n + max_new)


def test_reservation_mode_reserves_worst_case_and_never_preempts():
    s = _scheduler(reserve_full=True, num_blocks=4)
    a, b = _seq(0, 20, max_new=30), _seq(1, 10)  # a needs ceil(50/16) = 4 pages up front
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [x.seq for x in out] == [a] and len(a.blocks) == 4  # b waits: no pages left
    assert s.waiting[0] is b and s.num_preemptions == 0


def test_prefill_chunks_are_fixed_not_cut_to_fit_the_budget():
    s = _scheduler(reserve_full=False, num_blocks=64, chunk=32, budget=40)
    a, b = _seq(0, 70), _seq(1, 50)
    s.add(a)
    s.add(b)
    assert [(x.seq.request_id, x.num_tokens) for x in s.schedule()] == [(0, 32)]  # b's 32 does not fit in 8
    a.num_computed += 32
    assert [(x.seq.request_id, x.num_tokens) for x in s.schedule()] == [(0, 32)]
    a.num_computed += 32
    assert [(x.seq.request_id, x.num_tokens) for x in s.schedule()] == [(0, 6), (1, 32)]
