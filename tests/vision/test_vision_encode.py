"""The tower between steps within a budget (reference backend, float32): a request's images are
encoded image by image, at most ``vision.max_num_encoder_input_tokens`` vision tokens a step,
while another request's stream emits a token every step; its prefill waits for them; its
embeddings (and so its output) are the same bits however the encoding was spread over steps."""

from __future__ import annotations

import pytest
import torch
from vl_fixtures import IDS, make_hf_vl_model, random_pixels

from bi_core import ConfigError, EngineConfig, SamplingParams, build_engine
from bi_core.runtime.sequence import Status

IMG, VS, VE = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
GRIDS = [(1, 8, 8), (1, 8, 12), (1, 4, 8), (1, 12, 8)]  # 16, 24, 8 and 24 vision tokens
PROMPT = [5, 6] + [t for _ in GRIDS for t in (VS, IMG, VE, 7)] + [8, 9, 10]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model(seed=4)
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    return hf, path


def engine_for(path, budget: int | None = None):
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": 64},
           "cache": {"block_size": 16, "num_blocks": 128, "prefix_caching": False}}
    if budget is not None:
        cfg["vision"] = {"max_num_encoder_input_tokens": budget}
    return build_engine(EngineConfig.from_dict(cfg))


def images(hf, order=(0, 1, 2, 3)):
    return [{"pixel_values": random_pixels([GRIDS[i]], hf, seed=10 + i), "grid_thw": GRIDS[i]} for i in order]


def tower_calls(eng) -> list:
    calls, forward = [], eng.runner.vision.forward
    eng.runner.vision.forward = lambda pixels, grids: calls.append(list(grids)) or forward(pixels, grids)
    return calls


def test_a_stream_decodes_every_step_while_the_images_are_encoded(checkpoint):
    hf, path = checkpoint
    eng = engine_for(path, budget=24)  # 16 + 24, 24 + 8 and 8 + 24 pass it: one image a step
    calls = tower_calls(eng)
    stream = eng.add_request([3, 4, 5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.step()
    assert len(stream.output_ids) == 1
    req = eng.add_request(PROMPT, PARAMS, images=images(hf))
    per_step = []
    while req.num_computed == 0:
        before = len(stream.output_ids)
        eng.step()
        assert len(stream.output_ids) == before + 1  # the stream never waits for the tower
        per_step.append(len(calls))
    assert calls == [[g] for g in GRIDS]  # one tower call an image
    assert per_step == [1, 2, 3, 4]  # the step that encoded the last image ran the prompt's first chunk
    assert req.status is Status.RUNNING
    while eng.scheduler.has_work():
        eng.step()
    at_once = engine_for(path)
    calls_once = tower_calls(at_once)
    ref = at_once.add_request(PROMPT, PARAMS, images=images(hf))
    at_once.step()
    assert calls_once == [[g] for g in GRIDS] and ref.num_computed > 0  # all in the first step, then its prefill
    assert torch.equal(req.mm.embeds, ref.mm.embeds)  # the same rows, however the encoding was spread
    swapped = engine_for(path)  # negative control: the images in another order
    other = swapped.add_request(PROMPT, PARAMS, images=images(hf, (1, 0, 2, 3)))
    swapped.step()
    assert other.mm.embeds.shape == ref.mm.embeds.shape and not torch.equal(other.mm.embeds, ref.mm.embeds)


def test_output_is_the_same_bits_encoded_a_step_at_a_time_or_at_once(checkpoint):
    hf, path = checkpoint
    outs = []
    for budget in (8, None):
        eng = engine_for(path, budget)
        calls = tower_calls(eng)
        outs.append(eng.generate(PROMPT, PARAMS, images=images(hf))[0])
        assert calls == [[g] for g in GRIDS]
    assert outs[0].token_ids == outs[1].token_ids
    assert torch.equal(torch.tensor(outs[0].token_logprobs), torch.tensor(outs[1].token_logprobs))


def test_budget_is_checked(checkpoint):
    with pytest.raises(ConfigError, match="vision.max_num_encoder_input_tokens"):
        engine_for(checkpoint[1], budget=0)
