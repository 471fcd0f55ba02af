"""The tensor-parallel lock-step's messages: typed, picklable (they cross a gloo broadcast), and
replayed on a worker rank by type, never by method name (``runtime/launch.py``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from bi_core import BiEngineError, SamplingParams
from bi_core.parallel import lockstep as ls
from bi_core.runtime.launch import replay


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list = []

    def add_request(self, prompt, params, *, text):
        self.calls.append(("add_request", prompt, params, text))

    def add_score_request(self, prompt, continuation, *, exact, logprobs):
        self.calls.append(("add_score_request", prompt, continuation, exact, logprobs))

    def abort(self, request_id):
        self.calls.append(("abort", request_id))

    def lockstep_check(self):
        return (3, 7, 2)

    def step(self):
        self.calls.append(("step",))

    def update_weights(self, path):
        self.calls.append(("update_weights", path))



MESSAGES = [ls.AddRequest([1, 2], SamplingParams(max_new_tokens=3), True),
            ls.AddScoreRequest("a", [4], False, 2), ls.Abort(5), ls.Step((3, 7, 2)),
            ls.UpdateWeightsFromPath("/ckpt")]


def test_messages_round_trip_through_pickle():
    for m in [*MESSAGES, ls.ReceiveWeights([("w", (2, 3), torch.bfloat16)]), ls.CollectiveRpc("echo", ("a",), {"k": 1}),
              ls.Shutdown()]:
        assert pickle.loads(pickle.dumps(m)) == m


def test_replay_dispatches_on_the_type():
    eng = FakeEngine()
    assert all(replay(eng, m, rank=1) for m in MESSAGES)
    assert eng.calls == [("add_request", [1, 2], SamplingParams(max_new_tokens=3), True),
                         ("add_score_request", "a", [4], False, 2), ("abort", 5), ("step",),
                         ("update_weights", "/ckpt")]
    assert replay(eng, ls.Shutdown(), rank=1) is False


def test_a_drifted_rank_and_an_unknown_message_stop_with_an_error():
    with pytest.raises(BiEngineError, match="drifted from rank 0"):
        replay(FakeEngine(), ls.Step((4, 7, 2)), rank=1)
    with pytest.raises(BiEngineError, match="unexpected message"):
        replay(FakeEngine(), ("step", ((3, 7, 2),), {}), rank=1)  # the old by-name form


def test_the_other_ranks_are_started_by_the_composition_root():
    """The engine does not start tensor-parallel ranks itself (that would import the rank's side,
    which builds engines: a circle); ``bi_core.build_engine`` passes it how. Built without it, a
    tensor-parallel engine is one clear error before any rank starts."""
    from helpers import tiny_config

    from bi_core import EngineConfig
    from bi_core.runtime.engine import LLMEngine

    config = EngineConfig.from_dict(tiny_config(parallel={"tensor_parallel_size": 2}))
    with pytest.raises(BiEngineError, match=r"^parallel.tensor_parallel_size is 2: the other ranks are started by "
                                            r"bi_core.build_engine"):
        LLMEngine(config)
