"""Weights shared by handle (SGLang's ``update_weights_from_tensor``): a trainer process (spawned,
an OS process of its own) serializes a second model's tensors with
``bi_core.rl.serialize_named_tensors``; the payload holds handles (shared-memory names on the
CPU, CUDA IPC on a GPU), not the bytes. After the engine takes it, its outputs equal, bitwise, an
engine built from those weights. A refused payload (unknown name, another load format, not a
payload at all) changes nothing."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from helpers import tiny_config

from bi_core import CheckpointError, EngineConfig, RequestError, SamplingParams, build_engine
from bi_core.rl import serialize_named_tensors

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 60))]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)


def _config(seed: int) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-dense", "seed": seed}}))


def _run(engine) -> list:
    return [(o.token_ids, o.token_logprobs) for o in engine.generate(PROMPTS, PARAMS)]


def sharer_main(conn, case: str) -> None:
    """The trainer: the seed-1 model's weights (engine names), shared; it holds them until told."""
    weights = [(n, p.detach().clone()) for n, p in build_engine(_config(1)).model.named_parameters()]
    if case == "bad_name":
        weights = weights[:3] + [("model.layers.0.mlp.nonsense.weight", weights[0][1])]
    conn.send((serialize_named_tensors(weights), sum(t.numel() * t.element_size() for _, t in weights)))
    conn.recv()  # the engine is done with the handles


def _shared(case: str):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=sharer_main, args=(theirs, case), daemon=True)
    proc.start()
    assert mine.poll(120), "the trainer process sent nothing"
    return proc, mine, *mine.recv()


def _release(proc, conn) -> None:
    conn.send("done")
    proc.join(30)


def test_shared_weights_land_bitwise_and_the_payload_holds_handles_not_bytes():
    engine = build_engine(_config(0))
    before = _run(engine)
    proc, conn, payload, nbytes = _shared("good")
    try:
        count = engine.update_weights_from_tensor([payload], weight_version=7)
    finally:
        _release(proc, conn)
    assert count == len(list(engine.model.parameters()))
    assert len(payload) < nbytes / 20  # names and handles: the 1 MiB of weights stayed where they were
    after = _run(engine)
    assert after == _run(build_engine(_config(1))) and after != before
    assert engine.weight_version == 7


def test_a_refused_payload_changes_nothing():
    engine = build_engine(_config(0))
    before = _run(engine)
    proc, conn, payload, _ = _shared("bad_name")
    try:
        with pytest.raises(CheckpointError, match="unknown weight names .'model.layers.0.mlp.nonsense.weight'"):
            engine.update_weights_from_tensor([payload])
        with pytest.raises(RequestError, match="load_format 'flattened_bucket' is not supported"):
            engine.update_weights_from_tensor([payload], load_format="flattened_bucket")
        with pytest.raises(RequestError, match="3 payloads; expected 1 or one per tensor-parallel rank"):
            engine.update_weights_from_tensor([payload] * 3)
    finally:
        _release(proc, conn)
    with pytest.raises(RequestError, match="not base64"):
        engine.update_weights_from_tensor(["not a payload!"])
    with pytest.raises(RequestError, match="could not be opened"):
        engine.update_weights_from_tensor([b"\x80\x04garbage"])
    assert _run(engine) == before and engine.weight_version == 0
