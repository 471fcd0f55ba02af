"""Weight updates of an FP8 model: bf16/fp32 tensors (a trainer's) are quantized block-wise on the
way in, exactly as an FP8 checkpoint of them holds them; FP8 + scale pairs come from a checkpoint
directory only, never from memory (refused, nothing changed)."""

from __future__ import annotations

import pytest
import torch
from fp8_fixtures import BLOCK, make_hf_b128, save_fp8_checkpoint

from bi_core import CheckpointError, EngineConfig, build_engine
from bi_core.models.loader import CheckpointIndex, TensorDict, update_weights
from bi_core.quant.fp8_numerics import FP8, quantize_blocks


def engine(path):
    return build_engine(EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32", "device": "cpu", "max_model_len": 256}, "backend": "reference",
        "cache": {"block_size": 16, "num_blocks": 32}}))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.uint8) if t.dtype == FP8 else t.detach()


def params(eng) -> dict[str, torch.Tensor]:
    return {n: bits(p).clone() for n, p in eng.model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_trainer_tensors_are_quantized_like_a_checkpoint(tmp_path):
    save_fp8_checkpoint(make_hf_b128("moe", seed=0), tmp_path / "old")
    new = make_hf_b128("moe", seed=1)
    save_fp8_checkpoint(new, tmp_path / "new")
    eng, want = engine(tmp_path / "old"), params(engine(tmp_path / "new"))
    before = params(eng)
    assert not same(before, want)
    # transformers' own names and layout (fused experts [E, 2I, H]), fp32 like a trainer's master weights
    assert update_weights(eng.model, TensorDict(new.state_dict())) == len(new.state_dict())
    assert same(params(eng), want)
    update_weights(eng.model, CheckpointIndex(tmp_path / "old"))  # a directory: FP8 tensors and scales as stored
    assert same(params(eng), before)


def test_fp8_pairs_in_memory_are_refused_and_nothing_changes(tmp_path):
    save_fp8_checkpoint(make_hf_b128("dense"), tmp_path / "ckpt")
    eng = engine(tmp_path / "ckpt")
    before = params(eng)
    q, s = quantize_blocks(torch.randn(512, 128), BLOCK)
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match="accepted from a checkpoint directory only; nothing was updated"):
        update_weights(eng.model, TensorDict({name: q, name + "_scale_inv": s,
                                              "model.norm.weight": torch.zeros(128)}))
    assert same(params(eng), before)


def test_own_names_take_the_whole_fused_weight(tmp_path):
    save_fp8_checkpoint(make_hf_b128("dense"), tmp_path / "ckpt")
    eng = engine(tmp_path / "ckpt")
    w = torch.randn(768, 128)  # q|gate, k, v of layer 1
    update_weights(eng.model, TensorDict({"layers.1.mixer.qkv_proj.weight": w}))
    q, s = quantize_blocks(w, BLOCK)
    proj = eng.model.layers[1].mixer.qkv_proj
    assert torch.equal(bits(proj.weight), bits(q)) and torch.equal(proj.weight_scale_inv, s)
    with pytest.raises(CheckpointError, match="unknown weight names"):  # scales travel with their weight only
        update_weights(eng.model, TensorDict({"layers.1.mixer.qkv_proj.weight_scale_inv": s}))
