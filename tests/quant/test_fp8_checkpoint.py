"""Block-FP8 checkpoints in the engine (reference backend, float32, CPU): tiny official-layout FP8
checkpoints built here from transformers' own Qwen3.5 classes, against transformers holding the
dequantized weights.

Two comparisons. The layout one swaps the reference's W8A8 product for the weight-only one (the
same dequantized weights, activations as they are): then the engine must equal transformers to
float rounding (first logits 1e-4 relative, logprobs 1e-4, greedy tokens equal), which checks
every scale's place (fused q|k|v, GDN qkv|z apart from b|a, experts padded to the shared width,
MTP). The W8A8 one runs both as W8A8 (transformers' GEMM inputs quantized per token and group of
128 too); there an activation that the two float32 summation orders put on either side of an FP8
rounding boundary moves these random models' logits by a few % (a routed expert may change), which
happens to some 10-25 % of short prompts, so the stated tolerance is: at least 6 of 16 prompts'
first logits within 1e-4 relative (wrong or missing activation quantization gets none there)."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_fixtures import (
    QUANTIZED,
    add_quantization_config,
    as_compressed_tensors,
    compressed_tensors_config,
    dequantized_hf,
    export_hf,
    make_hf_b128,
    quantization_config,
    quantize_file,
    save_fp8_checkpoint,
    w8a8,
)
from helpers import tiny_config
from hf_fixtures import hf_greedy, save_checkpoint
from safetensors.torch import load_file, save_file

import bi_core.backends.reference.linear as reference_linear
from bi_core import CheckpointError, ConfigError, EngineConfig, SamplingParams, build_engine
from bi_core.models.presets import PRESETS
from bi_core.quant.fp8_numerics import FP8, weight_only_linear

PROMPTS = [[(7 * i + j) % 300 for i in range(n)] for j, n in enumerate((20, 70, 1))]  # 70: two GDN chunks
STEPS = 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def engine(path, strategy=None, **model):
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu", **model}, "backend": "reference",
           **({"strategy": strategy} if strategy else {}),
           "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 128}, "cache": {"block_size": 16, "num_blocks": 64}}
    return build_engine(EngineConfig.from_dict(cfg))


def run(eng):
    """Greedy outputs and each prompt's first logits."""
    first = {}

    def observe(seqs, logits):
        for s, row in zip(seqs, logits):
            if not s.output_ids:
                first[s.request_id] = row.float().clone()

    eng.on_logits = observe
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=STEPS, ignore_eos=True, logprobs=1))
    return outs, [first[o.request_id] for o in outs]


@pytest.fixture
def weight_only(monkeypatch):
    # unquantized activations: a norm's FP8 copy of them (x_fp8) goes unused
    monkeypatch.setattr(reference_linear, "w8a8_linear",
                        lambda x, q, scale, block, x_fp8=None: weight_only_linear(x, q, scale, block))


CASES = [pytest.param("dense", "text", torch.float32, id="dense"),
         pytest.param("moe", "multimodal", torch.bfloat16, id="moe-multimodal-bf16-scales")]


@pytest.mark.parametrize("kind,layout,scale_dtype", CASES)
def test_fp8_checkpoint_matches_dequantized_transformers(tmp_path, weight_only, kind, layout, scale_dtype):
    hf = make_hf_b128(kind)
    deq = save_fp8_checkpoint(hf, tmp_path / "fp8", with_mtp=True, layout=layout, scale_dtype=scale_dtype)
    ref = dequantized_hf(make_hf_b128(kind), deq)
    eng = engine(tmp_path / "fp8")
    params = dict(eng.model.named_parameters())
    assert params["layers.0.mixer.in_proj.weight"].dtype == FP8  # kept in FP8: nothing dequantized at load
    assert params["layers.0.mixer.in_proj_ba.weight"].dtype == torch.float32
    assert not any(n.startswith("mtp.") for n in params)  # AR runs no MTP head: its tensors are not loaded
    mtp = engine(tmp_path / "fp8", strategy={"name": "mtp", "num_speculative_tokens": 1}, max_model_len=512)
    mtp = dict(mtp.model.named_parameters())
    assert mtp["mtp.layer.mixer.qkv_proj.weight"].dtype == FP8 and mtp["mtp.fc.weight"].dtype == torch.float32
    outs, firsts = run(eng)
    for prompt, out, ours in zip(PROMPTS, outs, firsts):
        tokens, logprobs, first = hf_greedy(ref, prompt, STEPS)
        assert rel(ours, first) < 1e-4
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_a_wrong_scale_layout_changes_the_outputs(tmp_path, weight_only):
    """Negative control: the same checkpoint with each scale grid's block rows reversed loads (the
    shapes fit) and no longer matches transformers."""
    hf = make_hf_b128("moe")
    deq = save_fp8_checkpoint(hf, tmp_path / "fp8")
    ref = dequantized_hf(make_hf_b128("moe"), deq)
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    flipped = {n: (t.flip(0) if n.endswith("_scale_inv") else t) for n, t in tensors.items()}
    assert sum(not torch.equal(flipped[n], tensors[n]) for n in tensors if n.endswith("_scale_inv")) > 10
    save_file(flipped, str(tmp_path / "fp8" / "model.safetensors"))
    _, firsts = run(engine(tmp_path / "fp8"))
    errors = [rel(ours, hf_greedy(ref, prompt, 1)[2]) for prompt, ours in zip(PROMPTS, firsts)]
    assert min(errors) > 0.05


@torch.no_grad()
def test_w8a8_against_transformers_w8a8(tmp_path):
    """16 three-token prompts, first logits: at least 6 equal transformers' W8A8 run to 1e-4
    (a rounding boundary crossed moves the others); none equals the weight-only run (negative
    control: the engine's activations are quantized, at every FP8 GEMM)."""
    hf = make_hf_b128("moe", seed=1)
    deq = save_fp8_checkpoint(hf, tmp_path / "fp8", with_mtp=True)
    ref = dequantized_hf(make_hf_b128("moe", seed=1), deq)
    prompts = torch.randint(0, 300, (16, 3), generator=torch.Generator().manual_seed(5))
    eng = engine(tmp_path / "fp8")
    first = {}
    eng.on_logits = lambda seqs, logits: first.update({s.request_id: row.float().clone() for s, row in zip(seqs, logits)})
    ours = [first[o.request_id] for o in eng.generate(prompts.tolist(), SamplingParams(max_new_tokens=1))]
    with w8a8(ref, deq):
        theirs = ref(input_ids=prompts).logits[:, -1]
    weight_only = ref(input_ids=prompts).logits[:, -1]
    errors = [rel(a, b) for a, b in zip(ours, theirs)]
    assert sum(e < 1e-4 for e in errors) >= 6, errors
    assert min(rel(a, b) for a, b in zip(ours, weight_only)) > 1e-2


def _params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in eng.model.named_parameters()}


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype, name
        assert torch.equal(x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y), name


def test_quantize_on_load_equals_the_fp8_checkpoint(tmp_path):
    """model.quantization: fp8 on a bf16/fp32 checkpoint gives the FP8 checkpoint's weights, bit for bit."""
    hf = make_hf_b128("moe")
    save_checkpoint(hf, tmp_path / "full", experts="fused", with_mtp=True)
    save_fp8_checkpoint(hf, tmp_path / "fp8", with_mtp=True)
    quantized, loaded = engine(tmp_path / "full", quantization="fp8"), engine(tmp_path / "fp8", quantization="fp8")
    _same_bits(_params(quantized), _params(loaded))
    a, b = run(quantized)[0], run(loaded)[0]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    with pytest.raises(ConfigError, match="model.quantization: none, but the checkpoint is FP8"):
        engine(tmp_path / "fp8", quantization="none")


@pytest.mark.parametrize("preset", ["tiny-dense-b128", "tiny-moe-uneven"])
def test_a_quantized_random_preset_equals_its_fp8_checkpoint(tmp_path, monkeypatch, preset):
    """model.quantization: fp8 on a random preset draws the unquantized model's numbers and quantizes
    them as an FP8 checkpoint of that model holds them, bit for bit (narrower routed experts' padding
    included: routed 128 wide, shared 256)."""
    monkeypatch.setitem(PRESETS, "tiny-moe-uneven", {**PRESETS["tiny-moe-b128"], "moe_intermediate_size": 128})

    def build(**model):
        return build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": preset, "seed": 4}, **model})))

    dense = build()
    path = tmp_path / "ckpt"
    path.mkdir()
    save_file({n: t.contiguous() for n, t in export_hf(dense.model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dense.args.to_hf_text_config()))
    quantize_file(path / "model.safetensors")
    add_quantization_config(path, quantization_config(dense.args.num_hidden_layers))
    quantized, loaded = build(quantization="fp8"), build_engine(EngineConfig.from_dict(tiny_config(
        model={"path": str(path), "random": None})))
    _same_bits(_params(quantized), _params(loaded))


def test_fp8_checkpoint_refusals(tmp_path):
    hf = make_hf_b128("dense")
    save_fp8_checkpoint(hf, tmp_path / "fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    good = load_file(str(path))
    name = "model.layers.0.linear_attn.in_proj_b.weight"  # kept in bf16 by the official scheme

    def refused(tensors, match):
        save_file(tensors, str(path))
        with pytest.raises(CheckpointError, match=match):
            engine(tmp_path / "fp8")

    refused({**good, name: good[name].to(FP8), name + "_scale_inv": torch.ones(1, 1)},
            "in_proj_b.weight is FP8, but the engine holds layers.0.mixer.in_proj_ba.weight unquantized")
    q = "model.layers.1.self_attn.q_proj.weight"
    refused({n: t for n, t in good.items() if n != q + "_scale_inv"}, "q_proj.weight_scale_inv is missing")
    refused({**good, q + "_scale_inv": torch.ones(2, 1)}, r"expected float32 or bfloat16 \[4, 1\]")
    refused({**good, q: good[q].float()}, "q_proj.weight has .*_scale_inv but is torch.float32")


def test_compressed_tensors_fp8_block_checkpoint_loads_as_the_official_one(tmp_path):
    """llm-compressor's FP8_BLOCK checkpoints (compressed-tensors: ``weight_scale``, config_groups,
    ``ignore``) are the official format's arithmetic: the same weights bit for bit, the same
    tokens; the MoE model with its MTP head, multimodal names, bf16 scales."""
    hf = make_hf_b128("moe")
    for name in ("official", "ct"):
        save_fp8_checkpoint(hf, tmp_path / name, with_mtp=True, layout="multimodal", scale_dtype=torch.bfloat16)
    as_compressed_tensors(tmp_path / "ct")
    assert any(n.endswith(".weight_scale") for n in load_file(str(tmp_path / "ct" / "model.safetensors")))
    official, ct = engine(tmp_path / "official"), engine(tmp_path / "ct")
    assert ct.args.quantization.dense == official.args.quantization.dense
    _same_bits(_params(official), _params(ct))
    a, b = run(official)[0], run(ct)[0]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_compressed_tensors_refusals(tmp_path):
    """What compressed-tensors holds in another arithmetic is refused by name, before any weight:
    group-wise or int4 weights, per-token or static activations for block weights, int4 packs, a
    KV cache scheme other than static per-tensor scales; and an FP8_BLOCK checkpoint missing a scale or storing lm_head in FP8
    (per-channel weights: test_compressed_tensors_per_channel_is_requantized_block_wise_when_asked)."""
    hf = make_hf_b128("dense")
    save_fp8_checkpoint(hf, tmp_path / "ct")
    as_compressed_tensors(tmp_path / "ct")

    def refused(change, match, tensors=None):
        cfg = compressed_tensors_config()
        group = cfg["config_groups"]["group_0"]
        for key, value in change.items():
            where, _, k = key.rpartition(".")
            (group[where] if where else cfg)[k] = value
        add_quantization_config(tmp_path / "ct", cfg)
        if tensors is not None:
            save_file(tensors, str(tmp_path / "ct" / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            engine(tmp_path / "ct")

    supported = "supported: the official block-wise FP8 .* or the same arithmetic as compressed-tensors writes it"
    refused({"weights.strategy": "group", "weights.block_structure": None},
            rf"config_groups.group_0.weights.strategy 'group', .*weights.block_structure None not supported; {supported}")
    refused({"weights.strategy": "channel", "weights.block_structure": None, "weights.num_bits": 4},
            r"config_groups.group_0.weights.num_bits 4 not supported")
    refused({"input_activations.strategy": "token", "input_activations.group_size": None},
            r"input_activations.strategy 'token'.*not supported")
    refused({"input_activations.dynamic": False}, r"input_activations.dynamic False not supported")
    refused({"weights.num_bits": 4, "weights.type": "int", "format": "pack-quantized"},
            r"format 'pack-quantized', config_groups.group_0.weights.num_bits 4, config_groups.group_0.weights.type 'int'")
    refused({"kv_cache_scheme": {"num_bits": 8, "type": "float"}},  # per-tensor static scales only (test_kv_scales.py)
            r"kv_cache_scheme.strategy None, kv_cache_scheme.dynamic None not supported; .* kv_cache_scheme of one static")
    refused({"quantization_status": "frozen"}, r"quantization_status 'frozen' not supported")
    good = load_file(str(tmp_path / "ct" / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj.weight"
    refused({}, "q_proj.weight_scale is missing", {n: t for n, t in good.items() if n != q + "_scale"})
    head = "lm_head.weight"  # targeted (Linear, not ignored) and stored in FP8: this engine keeps it unquantized
    refused({"ignore": compressed_tensors_config()["ignore"][1:]}, "lm_head.weight is FP8, but the engine holds",
            {**good, head: good[head].to(FP8), head + "_scale": torch.ones(3, 1)})


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_per_channel_is_requantized_block_wise_when_asked(tmp_path, strategy):
    """compressed-tensors FP8_DYNAMIC (a scale per output row) and FP8 (one per tensor): the engine
    computes block-wise FP8 only, so it refuses them unless model.quantization: fp8, which
    re-quantizes each weight block-wise on load: then the weights are bit for bit those of a
    float32 checkpoint holding the dequantized values under model.quantization: fp8."""
    from bi_core.quant.fp8_numerics import FP8_MAX

    hf = make_hf_b128("moe")
    save_checkpoint(hf, tmp_path / "ct", experts="per_expert", with_mtp=True)
    save_checkpoint(hf, tmp_path / "dq", experts="per_expert", with_mtp=True)
    tensors, dequantized = load_file(str(tmp_path / "ct" / "model.safetensors")), {}
    out = {}
    for name, t in tensors.items():
        if not QUANTIZED.match(name):
            out[name] = dequantized[name] = t
            continue
        amax = t.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else t.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        q = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[name], out[name + "_scale"] = q, scale
        dequantized[name] = q.float() * scale
    save_file(out, str(tmp_path / "ct" / "model.safetensors"))
    save_file(dequantized, str(tmp_path / "dq" / "model.safetensors"))
    cfg = compressed_tensors_config()
    cfg["config_groups"]["group_0"]["weights"] = {"num_bits": 8, "type": "float", "strategy": strategy,
                                                  "symmetric": True, "dynamic": False}
    cfg["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token",
                                                            "dynamic": True, "symmetric": True}
    add_quantization_config(tmp_path / "ct", cfg)
    with pytest.raises(ConfigError, match="model.quantization: unset, but the checkpoint's FP8 weights have a scale "
                                          "per output row or per tensor .*set model.quantization: fp8"):
        engine(tmp_path / "ct")
    from bi_core.runtime.build import explain

    text = explain(EngineConfig.from_dict({"model": {"path": str(tmp_path / "ct"), "dtype": "float32", "device": "cpu",
                                                     "quantization": "fp8"}, "backend": "reference"}))
    assert "scales are per output row or per tensor: re-quantized block-wise on load" in text
    requantized, reference = engine(tmp_path / "ct", quantization="fp8"), engine(tmp_path / "dq", quantization="fp8")
    _same_bits(_params(requantized), _params(reference))
    assert [o.token_ids for o in run(requantized)[0]] == [o.token_ids for o in run(reference)[0]]
