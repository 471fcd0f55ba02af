"""cuda_default options: MoE through torch._grouped_mm and a bf16 GDN state, checked against the
default paths (same weights)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine

pytestmark = pytest.mark.gpu


def test_grouped_mm_moe_matches_triton_moe():
    from bi_core.backends.cuda_common.kernel_calls import GroupedMMMoEImpl, TritonMoEImpl
    from bi_core.kernels.topk import softmax_topk

    torch.manual_seed(0)
    e, h, i, k, t = 64, 1024, 256, 8, 300
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = softmax_topk(torch.randn(t, e, device="cuda"), k)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    a = GroupedMMMoEImpl().forward(x, w, ids, w13, w2).float()
    b = TritonMoEImpl().forward(x, w, ids, w13, w2).float()
    assert float((a - b).norm() / b.norm()) < 1e-2


def test_bf16_state_and_grouped_mm_engines_run_close_to_default():
    def cfg(**extra):
        overrides = {"cache": {"num_blocks": 1024}, **extra}  # a variant's cache section replaces this one
        return EngineConfig.from_dict(tiny_config(
            model={"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": 4}, "dtype": "bfloat16",
                   "device": "cuda", "max_model_len": 1024},
            backend="cuda_default", **overrides))

    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 248320, (n,), generator=g).tolist() for n in (30, 200, 7)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    base = build_engine(cfg()).generate(ps, params)
    for variant in (cfg(cache={"num_blocks": 1024, "ssm_state_dtype": "bfloat16"}),
                    cfg(policy={"ops": {"moe": ["cuda_grouped_mm", "cuda_default"]}})):
        eng = build_engine(variant)
        out = eng.generate(ps, params)
        assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(out, base)) >= 2
