"""Weight sync from a trainer process (issue 24): a real trainer (a spawned OS process, gloo)
builds a second model's weights and sends them with ``bi_core.rl.WeightSender`` to a running
engine (TP=1 and TP=2); afterwards the engine's outputs equal, bitwise, an engine built from
those weights. Refusals (wrong name, wrong shape, other metadata than sent, no such group) change
nothing and reach the trainer too, without a hang; a trainer dying mid-transfer or going silent
ends in an error naming the stage, and the engine refuses requests until a complete update lands."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
from helpers import tiny_config

from bi_core import BiEngineError, EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.parallel import lockstep as ls
from bi_core.rl import WeightSender
from bi_core.rl.coverage import WeightsMissing
from bi_core.rl.sync_protocol import ALIGN, bucket_layout, fingerprint, no_go, parse_dtype
from bi_core.runtime.launch import replay

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 60))]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, n=2)
BUCKET_MB = 0.25  # the tiny model's 1.1 MiB in several buckets
TIMEOUT_S = 20.0


def _config(seed: int, tp: int = 1, device: str = "cpu") -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-dense", "seed": seed}, "device": device},
                                              parallel={"tensor_parallel_size": tp}))


def _run(engine) -> list:
    return [(s.token_ids, s.token_logprobs, s.weight_version) for o in engine.generate(PROMPTS, PARAMS)
            for s in o.outputs]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the trainer process


def _rpc(conn):
    """request_update for a trainer whose engine listens on ``conn`` (as an HTTP POST would be)."""
    def request_update(names, dtypes, shapes, **extra):
        conn.send(("update", names, dtypes, shapes, extra))
        kind, value = conn.recv()
        if kind == "error":
            raise BiEngineError(value)
        return value
    return request_update


def _stall(group, after: int, how: str):
    """The trainer's broadcasts stop after ``after`` buckets: it dies, or goes silent."""
    real, sent = group.broadcast, [0]

    def broadcast(buf, stage):
        if sent[0] == after:
            if how == "die":
                os._exit(3)
            time.sleep(600)
        sent[0] += 1
        real(buf, stage)
    return broadcast


def _same_shaped(weights: list) -> list:
    """Two tensors of one shape."""
    by_shape: dict = {}
    for pair in weights:
        by_shape.setdefault(tuple(pair[1].shape), []).append(pair)
    return next(v[:2] for v in by_shape.values() if len(v) >= 2)


def trainer_main(conn, port: int, world: int, cases: list[str], backend: str | None = None) -> None:
    """A trainer: the weights of the seed-1 model, sent case by case; each outcome reported."""
    weights = [(n, p.detach().clone()) for n, p in build_engine(_config(1)).model.named_parameters()]
    conn.send(("hello",))
    sender = WeightSender("127.0.0.1", port, world, timeout_s=TIMEOUT_S, backend=backend, device="cpu")
    rpc = _rpc(conn)
    for case in cases:
        pairs, request = weights, rpc
        if case == "bad_name":
            pairs = [("model.layers.0.mlp.nonsense.weight", torch.zeros(4))]
        elif case == "bad_shape":
            pairs = [("model.norm.weight", torch.zeros(3))]
        elif case == "other_metadata":  # the request names two same-shaped tensors the other way round
            request = lambda n, d, s: rpc([n[1], n[0], *n[2:]], d, s)  # noqa: E731
            pairs = _same_shaped(weights)
        elif case == "no_group":
            request = lambda n, d, s: rpc(n, d, s, group_name="nope")  # noqa: E731
        elif case in ("die", "stall"):
            sender.group.broadcast = _stall(sender.group, 1, case)
        elif case == "good_v7":
            request = lambda n, d, s: rpc(n, d, s, weight_version=7)  # noqa: E731
        t0 = time.monotonic()
        try:
            got = ("ok", sender.send(pairs, request, bucket_mb=BUCKET_MB))
        except BiEngineError as e:
            got = ("error", str(e))
        conn.send(("report", case, got, time.monotonic() - t0))
    conn.send(("done",))


def _serve(engine, conn, between) -> dict:
    """The engine's side of the pipe: run each update the trainer asks for; the trainer's reports
    and the engine's own errors by case. ``between(case)``: after each case."""
    reports, errors = {}, []
    while True:
        if not conn.poll(60):
            raise AssertionError("the trainer went quiet")
        msg = conn.recv()
        if msg[0] == "done":
            return {"reports": reports, "errors": errors}
        if msg[0] == "report":
            reports[msg[1]] = (*msg[2], msg[3])
            between(msg[1])
            continue
        _, names, dtypes, shapes, extra = msg
        try:
            conn.send(("ok", engine.update_weights_from_distributed(names, dtypes, shapes, **extra)))
        except BiEngineError as e:
            errors.append(str(e))
            if type(e) is BiEngineError:  # a transfer failed (a refusal is a RequestError or CheckpointError)
                return {"reports": reports, "errors": errors}
            conn.send(("error", str(e)))


def _sync(engine, cases: list[str], *, timeout_s: float = TIMEOUT_S, between=lambda case: None,
          backend: str | None = None) -> dict:
    """Start a trainer, join its group, serve its updates, leave the group."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    port, world = _port(), 1 + engine.tp.world
    proc = ctx.Process(target=trainer_main, args=(theirs, port, world, cases, backend), daemon=True)
    proc.start()
    try:
        assert mine.poll(60) and mine.recv() == ("hello",)
        engine.init_weights_update_group("127.0.0.1", port, 1, world, timeout_s=timeout_s, backend=backend)
        out = _serve(engine, mine, between)
        engine.destroy_weights_update_group()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    return out


@pytest.fixture(scope="module")
def reference() -> list:
    """What the trainer's model (seed 1) generates, TP=1."""
    return _run(build_engine(_config(1)))


# ------------------------------------------------------------------ tests


def test_trainer_sync_equals_the_trainers_model_and_refusals_change_nothing(reference):
    engine = build_engine(_config(0))
    before = _run(engine)
    assert [r[:2] for r in before] != [r[:2] for r in reference]  # negative control: the models differ
    snapshot = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out = _sync(engine, ["bad_name", "bad_shape", "other_metadata", "good_v7", "no_group"])
    reports = out["reports"]
    assert "no weight-update group 'nope'" in reports["no_group"][1]  # the trainer did not wait for a handshake
    assert reports["no_group"][2] < 10
    assert "unknown weight names ['model.layers.0.mlp.nonsense.weight']" in reports["bad_name"][1]
    assert "tensor model.norm.weight: checkpoint shape (3,), model expects (64,)" in reports["bad_shape"][1]
    assert "other names, dtypes or shapes than the trainer sends" in reports["other_metadata"][1]
    assert all(reports[c][0] == "error" for c in ("no_group", "bad_name", "bad_shape", "other_metadata"))
    assert reports["good_v7"][:2] == ("ok", 41)
    assert any("nothing was updated" in e for e in out["errors"])
    after = _run(engine)
    assert engine.weight_version == 7 and all(r[2] == 7 for r in after)
    assert [r[:2] for r in after] == [r[:2] for r in reference]
    samples = [r[0] for r in after]
    assert samples[0] != samples[1] and samples[2] != samples[3]  # n=2 samples keep distinct seeds across a sync
    assert any(not torch.equal(snapshot[n], p) for n, p in engine.model.named_parameters())


def test_sync_while_paused_refuses_started_requests_and_relabels_queued_ones():
    """pause(keep) keeps started requests: the update is refused; pause(abort) then clears them, a
    request added while paused waits, the update lands, and after resume that request runs wholly
    on the new weights, labelled with their version: the trainer's model's output, bitwise."""
    engine = build_engine(_config(0))
    kept = engine.add_request(PROMPTS[0], PARAMS)
    engine.step()
    engine.pause_generation("keep")
    queued = []

    def between(case):
        if case == "good":
            engine.pause_generation("abort")
            queued.append(engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)))

    out = _sync(engine, ["good", "good_v7"], between=between)
    assert "request(s) have started" in out["reports"]["good"][1] and "mode 'abort' or 'wait'" in out["errors"][0]
    assert out["reports"]["good_v7"][:2] == ("ok", 41)
    assert kept.finish_reason == "abort" and queued[0].weight_version == 7
    engine.resume_generation()
    while engine.has_work():
        engine.step()
    want = build_engine(_config(1)).generate([PROMPTS[2]], SamplingParams(max_new_tokens=6, temperature=0.8, seed=3))
    got = engine.output_of(queued[0])
    assert (got.token_ids, got.token_logprobs, got.weight_version) == (want[0].token_ids, want[0].token_logprobs, 7)


def test_level_2_sleep_then_a_trainer_sync_refills_the_weights(reference):
    """A trainer sharing the GPU: the engine sleeps at level 2 (weights dropped); a sync while the
    weights sleep is refused; once they are allocated again the sync fills them, then the cache
    wakes: the trainer's model's outputs."""
    engine = build_engine(_config(0))
    engine.sleep(2)

    def between(case):
        if case == "good":
            engine.wake_up(["weights"])

    out = _sync(engine, ["good", "good_v7"], between=between)
    assert "weights are asleep (sleep level 2); wake_up" in out["reports"]["good"][1]
    assert out["reports"]["good_v7"][:2] == ("ok", 41)
    engine.wake_up(["kv_cache"])
    assert [r[:2] for r in _run(engine)] == [r[:2] for r in reference]


def test_refused_updates_leave_the_weights_as_they_were():
    engine = build_engine(_config(0))
    snapshot = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out = _sync(engine, ["bad_name", "bad_shape", "other_metadata"])
    assert all(r[0] == "error" for r in out["reports"].values()) and len(out["reports"]) == 3
    assert all(torch.equal(snapshot[n], p) for n, p in engine.model.named_parameters())
    assert engine.weight_version == 0
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))  # still serving


def test_tp2_trainer_sync_equals_the_trainers_model():
    engine = build_engine(_config(0, tp=2))
    try:
        out = _sync(engine, ["bad_shape", "good"])
        after = _run(engine)
    finally:
        engine.close()
    assert out["reports"]["bad_shape"][0] == "error" and out["reports"]["good"][:2] == ("ok", 41)
    ref_engine = build_engine(_config(1, tp=2))
    try:
        want = _run(ref_engine)
    finally:
        ref_engine.close()
    assert [r[:2] for r in after] == [r[:2] for r in want]
    assert all(r[2] == 1 for r in after)


@pytest.mark.parametrize("tp,how", [(1, "die"), (2, "die"), (1, "stall")])
def test_a_failed_transfer_names_the_stage_and_requests_wait_for_a_complete_update(reference, tp, how):
    engine = build_engine(_config(0, tp=tp))
    try:
        out = _sync(engine, [how], timeout_s=4.0 if how == "stall" else TIMEOUT_S)
        (err,) = out["errors"]
        assert "update_weights_from_distributed: receiving bucket 2 of 4 from the trainer: " in err
        assert ("timed out after 4 s" if how == "stall" else "went away") in err
        with pytest.raises(WeightsMissing, match="weights are missing: a weight update from the trainer failed after "
                                                 "1 of 4 bucket"):
            engine.add_request([1, 2, 3], SamplingParams())
        with pytest.raises(WeightsMissing, match="generate: the engine's weights are missing"):
            engine.generate([[1, 2, 3]], SamplingParams())
        assert engine.weight_version == 0
        out = _sync(engine, ["good"])  # a new trainer, a new group: a complete update lands
        assert out["reports"]["good"][:2] == ("ok", 41)
        after = _run(engine)
    finally:
        engine.close()
    if tp == 1:
        assert [r[:2] for r in after] == [r[:2] for r in reference]


# ------------------------------------------------------------------ protocol units


def test_bucket_layout_is_aligned_bounded_and_in_order():
    sizes = [10, 100, 7, 300, 0, 50]
    layout = bucket_layout(sizes, 128)
    flat = [e for b in layout for e in b.entries]
    assert [i for i, _, _ in flat] == list(range(len(sizes)))
    assert all(off % ALIGN == 0 for _, off, _ in flat)
    assert all(b.size <= 128 or len(b.entries) == 1 for b in layout)  # a larger tensor alone
    assert [len(b.entries) for b in layout] == [2, 1, 1, 2]
    with pytest.raises(BiEngineError, match="at least 1 byte"):
        bucket_layout(sizes, 0)


def test_handshake_rows_and_metadata():
    fp = fingerprint(["a"], [torch.float32], [[2, 3]])
    assert fp == fingerprint(["a"], [parse_dtype("float32")], [(2, 3)])
    assert fp != fingerprint(["a"], [torch.bfloat16], [[2, 3]])
    assert no_go([[0, 64, fp], [0, 0, fp]]) is None
    assert "refused by rank(s) [2]" in no_go([[0, 64, fp], [0, 0, fp], [1, 0, 0]])
    assert "rank(s) [1]" in no_go([[0, 64, fp], [0, 0, fp + 1]])
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(RequestError, match="unknown dtype 'float33'"):
        parse_dtype("float33")


def test_engine_side_errors_name_the_problem():
    engine = build_engine(_config(0))
    with pytest.raises(RequestError, match="rank_offset >= 1"):
        engine.init_weights_update_group("127.0.0.1", 29999, 0, 2)
    with pytest.raises(RequestError, match="backend 'mpi' is not one of gloo, nccl"):
        engine.init_weights_update_group("127.0.0.1", 29999, 1, 2, backend="mpi")
    with pytest.raises(RequestError, match="no weight-update group 'weight_update_group'"):
        engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
    with pytest.raises(RequestError, match="no weight-update group"):
        engine.destroy_weights_update_group()
    with pytest.raises(BiEngineError, match=r"joining weight-update group 'g' at 127.0.0.1:\d+ as rank 1 of 2: "
                                            "timed out after 1 s"):
        engine.init_weights_update_group("127.0.0.1", _port(), 1, 2, group_name="g", timeout_s=1.0)
    assert not engine.weight_sync.groups


def test_sender_refuses_bad_input_and_a_missing_engine_times_out():
    with pytest.raises(BiEngineError, match="as rank 0 of 2: timed out after 1 s"):
        WeightSender("127.0.0.1", _port(), 2, timeout_s=1.0)
    with WeightSender("127.0.0.1", _port(), 1, timeout_s=5.0) as alone:  # a group of one: no engine needed
        for bad in ([], [("w", [1.0])], [(3, torch.zeros(2))]):
            with pytest.raises(BiEngineError, match=r"non-empty iterable of \(str, torch.Tensor\) pairs"):
                alone.send(bad, lambda *meta: None)
    with pytest.raises(RequestError, match="backend 'nccl' needs CUDA devices"):
        WeightSender("127.0.0.1", _port(), 2, backend="nccl", device="cpu")


def test_an_engine_that_never_takes_part_ends_the_trainers_send_at_the_timeout():
    """The trainer's request reached nobody that answers (it never returns) and no engine rank
    comes to the handshake: send ends after the group's timeout, naming the stage."""
    import threading

    from bi_core.rl.sync_protocol import WeightGroup

    port, peer = _port(), []
    joining = threading.Thread(target=lambda: peer.append(WeightGroup("weight_update_group", "127.0.0.1", port, 1, 2,
                                                                      "gloo", torch.device("cpu"), 2.0)))
    joining.start()
    sender = WeightSender("127.0.0.1", port, 2, timeout_s=2.0)
    joining.join()
    t0 = time.monotonic()
    with pytest.raises(BiEngineError, match="handshake with the other members of weight-update group "
                                            "'weight_update_group': timed out after 2 s"):
        sender.send([("w", torch.zeros(2))], lambda *meta: time.sleep(60))
    assert time.monotonic() - t0 < 10
    with pytest.raises(BiEngineError, match="out of step"):  # its pending handshake could pair with a later one
        sender.send([("w", torch.zeros(2))], lambda *meta: None)


def test_tp_messages_replay_the_weight_sync_calls():
    class Fake:
        def __init__(self):
            self.calls = []

        def init_weights_update_group(self, *a, wait=True):
            self.calls.append(("init", *a, wait))

        def update_weights_from_distributed(self, *a):
            self.calls.append(("update", *a))
            raise RequestError("refused here too")  # logged on a worker rank; the lock-step goes on

        def destroy_weights_update_group(self, name):
            self.calls.append(("destroy", name))

    eng = Fake()
    msgs = [ls.InitWeightsUpdateGroup("h", 1, 1, 3, "g", "gloo", 5.0),
            ls.UpdateWeightsFromTrainer(["a"], ["float32"], [[2]], "g", True, 3), ls.DestroyWeightsUpdateGroup("g")]
    assert all(replay(eng, m, rank=1) for m in msgs)
    # a worker rank joins in a thread (rank 0 steps on meanwhile): wait=False
    assert eng.calls == [("init", "h", 1, 1, 3, "g", "gloo", 5.0, False),
                         ("update", ["a"], ["float32"], [[2]], "g", True, 3),
                         ("destroy", "g")]


def test_the_example_rl_loop_runs(monkeypatch, capsys):
    """examples/rl_loop.py: a trainer process driving an engine process through generate ->
    pause -> weight sync -> resume -> generate; every round's rollouts carry its weight version."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "examples"))
    import rl_loop

    assert rl_loop.main(steps=2) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "synced 41 tensors -> weight_version 2" in out and "round 2: weight_version=2" in out


# ------------------------------------------------------------------ on a GPU (one: NCCL between two is for a two-GPU machine)


@pytest.mark.gpu
def test_gpu_nccl_calls_in_a_group_of_one():
    """The protocol's NCCL path (group, handshake, bucket broadcasts, confirmation, teardown) in a
    group of the trainer alone: a second rank needs a second GPU."""
    with WeightSender("127.0.0.1", _port(), 1, backend=None) as alone:
        assert alone.group.backend == "nccl" and alone.group.device.type == "cuda"
        pairs = [("w", torch.randn(1000, device="cuda")), ("b", torch.ones(3, dtype=torch.bfloat16, device="cuda"))]
        assert alone.send(pairs, lambda *meta: "done", bucket_mb=0.001) == "done"


@pytest.mark.gpu
def test_gpu_engine_takes_a_cpu_trainers_weights_over_gloo():
    """An engine on the GPU, a trainer on the CPU (gloo): the buckets land in host memory and are
    copied into the GPU's parameters; the outputs are the trainer's model's on the GPU, bitwise."""
    engine = build_engine(_config(0, device="cuda"))
    out = _sync(engine, ["bad_shape", "good"], backend="gloo")
    assert out["reports"]["bad_shape"][0] == "error" and out["reports"]["good"][:2] == ("ok", 41)
    got = _run(engine)
    want = _run(build_engine(_config(1, device="cuda")))
    assert [r[:2] for r in got] == [r[:2] for r in want]
