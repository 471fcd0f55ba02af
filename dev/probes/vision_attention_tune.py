"""The vision tower on the GPU, for tuning the invariant backend's tower: (1) the invariant
attention kernel under several tile / launch configs (set on ``bi_core.kernels.vision``'s module
constants) against SDPA at the published head shape (16 heads of 72), each config checked
bitwise (an image alone == the same image among others); (2) the tower's kernel table on both
backends (torch.profiler, 8 images of 448x448 and 2 of 1024x1024), to see where the tax is.

    python3 dev/probes/vision_attention_tune.py [--depth 27]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bi_core.kernels import vision as kv

CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3),
           (64, 32, 4, 3), (128, 128, 8, 2)]
HEADS, DIM = 16, 72


def timed(fn, *args, repeats: int = 10) -> float:
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def attention_table() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for images, length in ((8, 4096), (32, 784)):
        t = images * length
        q, k, v = (torch.randn(t, HEADS, DIM, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = [i * length for i in range(images + 1)]
        scale = DIM**-0.5
        qs, ks, vs = (x.view(images, length, HEADS, DIM).transpose(1, 2) for x in (q, k, v))
        sdpa = timed(F.scaled_dot_product_attention, qs, ks, vs, None, 0.0, False, scale)
        print(f"\n{images} images x {length} tokens: SDPA {sdpa:.3f} ms")
        for bm, bn, warps, stages in CONFIGS:
            kv.BLOCK_M, kv.BLOCK_N, kv.NUM_WARPS, kv.NUM_STAGES = bm, bn, warps, stages
            try:
                ms = timed(kv.vision_attention, q, k, v, cu, scale)
                full = kv.vision_attention(q, k, v, cu, scale)
                one = kv.vision_attention(q[length:2 * length], k[length:2 * length], v[length:2 * length],
                                          [0, length], scale)
                same = torch.equal(one, full[length:2 * length])
                ref = F.scaled_dot_product_attention(qs[1:2].float(), ks[1:2].float(), vs[1:2].float(), scale=scale)
                err = (one.float() - ref[0].transpose(0, 1)).abs().max().item()
                print(f"  BLOCK_M {bm:3d} BLOCK_N {bn:3d} warps {warps} stages {stages}: {ms:.3f} ms "
                      f"({ms / sdpa:.2f}x SDPA), alone == batched: {same}, max |err| {err:.2e}")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row of the table
                print(f"  BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: {type(e).__name__}: {str(e)[:120]}")
    kv.BLOCK_M, kv.BLOCK_N, kv.NUM_WARPS, kv.NUM_STAGES = CONFIGS[0]


def tower_profiles(depth: int) -> None:
    from bi_core import EngineConfig, build_engine

    for backend in ("cuda_default", "cuda_hopper_invariant"):
        eng = build_engine(EngineConfig.from_dict({
            "model": {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": 1},
                      "dtype": "bfloat16", "device": "cuda", "max_model_len": 8192},
            "backend": backend, "policy": {"batch_invariant": backend == "cuda_hopper_invariant"},
            "graph": {"enabled": False}, "cache": {"num_blocks": 256}, "vision": {"enabled": True, "random_depth": depth}}))
        tower = eng.runner.vision
        for grid, n in (((1, 28, 28), 8), ((1, 64, 64), 2)):
            x = torch.randn(n * grid[1] * grid[2], tower.args.patch_dim, device="cuda")
            with torch.inference_mode():
                ms = timed(tower, x, [grid] * n, repeats=5)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    tower(x, [grid] * n)
                    torch.cuda.synchronize()
            print(f"\n{backend}, {n} x {grid}: {ms:.2f} ms")
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=70))
        del eng
        tower = None
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=27)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    attention_table()
    tower_profiles(args.depth)


if __name__ == "__main__":
    main()
