"""Grammars compile off the engine's thread (``Grammars.prepare``, ``Intake.settle``): a request
with a new grammar is queued at once and waits, never admitted before its grammar compiled,
while the other requests' steps go on; a step with nothing else to run waits for the compile; a
compile that fails finishes the request with the error; an abort while it compiles ends it.
Negative control: compiling on the caller's thread (``compile_async=False``, as tensor-parallel
ranks do) holds up ``add_request`` for the whole compile."""

from __future__ import annotations

import re
import threading
import time

import pytest
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.runtime.sequence import Status
from bi_core.structured import regex

pytest.importorskip("xgrammar")  # imported before the timings (its first import takes a second or two)
PROMPT = [5, 6, 7, 8]
HOLD_S = 0.5


def slowed(eng, gate: threading.Event, threads: list[str]):
    """The engine's grammar compiles wait for ``gate`` (and record the thread they ran on)."""
    grammars = eng.intake.grammars
    real = grammars._compile

    def compile_(*args):
        threads.append(threading.current_thread().name)
        gate.wait(timeout=30)
        return real(*args)
    grammars._compile = compile_
    return eng


def engine():
    return build_engine(EngineConfig.from_dict(tiny_config()))


def test_a_request_waits_for_its_grammar_while_the_others_step():
    gate, threads = threading.Event(), []
    eng = slowed(engine(), gate, threads)
    plain = eng.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.step()
    t0 = time.perf_counter()
    hot = eng.add_request(PROMPT, SamplingParams(max_new_tokens=12, structured=regex(r"[a-f]{12}")))
    assert time.perf_counter() - t0 < HOLD_S / 2  # queued at once
    for _ in range(5):
        eng.step()
    assert len(plain.output_ids) == 6 and hot.status is Status.WAITING and not hot.output_ids
    assert hot.grammar is None and hot.grammar_ready is not None
    assert threads and threads[0] != threading.current_thread().name
    gate.set()
    while eng.has_work():
        eng.step()
    assert re.fullmatch(r"[a-f]{12}", eng.output_of(hot).text) and plain.finish_reason == "length"


def test_a_step_with_only_compiling_requests_waits_for_them():
    gate, threads = threading.Event(), []
    eng = slowed(engine(), gate, threads)
    hot = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, structured=regex(r"[a-f]{6}")))
    threading.Timer(0.2, gate.set).start()
    eng.step()  # waits for the compile, then runs its prompt
    assert hot.status is Status.RUNNING and len(hot.output_ids) == 1


def test_a_failed_compile_finishes_the_request_and_an_abort_ends_one_compiling():
    eng = engine()
    grammars = eng.intake.grammars
    grammars._ready = lambda: (grammars._module(), BrokenCompiler())
    plain = eng.add_request(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True))
    bad = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, n=2, temperature=1.0,
                                                 structured=regex(r"[a-f]{6}")))
    done = []
    while eng.has_work():
        done += eng.step()
    assert {s.request_id for s in done} == {plain.request_id, *(s.request_id for s in bad.group)}
    for s in bad.group:
        assert s.finish_reason == "error" and "the regex does not compile: no memory" in s.error
    assert plain.finish_reason == "length" and not eng.requests
    gate, threads = threading.Event(), []
    eng = slowed(engine(), gate, threads)
    hot = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, structured=regex(r"[a-f]{6}")))
    assert eng.abort(hot.request_id) and hot.finish_reason == "abort"
    gate.set()
    assert not eng.has_work() and not eng.intake.settle(wait_all=False) and not eng.intake.pending


class BrokenCompiler:
    def compile_grammar(self, parsed):
        raise RuntimeError("no memory for the tables")


@pytest.mark.parametrize("compile_async", [True, False])
def test_negative_control_compiling_on_the_callers_thread_holds_up_add_request(compile_async):
    gate, threads = threading.Event(), []
    eng = slowed(engine(), gate, threads)
    eng.intake.compile_async = compile_async
    threading.Timer(HOLD_S, gate.set).start()
    t0 = time.perf_counter()
    eng.add_request(PROMPT, SamplingParams(max_new_tokens=4, structured=regex(r"[a-f]{4}")))
    took = time.perf_counter() - t0
    assert (took < HOLD_S / 2) if compile_async else (took >= HOLD_S * 0.9)
    while eng.has_work():
        eng.step()
