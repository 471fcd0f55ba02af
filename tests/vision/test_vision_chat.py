"""``engine.chat`` with image parts: the conversation through the checkpoint's chat template, each
image part as Qwen's placeholder text, equal to ``generate`` on the rendered prompt; bad parts refused."""

from __future__ import annotations

import pytest
import torch
from vl_fixtures import IDS, make_hf_vl_model, random_pixels, save_tokenizer

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import RequestError

IMG = IDS["image_token_id"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf = make_hf_vl_model(seed=5)
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    save_tokenizer(path)
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu", "max_model_len": 512},
           "backend": "reference", "cache": {"block_size": 16, "num_blocks": 128}}
    return hf, build_engine(EngineConfig.from_dict(cfg))


def test_chat_with_an_image_equals_generate(engine):
    hf, eng = engine
    img = {"pixel_values": random_pixels([(1, 4, 4)], hf), "grid_thw": (1, 4, 4)}
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image", "image": img},
                                             {"type": "text", "text": " this"}]}]
    rendered = "what is <|vision_start|><|image_pad|><|vision_end|> this"
    ids = eng.tokenizer.chat([{"role": "user", "content": rendered}]).ids
    want = eng.generate(ids, params, images=[img])[0]
    got = eng.chat(messages, params)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.prompt_token_ids.count(IMG) == 4
    assert got.token_ids == want.token_ids and got.token_logprobs == want.token_logprobs
    both = eng.chat([messages, [{"role": "user", "content": "what is this"}]], params)
    assert len(both) == 2 and both[0].token_ids == want.token_ids and IMG not in both[1].prompt_token_ids
    torch.testing.assert_close(torch.tensor(both[0].token_logprobs), torch.tensor(want.token_logprobs))


def test_bad_parts_are_refused(engine):
    _, eng = engine
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\]: a part is"):
        eng.chat([{"role": "user", "content": [{"type": "audio", "audio": b""}]}])
    with pytest.raises(RequestError, match="must be a dict with role and content"):
        eng.chat([{"content": "x"}])
