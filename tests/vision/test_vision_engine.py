"""The engine with images (reference backend, float32) against transformers' own
Qwen3_5ForConditionalGeneration: logits and greedy tokens of image + text prompts (several
image sizes, two images, a video), M-RoPE positions, and text-only prompts unchanged."""

from __future__ import annotations

import pytest
import torch
from vl_fixtures import IDS, make_hf_vl_model, random_pixels

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import RequestError

STEPS = 6
IMG, VID, VS, VE = IDS["image_token_id"], IDS["video_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model()
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    return hf, path


def engine_for(path, **over):
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": 32},
           "cache": {"block_size": 16, "num_blocks": 128, "prefix_caching": False}}
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    return build_engine(EngineConfig.from_dict(cfg))


def prompt_with(grids_kinds, text=(5, 6, 7)) -> list[int]:
    """Text, then per item vision_start, one placeholder per frame run, vision_end, then text."""
    ids = list(text)
    for kind, (t, _, _) in grids_kinds:
        if kind == "image":
            ids += [VS, IMG, VE]
        else:
            for _ in range(t):
                ids += [11, VS, VID, VE]  # a timestamp token before each frame, as the processor writes
        ids += [8, 9]
    return ids + [10, 12]


@torch.no_grad()
def hf_reference(hf, ids: list[int], images, videos):
    """transformers' greedy decode with its own processor-free inputs: tokens and first logits."""
    kw = {}
    if images:
        kw["pixel_values"] = torch.cat([p for p, _ in images])
        kw["image_grid_thw"] = torch.tensor([g for _, g in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([p for p, _ in videos])
        kw["video_grid_thw"] = torch.tensor([g for _, g in videos])
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == IMG], types[input_ids == VID] = 1, 2
    out = hf.generate(input_ids, mm_token_type_ids=types, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kw)
    return out.sequences[0, len(ids):].tolist(), out.logits[0][0].float()


def hf_ids(ids, images, videos) -> list[int]:
    """The prompt with every placeholder run as long as its item's tokens (the processor's job)."""
    out, im, vf = [], iter(images), iter([(p, (1, g[1], g[2])) for p, g in videos for _ in range(g[0])])
    for t in ids:
        if t == IMG:
            _, (gt, h, w) = next(im)
            out += [IMG] * (gt * h * w // 4)
        elif t == VID:
            _, (_, h, w) = next(vf)
            out += [VID] * (h * w // 4)
        else:
            out.append(t)
    return out


CASES = [
    pytest.param([("image", (1, 4, 4))], id="image-16-patches"),
    pytest.param([("image", (1, 6, 10))], id="image-wide"),
    pytest.param([("image", (1, 8, 4)), ("image", (1, 2, 2))], id="two-images"),
    pytest.param([("video", (2, 4, 6))], id="video-2-frames"),
]


@pytest.mark.parametrize("items", CASES)
def test_matches_transformers(checkpoint, items):
    hf, path = checkpoint
    media = [(random_pixels([g], hf, seed=i), g) for i, (_, g) in enumerate(items)]
    images = [m for m, (k, _) in zip(media, items) if k == "image"]
    videos = [m for m, (k, _) in zip(media, items) if k == "video"]
    ids = prompt_with(items)
    tokens, first = hf_reference(hf, hf_ids(ids, images, videos), images, videos)
    eng = engine_for(path)
    seen = {}
    eng.on_logits = lambda seqs, logits: seen.setdefault("first", logits[0].float().clone())
    out = eng.generate(ids, SamplingParams(max_new_tokens=STEPS, ignore_eos=True),
                       images=[{"pixel_values": p, "grid_thw": g} for p, g in images] or None,
                       videos=[{"pixel_values": p, "grid_thw": g} for p, g in videos] or None)[0]
    assert out.error is None, out.error
    assert out.prompt_token_ids == hf_ids(ids, images, videos)
    assert float((seen["first"] - first).norm() / first.norm()) < 1e-4
    assert out.token_ids == tokens


def first_logits_and_tokens(eng, prompts):
    seen = {}

    def observe(seqs, logits):
        for s, row in zip(seqs, logits):
            if not s.output_ids:
                seen[s.request_id] = row.float().clone()

    eng.on_logits = observe
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))
    return [seen[o.request_id] for o in outs], [o.token_ids for o in outs]


def test_text_only_prompts_unchanged_by_the_tower(checkpoint):
    """A text-only prompt on an engine with the vision tower: the same bits as without it."""
    _, path = checkpoint
    prompts = [[5, 6, 7, 8], list(range(1, 40)), [3]]
    with_tower = engine_for(path)
    assert with_tower.runner.vision is not None
    without = engine_for(path, vision={"enabled": False})
    assert without.runner.vision is None
    a, b = first_logits_and_tokens(with_tower, prompts), first_logits_and_tokens(without, prompts)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]


def test_refusals(checkpoint):
    hf, path = checkpoint
    eng = engine_for(path, vision={"max_images_per_request": 1, "max_vision_tokens_per_request": 10})
    img = {"pixel_values": random_pixels([(1, 4, 4)], hf), "grid_thw": (1, 4, 4)}
    big = {"pixel_values": random_pixels([(1, 8, 8)], hf), "grid_thw": (1, 8, 8)}
    cases = [
        ([5, VS, IMG, VE, IMG], [img, img], "vision.max_images_per_request is 1"),
        ([5, VS, IMG, VE], [big], "vision.max_vision_tokens_per_request is 10"),
        ([5, 6], [img], "1 images given but the prompt has 0 image placeholders"),
        ([5, IMG, IMG, IMG, 6], [img], "a placeholder run has 3 tokens"),
        ([5, IMG, 6], None, "placeholder tokens but no images"),
        ([5, IMG], [{"pixel_values": img["pixel_values"], "grid_thw": (1, 4, 6)}], "pixel_values has shape"),
        ([5, IMG], [{"pixels": 1}], "exactly the keys pixel_values and grid_thw"),
        ([5, IMG], ["not an image"], "an image must be"),
    ]
    for ids, images, message in cases:
        with pytest.raises(RequestError, match=message):
            eng.add_request(ids, SamplingParams(max_new_tokens=1), images=images)
    eng_text = engine_for(path, vision={"enabled": False})
    with pytest.raises(RequestError, match="takes no images"):
        eng_text.add_request([5, IMG], SamplingParams(max_new_tokens=1), images=[img])
    with pytest.raises(RequestError, match="1 prompts but 2 entries in images"):
        eng.generate([[5, IMG]], images=[[img], [img]])


def test_enabled_true_without_a_tower_is_refused(tmp_path):
    from bi_core.errors import ConfigError

    cfg = {"model": {"random": {"preset": "tiny-dense"}, "dtype": "float32", "device": "cpu"},
           "backend": "reference", "vision": {"enabled": True}}
    with pytest.raises(ConfigError, match="vision.enabled: true on a random model of vocabulary 260"):
        build_engine(EngineConfig.from_dict(cfg))


def test_explain_lists_the_towers_ops(checkpoint):
    from bi_core.runtime.build import explain

    _, path = checkpoint
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference"}
    text = explain(EngineConfig.from_dict(cfg))
    assert "layer_norm" in text and "vision_attention" in text
    off = explain(EngineConfig.from_dict({**cfg, "vision": {"enabled": False}}))
    assert "vision_attention" not in off
