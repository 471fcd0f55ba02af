"""Vision on the GPU (35B-A3B shape at reduced depth, the published tower shape at 2 blocks, random
weights): an image request's tokens and logprobs bitwise the same alone and among up to 255 mixed
text and image requests on the invariant engine, greedy and seeded; the tower's embeddings of an
image bitwise the same alone and among other images; the default engine (negative control) must
show a difference somewhere."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

VS, IMG, VE = 248053, 248056, 248054
PATCH_DIM = 3 * 2 * 16 * 16


def vision_config(backend: str, graphs: bool = True) -> EngineConfig:
    invariant = backend == "cuda_hopper_invariant"
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": 4}, "dtype": "bfloat16",
               "device": "cuda", "max_model_len": 4096},
        backend=backend, policy={"batch_invariant": invariant}, graph={"enabled": graphs, "warmup": False},
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 4096}, cache={"num_blocks": 8192},
        vision={"enabled": True, "random_depth": 2}))


def image(grid: tuple[int, int, int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=g), "grid_thw": grid}


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


NEEDLE = (text(40, 1) + [VS, IMG, VE] + text(30, 2), [image((1, 28, 28), 3)])  # a 448 x 448 image: 196 tokens
GRIDS = [(1, 16, 16), (1, 28, 28), (1, 32, 24), (1, 8, 40)]


def fillers(n: int, seed: int) -> list[tuple[list[int], list | None]]:
    """Half text prompts, half image prompts of several sizes (other pixels than the needle's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 300, (1,), generator=g))
        if i % 2:
            out.append((text(length, seed * 1000 + i), None))
        else:
            grid = GRIDS[i // 2 % len(GRIDS)]
            out.append((text(length % 50 + 1, seed * 1000 + i) + [VS, IMG, VE] + text(5, i),
                        [image(grid, seed * 1000 + i)]))
    return out


def run(eng, others, params):
    """The needle's (tokens, logprobs): half the others already running when it arrives."""
    seqs = [eng.add_request(p, params, images=imgs) for p, imgs in others[: len(others) // 2]]
    if seqs:
        eng.step()
    needle = eng.add_request(NEEDLE[0], params, images=NEEDLE[1])
    for p, imgs in others[len(others) // 2:]:
        eng.add_request(p, params, images=imgs)
    while eng.scheduler.has_work():
        eng.step()
    return needle.output_ids, needle.token_logprobs


PARAMS = {"greedy": SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=0),
          "seeded": SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True, logprobs=0)}


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_image_request_bitwise_alone_and_among_255_and_default_is_not(mode):
    params = PARAMS[mode]
    eng = build_engine(vision_config("cuda_hopper_invariant"))
    alone = run(eng, [], params)
    for n, seed in ((3, 1), (63, 2), (255, 3)):
        assert run(eng, fillers(n, seed), params) == alone, n
    del eng
    torch.cuda.empty_cache()
    default = build_engine(vision_config("cuda_default"))
    d_alone = run(default, [], params)
    assert any(run(default, fillers(n, seed), params) != d_alone for n, seed in ((63, 2), (255, 3)))


def test_image_requests_decode_steps_replay_graphs_with_the_eager_bits():
    """Decode steps of image requests (beside text ones) replay the captured decode graphs, at
    their shifted 1-D positions: the same tokens and logprobs as the eager engine's, bitwise."""
    params = PARAMS["seeded"]
    eng = build_engine(vision_config("cuda_hopper_invariant"))
    steps, execute = [], eng.runner.execute

    def recorded(fwd):
        out = execute(fwd)
        if fwd.head == "model" and all(r.seq.output_ids for r in fwd.rows) and any(r.seq.mm for r in fwd.rows):
            steps.append(out.graph)
        return out

    eng.runner.execute = recorded
    graphed = run(eng, fillers(7, 4), params)
    assert steps and all(g is not None and not g.chunk for g in steps), steps
    del eng
    torch.cuda.empty_cache()
    assert run(build_engine(vision_config("cuda_hopper_invariant", graphs=False)), fillers(7, 4), params) == graphed


def test_tower_embeddings_bitwise_among_other_images_and_default_is_not():
    """Needles from 4 patches (1 token) to 784 (196 tokens): alone, a small image's GEMMs have a
    few rows, where cuBLAS picks other kernels (split-K) than in a batch of thousands of rows; the
    default tower must differ for some needle, the invariant one for none."""
    needles = [image(g, 3 + i) for i, g in enumerate([(1, 2, 2), (1, 4, 4), (1, 8, 8), (1, 28, 28)])]

    def mismatches(backend: str) -> int:
        eng = build_engine(vision_config(backend, graphs=False))
        tower, device = eng.runner.vision, eng.device
        others = [image(g, 10 + i) for i, g in enumerate(GRIDS * 4)]
        bad = 0
        with torch.inference_mode():
            for needle in needles:
                alone = tower(needle["pixel_values"].to(device), [needle["grid_thw"]])
                for k in (1, 5, 16):
                    batch = others[:k] + [needle] + others[k:2 * k]
                    out = tower(torch.cat([x["pixel_values"] for x in batch]).to(device),
                                [x["grid_thw"] for x in batch])
                    start = sum(x["pixel_values"].shape[0] for x in others[:k]) // 4
                    bad += not torch.equal(out[start:start + alone.shape[0]], alone)
        del eng
        torch.cuda.empty_cache()
        return bad

    assert mismatches("cuda_hopper_invariant") == 0
    assert mismatches("cuda_default") > 0
