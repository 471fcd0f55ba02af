"""Images through a real server: SGLang's ``image_data`` in ``/generate`` and OpenAI chat
``image_url`` parts (a data: URL, a file under vision.media_root) give the Python API's tokens
(one torch thread on both sides); a network URL, a file outside the root and a bad part are 400s
naming the field."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("PIL")
from serve_helpers import ServerProcess, httpx  # noqa: E402
from vl_fixtures import IDS, make_hf_vl_model, save_tokenizer  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402

IMG, VS, VE = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
def png(seed: int = 0) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (24, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def decoded(raw: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vision_http")
    make_hf_vl_model(seed=4).save_pretrained(tmp / "ckpt")
    save_tokenizer(tmp / "ckpt")
    (tmp / "media").mkdir()
    (tmp / "media" / "cat.png").write_bytes(png(1))
    (tmp / "outside.png").write_bytes(png(1))
    config = {"model": {"path": str(tmp / "ckpt"), "dtype": "float32", "device": "cpu"}, "backend": "reference",
              "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
              "cache": {"block_size": 16, "num_blocks": 256}, "serve": {"model_name": "vl"},
              "vision": {"media_root": str(tmp / "media")}}
    server = ServerProcess(tmp, config=yaml.safe_dump(config), env=ONE_THREAD)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = build_engine(EngineConfig.from_dict(config))
    yield server, engine, tmp
    torch.set_num_threads(before)
    server.stop()


PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def test_generate_image_data(setup):
    server, engine, _ = setup
    ids = [0, 1, VS, IMG, VE, 2]
    want = engine.generate(ids, PARAMS, images=[decoded(png(0))])[0]
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "input_ids": ids, "image_data": data_url(png(0)),
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want.token_ids


def chat(server, content, **extra):
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "vl", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": True, **extra})


def test_chat_image_url_data_and_file(setup):
    server, engine, _ = setup
    ids = engine.tokenizer.chat([{"role": "user", "content": "what is <|vision_start|><|image_pad|>"
                                                                 "<|vision_end|> this"}]).ids
    assert ids.count(IMG) == 1
    want = engine.generate(ids, PARAMS, images=[decoded(png(1))])[0]
    for url in (data_url(png(1)), "cat.png", "file://" + str(setup[2] / "media" / "cat.png")):
        r = chat(server, [{"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": url}},
                          {"type": "text", "text": " this"}])
        assert r.status_code == 200, r.text
        lps = [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]
        assert lps == want.token_logprobs, url


@pytest.mark.parametrize("url,message", [
    ("https://example.com/cat.png", "not fetched from the network"),
    ("../outside.png", "outside vision.media_root"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded"),
])
def test_chat_refusals(setup, url, message):
    r = chat(setup[0], [{"type": "image_url", "image_url": {"url": url}}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == "messages[0].content[0].image_url.url"


def test_bad_part_and_too_many_images(setup):
    r = chat(setup[0], [{"type": "audio", "audio": "x"}])
    assert r.status_code == 400 and "content parts are" in r.text
    r = httpx.post(f"{setup[0].url}/generate", timeout=60, json={"input_ids": [0, IMG], "image_data": [data_url(png())] * 17})
    assert r.status_code == 400 and "vision.max_images_per_request is 16" in r.text, r.text
    assert json.loads(r.text)["error"]
