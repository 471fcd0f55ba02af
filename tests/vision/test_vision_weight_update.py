"""Weight updates reach the vision tower: ``model.visual.*`` tensors in an update (in memory or a
checkpoint directory) are checked with the text model's and copied into the tower, so an image
request then runs exactly as on an engine started from the new weights; bad names, shapes and
dtypes are refused before anything changes; a text-only engine leaves them out and says so."""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch
from vl_fixtures import IDS, make_hf_vl_model, random_pixels

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import CheckpointError

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=0)
GRID = (1, 4, 4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A, and C: A's text model with another model's vision tower (B's)."""
    a, b = make_hf_vl_model(seed=0), make_hf_vl_model(seed=5)
    root = tmp_path_factory.mktemp("vl_update")
    a.save_pretrained(root / "a")
    visual = {k: v for k, v in b.state_dict().items() if ".visual." in k or k.startswith("visual.")}
    assert visual
    a.load_state_dict(visual, strict=False)
    a.save_pretrained(root / "c")
    return root / "a", root / "c", visual, random_pixels([GRID], a)


def engine_for(path, **vision):
    return build_engine(EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 128, "prefill_chunk_size": 32},
        "cache": {"block_size": 16, "num_blocks": 64}, "vision": vision}))


def image_answer(eng, pixels):
    ids = [5, 6, IDS["vision_start_token_id"], IDS["image_token_id"], IDS["vision_end_token_id"], 7]
    out = eng.generate(ids, PARAMS, images=[{"pixel_values": pixels, "grid_thw": GRID}])[0]
    assert out.error is None, out.error
    return out.token_ids, out.token_logprobs


@pytest.mark.parametrize("how", ["tensors", "directory"])
def test_an_update_reaches_the_tower(checkpoints, how):
    a, c, visual, pixels = checkpoints
    started_on_c = image_answer(engine_for(c), pixels)
    eng = engine_for(a)
    before = image_answer(eng, pixels)
    assert before != started_on_c  # the towers differ, so the check below can fail
    count = eng.update_weights(visual if how == "tensors" else c)
    assert count >= len(visual)
    assert image_answer(eng, pixels) == started_on_c


def test_a_bad_vision_tensor_refuses_the_whole_update(checkpoints):
    a, _, visual, pixels = checkpoints
    eng = engine_for(a)
    before = image_answer(eng, pixels)
    text = {"model.language_model.norm.weight": torch.zeros_like(eng.model.norm.weight)}
    name = "model.visual.blocks.0.attn.qkv.weight"
    for bad, match in (({"model.visual.blocks.0.attn.nope": visual[name]}, "unknown vision tensor names"),
                       ({name: visual[name][:1]}, "shape"),
                       ({name: visual[name].half()}, "dtype torch.float16")):
        with pytest.raises(CheckpointError, match=match):
            eng.update_weights({**visual, **text, **bad})
    assert image_answer(eng, pixels) == before  # neither the tower nor the text model changed


def test_a_text_only_engine_leaves_vision_tensors_out_and_says_so(checkpoints, caplog):
    a, _, visual, _ = checkpoints
    eng = engine_for(a, enabled=False)
    assert eng.runner.vision is None
    with caplog.at_level(logging.INFO, logger="bi_core.models.vision_weights"):
        assert eng.update_weights(visual) == 0
    assert f"{len(visual)} vision tower tensors (model.visual.*) not loaded" in caplog.text


def test_the_sync_groups_checks_cover_the_tower(checkpoints):
    """``update_weights_from_distributed`` checks the metadata before the handshake: a bad vision
    tensor is its refusal (the transfer itself is tests/rl/test_weight_sync.py's)."""
    a, _, visual, _ = checkpoints
    eng = engine_for(a)
    name = "model.visual.blocks.0.attn.qkv.weight"
    shape = list(visual[name].shape)
    for names, shapes, match in (([name], [shape[:1]], "shape"),
                                 (["model.visual.blocks.0.attn.nope"], [shape], "unknown vision tensor names")):
        _, steps, refusal = eng.weight_sync._check(names, ["float32"], shapes, None)
        assert steps is None and refusal is not None and match in str(refusal)
    _, steps, refusal = eng.weight_sync._check([name], ["float32"], [shape], None)
    assert refusal is None


def _vision_trainer(conn, port: int, path: str) -> None:
    """A trainer process: the checkpoint's vision tensors, sent over a gloo sync group."""
    from safetensors.torch import load_file

    from bi_core.rl import WeightSender

    pairs = [(k, v) for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(str(f)).items()
             if ".visual." in k or k.startswith("visual.")]
    sender = WeightSender("127.0.0.1", port, 2, timeout_s=20.0, device="cpu")
    conn.send(("hello",))

    def request_update(names, dtypes, shapes, **extra):
        conn.send((names, dtypes, shapes))
        return conn.recv()

    sender.send(pairs, request_update, bucket_mb=0.05)
    conn.send(("done",))


def test_a_trainer_sync_over_the_group_reaches_the_tower(checkpoints):
    a, c, _, pixels = checkpoints
    started_on_c = image_answer(engine_for(c), pixels)
    eng = engine_for(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_vision_trainer, args=(theirs, port, str(c)), daemon=True)
    proc.start()
    try:
        eng.init_weights_update_group("127.0.0.1", port, 1, 2, timeout_s=20.0)
        assert mine.poll(60) and mine.recv() == ("hello",)
        assert mine.poll(60)
        names, dtypes, shapes = mine.recv()
        mine.send(eng.update_weights_from_distributed(names, dtypes, shapes))
        assert mine.poll(60) and mine.recv() == ("done",)
        eng.destroy_weights_update_group()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert image_answer(eng, pixels) == started_on_c
