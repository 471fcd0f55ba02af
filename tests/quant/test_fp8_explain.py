"""FP8 under the policy: the CUDA builders serve block-FP8 linear and MoE specs with the Triton
kernels (kernels/fp8.py, fp8_moe.py; the default backend's linear runs FlashInfer's GEMM where it
can: test_fp8_flashinfer_default.py) and refuse a block size those kernels do not take, by name
(explain shows it, building fails with the selector's table); a builder written without FP8
never gets an FP8 spec; explain counts the GPUs each published shape needs in the model dtype
and FP8."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, build_engine
from bi_core.errors import BackendSelectionError
from bi_core.models.presets import preset_args
from bi_core.ops import LinearSpec, MoEBuilder, MoESpec
from bi_core.plugins import load_registry
from bi_core.policies import make_policy
from bi_core.quant.sizing import GiB, weight_bytes
from bi_core.runtime.build import explain
from bi_core.selector import OpFactory, choose

CUDA = torch.device("cuda")


def _explain(preset: str, invariant: bool, quantization: str | None = "fp8", **extra) -> str:
    return explain(EngineConfig.from_dict({
        "model": {"random": {"preset": preset, "num_hidden_layers": 4}, "device": "cuda", "quantization": quantization},
        "policy": {"batch_invariant": invariant}, **extra}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the plan for a GPU that is not here")
@pytest.mark.parametrize("invariant,backend", [(True, "cuda_hopper_invariant"), (False, "cuda_default")])
def test_cuda_builders_serve_block_fp8(invariant, backend):
    text = _explain("qwen3.5-35b-a3b", invariant)
    assert "block-FP8" not in text  # no refusal by format
    assert f"linear        -> {backend}" in text and f"moe           -> {backend}" in text
    assert ("weights: block-wise FP8 W8A8 (128x128 weight blocks, activations per token and group of 128) from "
            "model.quantization: fp8 (the official Qwen3.5-FP8 scheme); projections kept unquantized: "
            "linear_attn.in_proj_a, linear_attn.in_proj_b") in text
    dense = _explain("qwen3.5-35b-a3b", invariant, quantization=None)
    assert f"linear        -> {backend}" in dense and "weights: block-wise" not in dense


def test_a_block_size_the_kernels_do_not_take_fails_with_the_selectors_table():
    registry = load_registry()
    policy = make_policy(batch_invariant=True, backend="auto", op_overrides={}, device=CUDA)
    factory = OpFactory(registry, policy, CUDA, torch.bfloat16)
    spec = LinearSpec(device=CUDA, dtype=torch.bfloat16, in_features=256, out_features=256,
                      weight_format="fp8_block", block_size=(64, 64))
    with pytest.raises(BackendSelectionError) as e:
        factory.build("linear", spec)
    assert "cuda_hopper_invariant: block-FP8 kernels take 128 x 128 weight blocks, not (64, 64)" in str(e.value)
    # the reference backend takes FP8 specs (not in invariant mode: it promises no invariance)
    loose = make_policy(batch_invariant=False, backend="reference", op_overrides={}, device=torch.device("cpu"))
    cpu = LinearSpec(device=torch.device("cpu"), dtype=torch.float32, in_features=256, out_features=256,
                     weight_format="fp8_block", block_size=(128, 128))
    assert choose(registry, loose, "linear", cpu).backend == "reference"


def test_a_builder_written_without_fp8_never_gets_an_fp8_spec():
    class ThirdPartyMoEBuilder(MoEBuilder):  # a plugin's builder that accepts every spec it is shown
        def check(self, spec, policy):
            return []

        def build(self, spec):
            raise AssertionError("never built")

    builder = ThirdPartyMoEBuilder()
    base = dict(device=torch.device("cpu"), dtype=torch.bfloat16, num_experts=8, top_k=2, hidden_size=256,
                intermediate_size=256)
    assert builder.check(MoESpec(**base), None) == []
    reasons = builder.check(MoESpec(**base, weight_format="fp8_block", block_size=(128, 128)), None)
    assert reasons == ["block-FP8 moe: no kernel in test_fp8_explain yet"]  # named by its (top) module


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU counts for the kinds when none is here")
def test_explain_counts_gpus_in_bf16_and_fp8():
    text = explain(EngineConfig.from_dict({"model": {"random": {"preset": "qwen3.5-122b-a10b"}, "device": "cuda"},
                                           "backend": "cuda_default"}))
    bf16 = next(line for line in text.splitlines() if line.startswith("  bfloat16:"))
    fp8 = next(line for line in text.splitlines() if line.startswith("  fp8 (block 128x128):"))
    assert "H100 80GB: 4 GPUs" in bf16 and "H200 141GB: 2 GPUs" in bf16
    # strategy ar loads no MTP head: one H200 holds the FP8 weights and the GDN state of 64 sequences
    assert "H100 80GB: 2 GPUs" in fp8 and "H200 141GB: 1 GPU (115.2 GiB" in fp8
    assert "KV cache (bfloat16) 24.0 KiB per token" in text
    mtp = explain(EngineConfig.from_dict({"model": {"random": {"preset": "qwen3.5-122b-a10b"}, "device": "cuda"},
                                          "backend": "cuda_default", "strategy": {"name": "mtp"}}))
    fp8 = next(line for line in mtp.splitlines() if line.startswith("  fp8 (block 128x128):"))
    assert "H200 141GB: 1 GPU holds the weights (117.6 of 125.8 GiB usable) but not" in fp8  # the head's 2.4 GiB
    assert "KV cache (bfloat16) 26.0 KiB per token" in mtp  # and its attention layer's KV
    # 95 % of an H200 and 16 sequences: one H200 holds the FP8 model with KV room
    roomy = explain(EngineConfig.from_dict({
        "model": {"random": {"preset": "qwen3.5-122b-a10b"}, "device": "cuda"}, "backend": "cuda_default",
        "cache": {"gpu_memory_utilization": 0.95}, "scheduler": {"max_num_seqs": 16}}))
    assert "H200 141GB: 1 GPU (" in next(line for line in roomy.splitlines() if line.startswith("  fp8"))


def test_weight_bytes_follow_the_shapes():
    """The meta-device count equals a built model's bytes; published sizes come out (122B + a 2.5B
    MTP head: ~232 GiB in bf16), and FP8 halves the projections (scales add 1/4096 of them)."""
    eng = build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe-b128"},
                                                                 "quantization": "fp8"})))
    built = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    assert eng.model.mtp is None  # strategy ar: no MTP head
    assert weight_bytes(eng.args, torch.float32, 1, with_mtp=False) == built
    full = preset_args("qwen3.5-122b-a10b")
    bf16 = weight_bytes(full, torch.bfloat16, 1, with_mtp=True) / GiB
    fp8 = weight_bytes(preset_args("qwen3.5-122b-a10b", quantization="fp8"), torch.bfloat16, 1, with_mtp=True) / GiB
    assert 230 < bf16 < 234 and 0.5 < fp8 / bf16 < 0.52


def test_a_tensor_parallel_split_that_cuts_a_block_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size: 8 ranks would cut a 128-wide FP8 block of "
                                          r"experts\|shared_expert: rank 0 would hold rows \[0, 64\) of 1024"):
        _explain("qwen3.5-35b-a3b", False, parallel={"tensor_parallel_size": 8})  # I = 512: 64 rows a rank
    with pytest.raises(ConfigError, match=r"model.quantization: FP8 in_proj_qkv\|in_proj_z: the engine fuses parts of "
                                          r"\[32, 32, 64, 64\] rows into one weight, and each part but the last must be "
                                          "whole 128-row blocks"):
        _explain("tiny-moe", False)  # head dims of 16 and 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU counts for the kinds when none is here")
@pytest.mark.parametrize("name", ["h100_default", "h100_invariant", "h100_invariant_mtp"])
def test_the_h100_configs_fit_one_h100(name):
    """Each shipped ``configs/h100_*.yaml`` holds its weights, the GDN state of its sequences (MTP:
    4 state slots each, as the engine's cache reserves them) and some KV on one H100 in bf16.
    Negative control: with 256 sequences (the H200's count, which the configs had) they do not."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    config = EngineConfig.from_yaml(path)

    def bf16_line(cfg) -> str:
        return next(line for line in explain(cfg).splitlines() if line.startswith("  bfloat16:"))

    assert "H100 80GB: 1 GPU (" in bf16_line(config)
    crowded = EngineConfig.from_dict({**config.to_dict(), "scheduler": {**config.to_dict()["scheduler"],
                                                                        "max_num_seqs": 256}})
    assert "H100 80GB: 1 GPU holds the weights" in bf16_line(crowded)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU counts for the kinds when none is here")
def test_the_h100_fp8_config_fits_one_h100_only_in_fp8():
    """``configs/h100_invariant_fp8.yaml``: its 256 sequences fit one H100 with the weights in FP8, and
    would not in bf16 (the bf16 line of the same explain says so)."""
    from pathlib import Path

    config = EngineConfig.from_yaml(Path(__file__).resolve().parents[2] / "configs" / "h100_invariant_fp8.yaml")
    assert config.model.quantization == "fp8" and config.scheduler.max_num_seqs == 256
    lines = explain(config).splitlines()
    fp8 = next(line for line in lines if line.startswith("  fp8 (block 128x128):"))
    bf16 = next(line for line in lines if line.startswith("  bfloat16:"))
    assert "H100 80GB: 1 GPU (" in fp8
    assert "H100 80GB: 1 GPU holds the weights (64.6 of 71.3 GiB usable) but not the GDN state of 256" in bf16
