"""The trainer's fused parameters are the engine's, bitwise, for every parameter: in bf16 (GDN's
float32 A_log and dt_bias stay float32: rounding them to bf16 moved every logprob on the GPU), with
fp32 master weights, and in block FP8 (values and scales, quantized as the engine's load does)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, build_engine
from bi_core.quant.params import SCALE_SUFFIX
from bi_core.train import PolicyModel


def _differing(policy, engine) -> list[str]:
    params, bad = dict(engine.runner.model.named_parameters()), []
    for i, layer in enumerate(policy.model.layers):
        for name, t in layer.engine_params().items():
            want = params[f"layers.{i}.{name}"]
            if t.dtype != want.dtype or not torch.equal(t.detach().view(torch.uint8), want.detach().view(torch.uint8)):
                bad.append(f"layers.{i}.{name}")
    if not torch.equal(policy.model.embed_tokens.weight.detach().to(engine.runner.model.dtype), params["embed_tokens"]):
        bad.append("embed_tokens")
    return bad


@pytest.mark.parametrize("preset, quantization", [("tiny-moe", None), ("tiny-dense", None), ("tiny-moe-b128", "fp8")])
@pytest.mark.parametrize("param_dtype", [None, torch.float32])
def test_the_fused_parameters_are_the_engines(preset, quantization, param_dtype):
    model = {"random": {"preset": preset, "seed": 5}, "dtype": "bfloat16", "max_model_len": 128}
    if quantization:
        model["quantization"] = quantization
    config = EngineConfig.from_dict(tiny_config(model=model))
    engine, policy = build_engine(config), PolicyModel.from_config(config, param_dtype=param_dtype)
    assert _differing(policy, engine) == []
    gdn = policy.model.layers[0].linear_attn
    assert gdn.A_log.dtype == gdn.dt_bias.dtype == torch.float32
    if quantization:
        assert any(n.endswith(SCALE_SUFFIX) for n in policy.model.layers[0].engine_params())
    # negative control: A_log rounded to bf16 (what the trainer did before) is caught
    with torch.no_grad():
        gdn.A_log.copy_(gdn.A_log.to(torch.bfloat16).float())
    assert "layers.0.mixer.A_log" in _differing(policy, engine)
