"""Pause / resume / abort around a weight sync (issue 24), vLLM's modes, with requests in flight:
abort (every unfinished request ends 'abort'), wait (the started ones finish inside the call, the
queued ones are held), keep (frozen; after resume the outputs are bitwise those of an
uninterrupted run). While paused, step() runs nothing and generate() raises instead of spinning.
Sleep / wake through the engine (the runner's release, tests/rl/test_sleep.py). Tensor parallel:
the same decisions on every rank (typed lock-step messages)."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.parallel import lockstep as ls
from bi_core.runtime.launch import replay
from bi_core.runtime.sequence import Status

LONG = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
LONG_N2 = attrs.evolve(LONG, n=2)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(20, 70)), [9, 8, 7]]


def _engine(tp: int = 1, **overrides):
    return build_engine(EngineConfig.from_dict(tiny_config(parallel={"tensor_parallel_size": tp}, **overrides)))


def _outputs(seqs) -> list:
    return [(s.output_ids, s.token_logprobs, s.finish_reason) for seq in seqs for s in seq.group]


def _scenario(engine, pause_at: int | None, mode: str = "keep", clear_cache: bool = False) -> list:
    """Requests arriving between steps (n=2 samples among them); paused after ``pause_at`` steps,
    stepped while paused (nothing runs), resumed, run to the end."""
    seqs = [engine.add_request(PROMPTS[0], LONG_N2)]
    for i in range(40):
        if i == 2:
            seqs.append(engine.add_request(PROMPTS[1], LONG))
        if i == 3:
            seqs.append(engine.add_request(PROMPTS[2], LONG))
        if i == pause_at:
            engine.pause_generation(mode, clear_cache=clear_cache)
            assert engine.is_paused() and not engine.has_work()
            steps = engine.num_steps
            assert engine.step() == [] and engine.step() == [] and engine.num_steps == steps
            with pytest.raises(RequestError, match="paused"):
                engine.generate([[1, 2]])
            engine.resume_generation()
            assert not engine.is_paused()
        engine.step()
    assert not engine.scheduler.has_work()
    return _outputs(seqs)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_resumes_bitwise_as_an_uninterrupted_run(clear_cache):
    want = _scenario(_engine(), pause_at=None)
    got = _scenario(_engine(), pause_at=5, clear_cache=clear_cache)
    assert got == want
    assert len(got) == 4 and all(reason == "length" for *_, reason in got)
    # negative control: the same interruption in mode abort loses the requests
    lost = _scenario(_engine(), pause_at=5, mode="abort")
    assert lost != want and {reason for *_, reason in lost} == {"abort"}


def test_abort_ends_every_unfinished_request():
    engine = _engine()
    a = engine.add_request(PROMPTS[0], LONG_N2)
    engine.step()
    engine.step()
    b = engine.add_request(PROMPTS[1], LONG)  # queued, not started
    assert engine.abort_all() == 3  # the leader, its sample, the queued one
    assert [s.finish_reason for s in [*a.group, b]] == ["abort"] * 3
    assert not engine.requests and not engine.scheduler.has_work()
    assert engine.cache.num_pages_in_use == engine.cache.prefix.stats()["cached_pages"]  # pages given back
    c = engine.add_request(PROMPTS[2], LONG)
    engine.step()
    engine.pause_generation()  # default mode: abort
    assert c.finish_reason == "abort" and engine.is_paused()
    d = engine.add_request(PROMPTS[2], LONG)  # accepted while paused; it waits
    assert engine.step() == [] and d.status is Status.WAITING and d.num_computed == 0
    engine.resume_generation()
    while engine.has_work():
        engine.step()
    assert d.finish_reason == "length" and len(d.output_ids) == 12


def _wait_scenario(engine):
    started = [engine.add_request(PROMPTS[0], LONG_N2), engine.add_request(PROMPTS[1], LONG)]
    for _ in range(3):
        engine.step()
    queued = engine.add_request(PROMPTS[2], LONG)
    engine.pause_generation("wait")
    assert engine.is_paused()
    assert all(s.finish_reason == "length" for seq in started for s in seq.group)  # they ran to their end
    assert queued.status is Status.WAITING and queued.num_computed == 0 and not queued.output_ids  # held
    assert list(engine.scheduler.waiting) == [queued]  # queued again once the drain is over
    engine.resume_generation()
    engine.step()
    assert queued.num_computed > 0  # control: the first step after resume admits it
    while engine.has_work():
        engine.step()
    return _outputs([*started, queued])


def test_wait_finishes_started_requests_and_holds_queued_ones():
    out = _wait_scenario(_engine())
    assert len(out) == 4 and all(reason == "length" for *_, reason in out)


def test_tp2_pause_modes_agree_on_every_rank():
    """wait holds the queued requests on every rank (HoldAdmissions), keep and clear_cache
    (ResetPrefixCache) too; the tokens are those of one rank (logprobs to float tolerance)."""
    one_wait, one_keep = _wait_scenario(_engine()), _scenario(_engine(), pause_at=5, clear_cache=True)
    engine = _engine(tp=2)
    try:
        two_wait = _wait_scenario(engine)
        two_keep = _scenario(engine, pause_at=5, clear_cache=True)
        assert engine.reset_prefix_cache() is True
        engine.generate([PROMPTS[1]], LONG)  # the ranks still agree after the reset
    finally:
        engine.close()
    for one, two in [(one_wait, two_wait), (one_keep, two_keep)]:
        assert [(ids, reason) for ids, _, reason in one] == [(ids, reason) for ids, _, reason in two]
        for (_, a, _), (_, b, _) in zip(one, two):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_reset_prefix_cache():
    engine = _engine()
    prompt = list(range(100, 250))  # 150 tokens: the first chunk (112) is cached
    params = SamplingParams(max_new_tokens=2)
    engine.generate([prompt], params)
    assert engine.generate([prompt], params)[0].num_cached_tokens > 0  # control: it is cached
    assert engine.reset_prefix_cache() is True
    assert engine.cache.prefix.stats()["cached_pages"] == 0
    assert engine.generate([prompt], params)[0].num_cached_tokens == 0
    assert _engine(cache={"prefix_caching": False}).reset_prefix_cache() is False


def test_sleep_and_wake_need_started_requests_ended_and_keep_the_outputs():
    engine = _engine()
    want = engine.generate([PROMPTS[1]], LONG)[0]
    started = engine.add_request(PROMPTS[0], LONG)
    engine.step()
    with pytest.raises(RequestError, match=r"sleep: 1 request\(s\) have started .*pause_generation"):
        engine.sleep(1)
    engine.pause_generation("abort")
    assert started.finish_reason == "abort"
    engine.sleep(1)
    assert engine.is_sleeping() and engine.cache.released
    engine.resume_generation()
    assert not engine.has_work() and engine.step() == []
    with pytest.raises(RequestError, match="generate: the engine's kv_cache and weights are asleep"):
        engine.generate([[1, 2]])
    with pytest.raises(RequestError, match=r"update_weights: .* asleep \(sleep level 1\); wake_up"):
        engine.update_weights({"model.norm.weight": torch.ones(64)})  # (an asleep tensor must not be read)
    with pytest.raises(RequestError, match="already asleep"):
        engine.sleep(2)
    queued = engine.add_request(PROMPTS[1], LONG)  # accepted while asleep; it waits
    engine.wake_up(["weights"])
    assert engine.is_sleeping() and not engine.has_work()  # the cache still sleeps
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping()
    while engine.has_work():
        engine.step()
    assert (queued.output_ids, queued.token_logprobs) == (want.token_ids, want.token_logprobs)


def test_sleep_and_wake_errors_name_the_problem():
    engine = _engine()
    for level in (0, 3, True):
        with pytest.raises(RequestError, match="level must be 1 .* or 2"):
            engine.sleep(level)
    for tags in ([], ["kv"], "weights"):
        with pytest.raises(RequestError, match="tags must be a non-empty list of weights, kv_cache"):
            engine.wake_up(tags)
    assert not engine.is_sleeping()


def test_tp2_sleep_and_wake_on_every_rank():
    engine = _engine(tp=2)
    try:
        before = engine.generate(PROMPTS, LONG)
        engine.sleep(1)
        engine.wake_up()
        after = engine.generate(PROMPTS, LONG)
    finally:
        engine.close()
    assert [(o.token_ids, o.token_logprobs) for o in after] == [(o.token_ids, o.token_logprobs) for o in before]


def test_bad_mode_names_the_allowed_ones():
    engine = _engine()
    with pytest.raises(RequestError, match="mode 'drain' is not one of 'abort', 'wait', 'keep'"):
        engine.pause_generation("drain")
    assert not engine.is_paused()


def test_tp_messages_replay_pause_calls():
    class Fake:
        def __init__(self):
            self.calls = []
            self.rollout = self

        def reset_prefix_cache(self):
            self.calls.append("reset")

        def hold_admissions(self):
            self.calls.append("hold")

        def release_admissions(self):
            self.calls.append("release")

        def sleep(self, level):
            self.calls.append(f"sleep:{level}")

        def wake_up(self, tags):
            self.calls.append(f"wake:{tags}")

    eng = Fake()
    msgs = [ls.HoldAdmissions(), ls.ReleaseAdmissions(), ls.ResetPrefixCache(), ls.Sleep(2), ls.WakeUp(("weights",)),
            ls.WakeUp(None)]
    assert all(replay(eng, m, rank=1) for m in msgs)
    assert eng.calls == ["hold", "release", "reset", "sleep:2", "wake:['weights']", "wake:None"]
