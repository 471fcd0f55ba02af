"""The pipe's messages (``bi_core/serve/messages.py``): each kind survives pickling (and a real
multiprocessing pipe) unchanged, is a frozen slotted class with a one-line docstring, and each
side's dispatcher refuses a message it does not handle with a clear error."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import pickle

import attrs
import pytest
from serve_helpers import ScriptedChannel

from bi_core.runtime.sequence import RequestOutput, SamplingParams
from bi_core.serve import messages
from bi_core.serve.client import EngineClient
from bi_core.serve.loop import EngineLoop
from bi_core.serve.messages import (
    CONTROL,
    FROM_ENGINE,
    TO_ENGINE,
    Abort,
    AbortRequests,
    Add,
    Added,
    CollectiveRpc,
    ControlDone,
    ControlFailed,
    DestroyWeightsUpdateGroup,
    EngineInfo,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    IsPaused,
    IsSleeping,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensor,
    Out,
    PauseGeneration,
    Ready,
    Refused,
    ResetPrefixCache,
    ResumeGeneration,
    Sleep,
    StartFailed,
    Stop,
    Stopped,
    UnexpectedMessage,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    WakeUp,
)
from bi_core.serve.metrics import Counts

OUTPUT = RequestOutput(request_id=3, prompt_token_ids=[1, 2], token_ids=[5, 6], text="hi", token_logprobs=[-0.5, -1.0],
                       logprobs=[{5: -0.5}, {6: -1.0, 7: -2.0}], finish_reason="stop", stop_reason=6)
EXAMPLES = [
    Add(0, [([1, 2, 3], SamplingParams(max_new_tokens=4, n=2, temperature=0.8, seed=7, stop=("x",))),
            ([4], SamplingParams())]),
    Abort([3, 4]),
    Stop(20.0),
    PauseGeneration(2, "keep", False),
    ResumeGeneration(3),
    IsPaused(4),
    AbortRequests(5, [3, 4]),
    AbortRequests(6, None),
    ResetPrefixCache(7),
    Sleep(8, 1, "abort"),
    WakeUp(9, ["weights"]),
    WakeUp(10, None),
    IsSleeping(11),
    GetWeightVersion(12),
    InitWeightsUpdateGroup(13, "127.0.0.1", 29500, 1, 2, "weight_update_group", None),
    UpdateWeightsFromDistributed(14, ["model.norm.weight"], ["float32"], [[64]], "weight_update_group", True, 3,
                                 False),
    DestroyWeightsUpdateGroup(15, "weight_update_group"),
    UpdateWeightsFromDisk(16, "/ckpt", True),
    UpdateWeightsFromTensor(17, ["gASV"], None, True, 5, False),
    CollectiveRpc(18, "echo", ["a"], {"k": "v"}, 2.5),
    LoadLoraAdapter(19, "a", "/adapters/a", True),
    UnloadLoraAdapter(20, "a"),
    LoadLoraAdapterFromTensor(21, "a", "gASV", {"r": 8, "lora_alpha": 16}),
    CollectiveRpc(19, "weight_version", [], {}, None),
    Ready(EngineInfo(max_model_len=512, batch_invariant=True, vocab_size=256, max_num_seqs=64, tensor_parallel_size=2)),
    StartFailed("cannot read the checkpoint"),
    Added(0, [3, 4, 5], 2),
    Refused(1, "overloaded", "too many waiting requests (8); retry later"),
    ControlDone(14, {"num_tensors": 1, "weight_version": 3}),
    ControlDone(4, True),
    ControlDone(18, [{"rank": 0}, "0.5", None]),
    ControlFailed(13, "invalid", "init_weights_update_group: master_port 0 is not a TCP port"),
    Out([(0, 0, [5], [-0.5], [{5: -0.5}], "h", None), (0, 1, [6], [-1.0], [], "i", OUTPUT)],
        Counts(step_seconds=[0.01], generated=2, finished={"stop": 1}, state={"running": 1.0}), None),
    Out([], Counts(), "engine step failed: boom"),
    Out([], Counts(), None, {"weights_missing": "they were released by sleep level 2", "weight_groups": {"g": "joining"}}),
    Refused(2, "no_weights", "the engine's weights are missing: ..."),
    Stopped(),
]


def test_the_examples_cover_every_message_kind():
    kinds = {type(m) for m in EXAMPLES}
    assert kinds == set(TO_ENGINE) | set(FROM_ENGINE) and set(CONTROL) < set(TO_ENGINE)
    defined = {c for _, c in inspect.getmembers(messages, inspect.isclass)
               if attrs.has(c) and c.__module__ == messages.__name__ and c is not EngineInfo}
    assert defined == kinds  # a new kind must be listed in TO_ENGINE or FROM_ENGINE (and tested here)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_round_trips_through_pickle(msg):
    back = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back) is type(msg) and back == msg


def test_messages_cross_a_multiprocessing_pipe():
    a, b = mp.get_context("spawn").Pipe()
    with a, b:
        for msg in EXAMPLES:
            a.send(msg)
            assert b.recv() == msg


@pytest.mark.parametrize("kind", [*TO_ENGINE, *FROM_ENGINE], ids=lambda k: k.__name__)
def test_a_message_kind_is_frozen_slotted_and_says_who_sends_it(kind):
    assert "__slots__" in kind.__dict__
    msg = next(m for m in EXAMPLES if type(m) is kind)
    with pytest.raises(AttributeError):
        msg.__dict__  # noqa: B018 - slots: no instance dict
    for field in attrs.fields(kind):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(msg, field.name, None)
    doc = kind.__doc__ or ""
    assert "\n" not in doc.strip() and doc.startswith("HTTP -> engine" if kind in TO_ENGINE else "Engine -> HTTP")


def test_the_engine_loop_dispatches_on_the_message_class():
    channel = ScriptedChannel(Abort([99]), Stop(30.0), Stop(5.0), Stop(60.0))  # an unknown request id: nothing to abort
    loop = EngineLoop(None, channel, max_waiting=4)  # none of these reaches the engine
    loop._drain(0.0)
    assert loop.stopping and loop.shutdown_timeout_s == 5.0  # the earliest deadline wins
    loop._add(7, [([1], SamplingParams())])  # refused while stopping, before the engine is asked
    assert channel.sent == [Refused(7, "unavailable", "the server is shutting down")]


@pytest.mark.parametrize("msg", [("add", 0, []), ("stop", 1.0), Stopped(), None],
                         ids=["old-tuple-add", "old-tuple-stop", "engine-side-message", "none"])
def test_the_engine_loop_refuses_an_unexpected_message(msg):
    loop = EngineLoop(None, ScriptedChannel(msg), max_waiting=4)
    expected = ", ".join(k.__name__ for k in TO_ENGINE)
    assert expected.startswith("Add, Abort, Stop, PauseGeneration, ")
    with pytest.raises(UnexpectedMessage, match=r"the engine process got an unexpected message on the engine pipe, "
                                                rf"of type {type(msg).__name__}: .*\(expected one of {expected}\)"):
        loop._drain(0.0)  # not taken for a closed pipe: the engine process ends with this error
    assert not loop.stopping


@pytest.mark.parametrize("msg", [("out", [], Counts(), None), Add(0, []), Ready(next(m for m in EXAMPLES if isinstance(m, Ready)).info)],
                         ids=["old-tuple-out", "http-side-message", "second-ready"])
def test_the_http_side_refuses_an_unexpected_message(msg):
    client = EngineClient.__new__(EngineClient)  # no engine process: the dispatcher raises before using one
    with pytest.raises(UnexpectedMessage, match=r"the HTTP process got an unexpected message on the engine pipe, "
                                                rf"of type {type(msg).__name__}: .*\(expected one of Added, Refused, "
                                                r"ControlDone, ControlFailed, Out, Stopped\)"):
        client._dispatch(msg)
