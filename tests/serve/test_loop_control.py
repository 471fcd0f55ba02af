"""The engine loop's control calls (``bi_core/serve/loop.py``) against a scripted engine: answers
come after the deltas of what a call changed, requests that come while paused or asleep are held
and added at resume / wake-up (in order), failures map to their kind, and a sleep that fails
leaves generation as it was."""

from __future__ import annotations

import time
import types
from types import SimpleNamespace

import pytest
from serve_helpers import ScriptedChannel

from bi_core.errors import RequestError
from bi_core.runtime.sequence import RequestOutput, SamplingParams, Sequence
from bi_core.serve.loop import EngineLoop
from bi_core.serve.messages import (
    CONTROL,
    AbortRequests,
    Add,
    Added,
    ControlDone,
    ControlFailed,
    IsPaused,
    Out,
    PauseGeneration,
    Refused,
    ResumeGeneration,
    Sleep,
    Stop,
    WakeUp,
)


class _Scheduler:
    def __init__(self, max_num_seqs: int = 0) -> None:
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)  # 0: no room (what waits, waits)
        self.running, self.waiting = [], []
        self.num_pages_used = self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


class _Cache:
    num_blocks, block_size = 64, 16


class FakeEngine:
    """Just what the loop calls: requests are queued, a pause in mode abort ends them."""

    def __init__(self, max_num_seqs: int = 0) -> None:
        self.scheduler, self.cache = _Scheduler(max_num_seqs), _Cache()
        self.weight_version, self.num_prompt_tokens_computed = 0, 0
        self.requests: dict[int, Sequence] = {}
        self._paused = self._sleeping = False
        self.next_id = 0
        self.calls: list[str] = []
        self.fail_sleep: Exception | None = None
        # whole weights, no weight-update group (what /health reports)
        self.weight_sync = types.SimpleNamespace(coverage=types.SimpleNamespace(whole=True, reason=""),
                                                 states=dict)

    def add_request(self, prompt, params, text=False) -> Sequence:
        seq = Sequence(request_id=self.next_id, prompt_ids=list(prompt), params=params, seed=0, max_total_len=64)
        seq.group = [seq]
        self.next_id += 1
        self.requests[seq.request_id] = seq
        self.scheduler.waiting.append(seq)
        return seq

    def abort(self, rid: int) -> bool:
        seq = self.requests.pop(rid, None)
        if seq is None:
            return False
        self.scheduler.waiting.remove(seq)
        seq.finish("abort")
        return True

    def abort_all(self) -> int:
        n = len(self.requests)
        for rid in list(self.requests):
            self.abort(rid)
        return n

    def output_of(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_ids, token_ids=seq.output_ids,
                             text="", token_logprobs=[], logprobs=None, finish_reason=seq.finish_reason)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise RequestError(f"bad mode {mode!r}")
        self.calls.append(f"pause:{mode}")
        if mode == "abort":
            self.abort_all()
        self._paused = True

    def resume_generation(self) -> None:
        self.calls.append("resume")
        self._paused = False

    def is_paused(self) -> bool:
        return self._paused

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep:{level}")
        if self.fail_sleep is not None:
            raise self.fail_sleep
        self._sleeping = True

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake:{tags}")
        self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping


def _loop(*incoming, max_waiting: int = 8):
    engine, channel = FakeEngine(), ScriptedChannel()
    loop = EngineLoop(engine, channel, max_waiting=max_waiting)
    channel.incoming += incoming
    loop._drain(0.0)
    return loop, engine, channel


def _add(key: int) -> Add:
    return Add(key, [([1, 2, 3], SamplingParams(max_new_tokens=4))])


def test_every_control_call_has_a_key_and_a_handler():
    loop = EngineLoop(None, ScriptedChannel(), max_waiting=1)
    for kind in CONTROL:
        assert kind.__attrs_attrs__[0].name == "key", kind
        assert kind in loop._controls, kind


def test_a_pause_in_mode_abort_sends_the_aborted_requests_last_deltas_before_its_answer():
    loop, engine, channel = _loop(_add(0), _add(1), PauseGeneration(7, "abort", False))
    assert [type(m) for m in channel.sent] == [Added, Added, Out, ControlDone]
    out = channel.sent[2]
    assert sorted((d[0], d[6].finish_reason) for d in out.deltas) == [(0, "abort"), (1, "abort")]
    assert out.counts.finished == {"abort": 2}
    assert channel.sent[3] == ControlDone(7, "paused") and loop.paused and not loop.tracked


def test_requests_that_come_while_paused_are_held_then_added_in_order_at_resume():
    loop, engine, channel = _loop(PauseGeneration(1, "keep", False), _add(10), _add(11), ResumeGeneration(2))
    # held: no Added for 10 and 11 before the resume's answer, then both, in order
    kinds = [(type(m).__name__, getattr(m, "key", None)) for m in channel.sent if not isinstance(m, Out)]
    assert kinds == [("ControlDone", 1), ("ControlDone", 2), ("Added", 10), ("Added", 11)]
    assert engine.calls == ["pause:keep", "resume"] and not loop.paused and not loop.held


def test_held_requests_count_against_the_waiting_limit_and_are_refused_at_shutdown():
    loop, engine, channel = _loop(PauseGeneration(1, "keep", False), _add(10), _add(11), _add(12), max_waiting=2)
    assert [m for m in channel.sent if isinstance(m, Refused)] == [
        Refused(12, "overloaded", "too many waiting requests (2); retry later")]
    before = time.monotonic()
    channel.incoming.append(Stop(30.0))
    loop._drain(0.0)
    refused = [m for m in channel.sent if isinstance(m, Refused)][1:]
    assert [(m.key, m.reason) for m in refused] == [(10, "unavailable"), (11, "unavailable")]
    assert loop.stopping and loop.deadline < before + 1  # paused: nothing can finish, so the deadline is now


@pytest.mark.parametrize("error,reason", [(RequestError("no"), "invalid"), (ValueError("no"), "invalid"),
                                          (RuntimeError("broke"), "error")])
def test_a_failed_sleep_answers_its_kind_and_leaves_generation_running(error, reason):
    engine, channel = FakeEngine(), ScriptedChannel()
    engine.fail_sleep = error
    loop = EngineLoop(engine, channel, max_waiting=4)
    channel.incoming.append(Sleep(3, 1, "abort"))
    loop._drain(0.0)
    answer = channel.sent[-1]
    assert isinstance(answer, ControlFailed) and answer.reason == reason and answer.key == 3
    assert engine.calls == ["pause:abort", "sleep:1", "resume"]  # paused for the sleep, resumed when it failed
    assert not loop.paused and not loop.sleeping


def test_sleep_holds_requests_until_fully_awake_and_wake_resumes_what_sleep_paused():
    loop, engine, channel = _loop(Sleep(1, 2, "abort"), _add(5), WakeUp(2, ["weights"]))
    assert loop.sleeping is False  # the fake wakes whole on any tag
    assert engine.calls == ["pause:abort", "sleep:2", "wake:['weights']", "resume"]
    assert [type(m).__name__ for m in channel.sent if not isinstance(m, Out)] == ["ControlDone", "ControlDone",
                                                                                 "Added"]


def test_a_sleep_while_paused_does_not_resume_on_wake():
    loop, engine, channel = _loop(PauseGeneration(1, "keep", False), Sleep(2, 1, "abort"), WakeUp(3, None))
    assert engine.calls == ["pause:keep", "sleep:1", "wake:None"] and loop.paused


def test_abort_requests_by_id_and_all_answer_how_many():
    loop, engine, channel = _loop(_add(0), _add(1), _add(2), AbortRequests(5, [1, 99]), AbortRequests(6, None),
                                  IsPaused(7))
    answers = {m.key: m.value for m in channel.sent if isinstance(m, ControlDone)}
    assert answers == {5: 1, 6: 2, 7: False}
    finals = [d for m in channel.sent if isinstance(m, Out) for d in m.deltas]
    assert sorted((d[0], d[6].finish_reason) for d in finals) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert not loop.tracked and not engine.requests


def test_a_bad_pause_mode_from_the_engine_is_invalid():
    loop, engine, channel = _loop(PauseGeneration(1, "sideways", False))
    assert channel.sent[-1] == ControlFailed(1, "invalid", "bad mode 'sideways'")


def test_the_waiting_limit_counts_only_requests_the_next_step_cannot_admit():
    """60 requests arrive between two steps with 16 sequence slots free and
    serve.max_waiting_requests 4: the 16 the next step admits are not waiting for room, so 20 are
    added (16 + 4 waiting) and 40 refused; a running request takes a slot."""
    engine, channel = FakeEngine(max_num_seqs=16), ScriptedChannel()
    loop = EngineLoop(engine, channel, max_waiting=4)
    channel.incoming += [_add(k) for k in range(60)]
    loop._drain(0.0)
    assert [m.key for m in channel.sent if isinstance(m, Added)] == list(range(20))
    assert [m.key for m in channel.sent if isinstance(m, Refused)] == list(range(20, 60))
    engine.scheduler.running.append(engine.scheduler.waiting.pop())  # one admitted: one slot fewer
    channel.sent.clear()
    channel.incoming.append(_add(60))
    loop._drain(0.0)
    assert [type(m) for m in channel.sent] == [Refused]
