"""The FP8 KV cache at a checkpoint's calibrated k/v scales on the invariant CUDA engine, graphs
on, from a tiny compressed-tensors FP8 checkpoint made in the test (tests/quant/fp8_fixtures.py):
a prompt's tokens and logprobs are the same alone and among other prompts (bitwise); scales of 1
give the unscaled FP8 cache's bits; the checkpoint's scales are live (other logprobs) and score
as close to the bf16 cache as the unscaled FP8 cache does, where keys and values written unscaled
but read at the scales do not (negative control). (The reference backend's side of the same
arithmetic, bitwise per kernel: tests/kernels/test_invariance_interp.py; the invariant backend
serves bf16 only, so no float32 comparison here.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from fp8_fixtures import ATTENTION, kv_scaled_checkpoint, make_hf_b128  # noqa: E402

import bi_core.backends.cuda_common.attention as cuda_attention  # noqa: E402
from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402

pytestmark = pytest.mark.gpu

# keys stored 2.7x larger and values 2.9x smaller than at scale 1 (other e4m3 roundings), per layer
SCALES = {ATTENTION[0]: (0.37, 2.9), ATTENTION[1]: (0.05, 0.6)}
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.7, seed=3, ignore_eos=True, logprobs=0)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def config(path, kv="fp8"):
    return EngineConfig.from_dict(tiny_config(
        model={"random": None, "path": str(path), "dtype": "bfloat16", "device": "cuda"},
        backend="cuda_hopper_invariant", policy={"batch_invariant": True}, graph={"enabled": True, "warmup": False},
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 1024}, cache={"num_blocks": 1024, "kv_cache_dtype": kv}))


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(m),), generator=g).tolist() for m in torch.randint(1, 300, (n,), generator=g)]


def run(eng, needle, fillers):
    """The needle's (tokens, logprobs), its request among ``fillers`` (half of them already running)."""
    seqs = [eng.add_request(p, PARAMS) for p in fillers[: len(fillers) // 2]]
    eng.step()
    n = eng.add_request(needle, PARAMS)
    seqs += [eng.add_request(p, PARAMS) for p in fillers[len(fillers) // 2:]]
    while eng.scheduler.has_work():
        eng.step()
    return n.output_ids, n.token_logprobs


def test_kv_scaled_fp8_cache_invariant_and_as_the_reference(tmp_path, monkeypatch):
    hf = make_hf_b128("moe")
    path = kv_scaled_checkpoint(hf, tmp_path / "scaled", SCALES)
    needle = prompts(1, seed=9)[0] + [5] * 200  # past two 128-key KV chunks by the end
    eng = build_engine(config(path))
    assert eng.args.kv_scales and eng.runner.cache.main.k[0].dtype == torch.float8_e4m3fn
    alone = run(eng, needle, [])
    for n in (3, 17, 63):
        assert run(build_engine(config(path)), needle, prompts(n, seed=n)) == alone, n
    assert eng.runner.main_graphs.num_replays[1] > 0
    ones = run(build_engine(config(kv_scaled_checkpoint(hf, tmp_path / "ones", {i: (1.0, 1.0) for i in ATTENTION}))),
               needle, [])
    plain = run(build_engine(config(kv_scaled_checkpoint(hf, tmp_path / "plain", None, scheme=None))), needle, [])
    assert ones == plain  # scale 1 is the unscaled cache, bit for bit
    assert alone[1] != ones[1]  # the checkpoint's scales are live
    # accuracy against the bf16 cache, all on this engine in bf16, teacher-forced on the same tokens:
    # the scaled cache is as close as the unscaled FP8 cache; keys and values written at scale 1 but
    # read at the checkpoint's scales (layer 3's scores 20x too small) are far off (negative control).
    # On the CPU (the reference backend in bf16, prompts seeded 5..7): 0.07-0.13, 0.09-0.12 and 0.53-0.86.
    ps = prompts(4, seed=5)
    tokens = [o.token_ids for o in build_engine(config(path, kv="auto")).generate(ps, GREEDY)]

    def logprobs(p, kv="fp8"):
        return [x for o in build_engine(config(p, kv=kv)).score(ps, tokens) for x in o.token_logprobs]

    full = logprobs(path, "auto")

    def mean_error(p):
        got = logprobs(p)
        return sum(abs(a - b) for a, b in zip(got, full)) / len(full)

    scaled, unscaled = mean_error(path), mean_error(tmp_path / "plain")
    monkeypatch.setattr(cuda_attention, "inv_scale", lambda scale: 1.0)
    wrong = mean_error(path)
    print(f"mean |logprob - bf16 cache's| over {len(full)} tokens: scaled {scaled:.4f}, unscaled FP8 {unscaled:.4f}, "
          f"written unscaled and read scaled {wrong:.4f}")
    assert scaled < 2 * unscaled + 0.05 and wrong > 2 * max(scaled, unscaled)
