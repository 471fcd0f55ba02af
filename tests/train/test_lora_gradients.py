"""The LoRA trainer's gradients against autograd in float64: the lora op alone (mixed slots, with
and without SwiGLU after the delta) against the per-row delta written out, and the whole policy's
A and B against PEFT on transformers' Qwen3.5 (per-op backward and checkpointed layers); the
adapter it saves loads in PEFT with the same logprobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_fixtures import make_hf_model, save_checkpoint
from test_gradients import _close, _hf_logprobs

from bi_core import EngineConfig
from bi_core.backends.reference.lora import ReferenceLoraImpl
from bi_core.errors import ConfigError
from bi_core.train import PolicyModel
from bi_core.train.ops import TrainLora

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_fixtures import make_adapter  # noqa: E402

pytest.importorskip("peft")
PROMPTS = [[5, 17, 200, 3, 9, 41, 7, 8, 12, 99, 250, 1, 2], [42]]
COMPLETIONS = [[7, 8, 9, 10], [3, 250, 4, 5, 6]]


def _row_delta(y, x, a, b, slots, silu_mul):
    rows = [y[t] + (x[t] @ a[s].t() @ b[s].t() if s >= 0 else 0) for t, s in enumerate(slots.tolist())]
    out = torch.stack(rows)
    if not silu_mul:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("silu_mul", [False, True])
def test_lora_op_gradient(silu_mul):
    gen = torch.Generator().manual_seed(0)
    t, k, n, r = 7, 24, 16, 6
    inputs = [torch.randn(t, n, generator=gen), torch.randn(t, k, generator=gen),
              torch.randn(2, r, k, generator=gen) / k**0.5, torch.randn(2, n, r, generator=gen) / r**0.5]
    slots = torch.tensor([0, -1, 1, 0, 0, -1, 1])
    op = TrainLora(ReferenceLoraImpl(silu_mul), type("S", (), {"silu_mul": silu_mul})())
    xs = [x.clone().requires_grad_() for x in inputs]
    out = op.forward(*xs, slots)
    probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * probe).sum().backward()
    ys = [x.double().requires_grad_() for x in inputs]
    (_row_delta(*ys, slots, silu_mul) * probe).sum().backward()
    for i, (x, y) in enumerate(zip(xs, ys)):
        _close(x.grad, y.grad, f"input {i}")


def _config(ckpt: Path, **lora) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"path": str(ckpt), "dtype": "float32", "device": "cpu", "max_model_len": 128}, "backend": "reference",
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 8},
        "cache": {"block_size": 16, "num_blocks": 64}, "lora": {"max_loras": 2, "max_rank": 8, **lora}})


def _adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHARED = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]


@pytest.mark.parametrize("kind,checkpoint", [("dense", True), ("dense", False), ("moe", True), ("experts", True),
                                             ("experts", False), ("down-only", False)])
def test_adapter_gradients_match_peft_in_float64(tmp_path, kind, checkpoint):
    """``experts``: adapters on the routed experts' fused parameters (PEFT's target_parameters) and
    the shared expert (lora.experts); ``down-only``: experts.down_proj alone (PEFT's other name)."""
    from peft import PeftModel

    hf = make_hf_model("dense" if kind == "dense" else "moe")
    ckpt = save_checkpoint(hf, tmp_path / "ckpt", experts="fused")
    targets, params = {"dense": (None, None), "moe": (["q_proj", "o_proj", "in_proj_qkv", "out_proj",
                                                       "shared_expert_gate"], None),
                       "experts": (["q_proj", "shared_expert_gate", *SHARED], EXPERT_PARAMS),
                       "down-only": (["q_proj"], EXPERT_PARAMS[1:])}[kind]
    peft_model = make_adapter(hf, tmp_path / "adapter", r=4, alpha=8.0, targets=targets, params=params)
    kind = "dense" if kind == "dense" else "moe"
    cfg, tensors = _adapter(tmp_path / "adapter")
    policy = PolicyModel.from_config(_config(ckpt, experts=params is not None), lora=cfg, lora_tensors=tensors)
    policy.checkpoint_layers = checkpoint
    weights = [torch.randn(len(c), generator=torch.Generator().manual_seed(i)) for i, c in enumerate(COMPLETIONS)]
    ours = policy.token_logprobs(PROMPTS, COMPLETIONS)
    sum((w * lp).sum() for w, lp in zip(weights, ours)).backward()
    peft64 = peft_model.double()
    if kind == "moe":
        peft64.base_model.model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    theirs = _hf_logprobs(peft64, PROMPTS, COMPLETIONS)
    sum((w.double() * lp).sum() for w, lp in zip(weights, theirs)).backward()
    _close(torch.cat(ours).detach(), torch.cat(theirs).detach(), "logprobs", 1e-4)
    grads = {n.removeprefix("base_model.model.").replace(".default.", "."): p.grad
             for n, p in peft64.named_parameters() if "lora_" in n}
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert set(trained) == set(grads) and len(grads) > 0
    for name, p in trained.items():
        _close(p.grad, grads[name], name, 1e-3)
    # the adapter it saves is PEFT's: PEFT loads it onto the base model with the policy's logprobs
    policy.save_adapter(tmp_path / "saved")
    loaded = PeftModel.from_pretrained(make_hf_model(kind), str(tmp_path / "saved")).eval()
    with torch.no_grad():
        _close(torch.cat(ours).detach(), torch.cat(_hf_logprobs(loaded, PROMPTS, COMPLETIONS)), "PEFT-loaded", 1e-4)


def test_adapter_config_errors_name_the_problem(tmp_path):
    hf = make_hf_model("dense")
    config = _config(save_checkpoint(hf, tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"r must be an integer in \[1, lora.max_rank=8\].*lora_dropout 0.1"):
        PolicyModel.from_config(config, lora={"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"],
                                              "lora_dropout": 0.1})
    with pytest.raises(ConfigError, match="match no projection the engine adapts"):
        PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]})
    with pytest.raises(ConfigError, match=r"use_dora"):
        PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True})
    with pytest.raises(ConfigError, match=r"lora_tensors: no tensors for \['model.layers.1.self_attn.q_proj'"):
        PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, lora_tensors={})
    with pytest.raises(ConfigError, match="lora_dtype must be"):
        PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
                                lora_dtype=torch.int32)
    off = _config(tmp_path / "ckpt", max_loras=0)
    with pytest.raises(ConfigError, match="lora.max_loras"):
        PolicyModel.from_config(off, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    moe = _config(save_checkpoint(make_hf_model("moe"), tmp_path / "moe"))
    with pytest.raises(ConfigError, match=r"target_parameters \['mlp.experts.down_proj'\].*lora.experts: true"):
        PolicyModel.from_config(moe, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                           "target_parameters": ["mlp.experts.down_proj"]})  # never silently dropped
    from helpers import tiny_config

    fp8 = EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe-b128", "seed": 1},
                                                    "quantization": "fp8"},
                                             lora={"max_loras": 2, "max_rank": 8, "experts": True}))
    with pytest.raises(ConfigError, match="lora.experts.*FP8 MoE experts"):
        PolicyModel.from_config(fp8, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    fresh = PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    assert fresh.adapter_config()["target_modules"] == "all-linear"
    assert all(torch.count_nonzero(t) == 0 for n, t in fresh.adapter_tensors().items() if "lora_B" in n)  # PEFT's init
    with pytest.raises(ValueError, match="trains no LoRA adapter"):
        PolicyModel.from_config(config).adapter_tensors()
    from bi_core.train.hf import to_transformers

    with pytest.raises(ValueError, match="trains a LoRA adapter.*PeftModel.from_pretrained"):
        to_transformers(fresh)


def test_adapter_synced_by_handle_serves_the_trained_adapter():
    """A trained adapter pushed by handle (``serialize_named_tensors``, shared memory on the CPU) is
    the engine's next version; on the reference backend its rollout logprobs are the trainer's
    (close: that backend is not batch-invariant), and far from the base model's."""
    from helpers import tiny_config

    from bi_core import SamplingParams, build_engine
    from bi_core.rl import serialize_named_tensors
    from bi_core.train import max_gap, rollout_logprobs

    config = EngineConfig.from_dict(tiny_config(lora={"max_loras": 2, "max_rank": 8},
                                                model={"random": {"preset": "tiny-dense", "seed": 2}}))
    engine = build_engine(config)
    policy = PolicyModel.from_config(config, lora={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if n.endswith("lora_B.weight"):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    for version in (1, 2):
        loaded = engine.load_lora_adapter_from_tensor("policy", serialize_named_tensors(policy.adapter_tensors()),
                                                      policy.adapter_config())
        assert loaded.version == version
    outs = engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=4, ignore_eos=True, lora_name="policy")])
    ours = policy.token_logprobs([PROMPTS[0]], [outs[0].token_ids])
    base = PolicyModel.from_config(config).token_logprobs([PROMPTS[0]], [outs[0].token_ids])
    assert max_gap(rollout_logprobs(outs), ours) < 1e-4 < max_gap(rollout_logprobs(outs), base)
