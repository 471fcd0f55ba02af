"""benchmarks/vision_bench.py runs end to end in its CPU smoke mode (its figures come from GPU runs),
and the random tower at the published shape gives finite, O(1) embeddings."""

from __future__ import annotations

import json

import torch
from helpers import benchmark_module

from bi_core.models.vision_tower import VisionArgs, VisionTower, init_random_vision
from bi_core.plugins import load_registry
from bi_core.policies import make_policy
from bi_core.selector import OpFactory


def test_vision_bench_smoke(tmp_path):
    out = tmp_path / "vision.json"
    assert benchmark_module("vision_bench").main(["--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    figures = report["reference"]
    assert report["smoke"] and set(figures) == {"images_per_s_small", "images_per_s_large", "ttft_ms_image_prompt"}
    assert all(v > 0 for v in figures.values())


def test_random_published_tower_is_well_scaled():
    policy = make_policy(batch_invariant=False, backend="reference", op_overrides={})
    factory = OpFactory(load_registry(), policy, torch.device("cpu"), torch.float32)
    args = VisionArgs.published(out_hidden_size=64, depth=2)
    assert (args.hidden_size, args.num_heads, args.patch_size, args.num_position_embeddings) == (1152, 16, 16, 2304)
    tower = VisionTower(args, factory, torch.float32, torch.device("cpu"))
    init_random_vision(tower, 0)
    with torch.inference_mode():
        out = tower(torch.randn(64, args.patch_dim), [(1, 8, 8)])
    assert out.shape == (16, 64) and torch.isfinite(out).all() and 0.05 < out.std() < 20
