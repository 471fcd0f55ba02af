"""Images under LoRA adapters (reference backend, float32): an image prompt's steps (eager, M-RoPE)
run under its request's adapter, and the prefix cache keys on both the adapter version and the
image content: a repeated image under another adapter never hits."""

from __future__ import annotations

import pytest
from vl_fixtures import IDS, make_hf_vl_model, random_pixels, save_with_mtp

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.lora.synthetic import random_adapter

IMG, VS, VE = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
GRID = (1, 8, 8)  # 16 vision tokens
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, VS, IMG, VE] + list(range(30, 60))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model(seed=2)
    return hf, save_with_mtp(hf, tmp_path_factory.mktemp("vl") / "ckpt")


def engine_for(path, prefix: bool):
    eng = build_engine(EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": 16},
        "cache": {"block_size": 16, "num_blocks": 128, "prefix_caching": prefix},
        "lora": {"max_loras": 2, "max_rank": 8}}))
    for name, seed in (("a", 1), ("b", 2)):
        cfg, tensors = random_adapter(eng, r=8, seed=seed, scale=2.0)
        eng.load_lora_adapter(name, tensors=tensors, config=cfg)
    return eng


def run(eng, hf, seed: int, lora: str | None):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1, lora_name=lora)
    return eng.generate(PROMPT, params, images=[{"pixel_values": random_pixels([GRID], hf, seed=seed),
                                                 "grid_thw": GRID}])[0]


def test_an_image_prompt_runs_under_its_adapter(checkpoint):
    hf, path = checkpoint
    eng = engine_for(path, prefix=False)
    base, a, b = (run(eng, hf, 1, lora) for lora in (None, "a", "b"))
    assert a.token_ids != base.token_ids and b.token_ids != base.token_ids and a.token_ids != b.token_ids
    assert run(eng, hf, 1, "a").token_logprobs == a.token_logprobs  # the same adapter, the same bits


def test_prefix_cache_keys_on_adapter_and_image(checkpoint):
    hf, path = checkpoint
    cold = engine_for(path, prefix=False)
    want = {(s, lo): run(cold, hf, s, lo).token_ids for s, lo in ((1, "a"), (1, "b"), (2, "a"))}
    eng = engine_for(path, prefix=True)
    first = run(eng, hf, 1, "a")
    other_adapter = run(eng, hf, 1, "b")  # the same image and ids, another adapter: nothing shared
    again = run(eng, hf, 1, "a")
    other_image = run(eng, hf, 2, "a")
    assert first.num_cached_tokens == 0 and other_adapter.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32  # past the image
    assert other_image.num_cached_tokens <= PROMPT.index(IMG)
    assert first.token_ids == again.token_ids == want[1, "a"]
    assert other_adapter.token_ids == want[1, "b"] and other_image.token_ids == want[2, "a"]


def test_prefix_cache_negative_control(checkpoint, monkeypatch):
    """Keyed without the adapter, the same image under another adapter would hit the first's pages."""
    from bi_core.runtime import prefix_cache

    hf, path = checkpoint
    monkeypatch.setattr(prefix_cache, "_parent_key", lambda parent, seq: id(parent) if parent is not None else "root")
    eng = engine_for(path, prefix=True)
    run(eng, hf, 1, "a")
    assert run(eng, hf, 1, "b").num_cached_tokens >= 32
