"""The vision tower's throughput (images/s at 448x448 and 1024x1024) and the time to first token
of an image prompt, the default and the invariant backend in one run (random weights at the
published tower shape and the 35B-A3B text shape at reduced depth, initialised on the GPU).

python3 benchmarks/vision_bench.py [--layers 4] [--depth 27] [--batch 8] [--repeats 10] [--json out.json]
python3 benchmarks/vision_bench.py --smoke   # CPU: a tiny checkpoint on the reference backend (a run-through)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bi_core import EngineConfig, SamplingParams, build_engine

VS, IMG, VE = 248053, 248056, 248054
SIZES = {"448x448": (1, 28, 28), "1024x1024": (1, 64, 64)}  # 16-pixel patches
BACKENDS = ("cuda_default", "cuda_hopper_invariant")


def gpu_config(backend: str, layers: int, depth: int) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": layers},
                  "dtype": "bfloat16", "device": "cuda", "max_model_len": 8192},
        "backend": backend, "policy": {"batch_invariant": backend == "cuda_hopper_invariant"},
        "graph": {"enabled": True}, "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 8192},
        "cache": {"num_blocks": 4096}, "vision": {"enabled": True, "random_depth": depth}})


def smoke_checkpoint(path: Path) -> tuple[EngineConfig, dict, tuple[int, int, int]]:
    """A tiny multimodal checkpoint made with transformers' classes (its own random init)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96,
                model_type="qwen3_5_text", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, out_hidden_size=64,
                  num_position_embeddings=16)
    ids = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, **ids)).save_pretrained(path)
    cfg = EngineConfig.from_dict({"model": {"path": str(path), "dtype": "float32", "device": "cpu", "max_model_len": 1024},
                                  "backend": "reference", "cache": {"block_size": 16, "num_blocks": 256}})
    return cfg, ids, (1, 8, 8)


def pixels(grid: tuple[int, int, int], patch_dim: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], patch_dim, generator=g, device=device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def images_per_s(tower, grid, batch: int, repeats: int) -> float:
    """The tower over ``batch`` images of ``grid`` at once, median of ``repeats`` (after one warm-up)."""
    dev = tower.device
    x = torch.cat([pixels(grid, tower.args.patch_dim, i, dev) for i in range(batch)])
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            sync(dev)
            t0 = time.perf_counter()
            tower(x, [grid] * batch)
            sync(dev)
            if i:
                times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def ttft_ms(eng, ids: dict, grid, repeats: int) -> float:
    """A 448x448-image prompt's time to its first token (encoder, prefill, one sample), median."""
    prompt = [5] * 32 + [ids["vision_start_token_id"], ids["image_token_id"], ids["vision_end_token_id"]] + [6] * 32
    patch_dim = eng.runner.vision.args.patch_dim
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        img = {"pixel_values": pixels(grid, patch_dim, 100 + i, torch.device("cpu")), "grid_thw": grid}
        sync(eng.device)
        t0 = time.perf_counter()
        eng.generate(prompt, params, images=[img])
        sync(eng.device)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(eng, ids: dict, sizes: dict, batch: int, repeats: int, ttft_grid) -> dict:
    out = {f"images_per_s_{name}": images_per_s(eng.runner.vision, grid, batch if name.startswith("448") else
                                                 max(1, batch // 4), repeats) for name, grid in sizes.items()}
    out["ttft_ms_image_prompt"] = ttft_ms(eng, ids, ttft_grid, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="text layers of the 35B-A3B shape")
    ap.add_argument("--depth", type=int, default=27, help="vision blocks (the published tower has 27)")
    ap.add_argument("--batch", type=int, default=8, help="448x448 images per tower call (1024x1024: a quarter)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU run-through on a tiny checkpoint")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report: dict = {"smoke": args.smoke}
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            cfg, ids, grid = smoke_checkpoint(Path(tmp) / "ckpt")
            eng = build_engine(cfg)
            report["reference"] = measure(eng, ids, {"small": grid, "large": (1, 16, 16)}, 2, 2, grid)
    else:
        ids = {"vision_start_token_id": VS, "image_token_id": IMG, "vision_end_token_id": VE}
        for backend in BACKENDS:
            eng = build_engine(gpu_config(backend, args.layers, args.depth))
            report[backend] = measure(eng, ids, SIZES, args.batch, args.repeats, SIZES["448x448"])
            del eng
            torch.cuda.empty_cache()
        d, i = report[BACKENDS[0]], report[BACKENDS[1]]
        report["invariance_tax"] = {k: (d[k] / i[k] if k.startswith("images") else i[k] / d[k]) - 1 for k in d}
    for name, figures in report.items():
        if isinstance(figures, dict):
            print(name, " ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
