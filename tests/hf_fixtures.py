"""Tiny random Qwen3.5 checkpoints made with transformers' own classes, in every layout the
loader accepts, plus a greedy reference decode through transformers' forward with its cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def make_hf_model(kind: str, *, tie: bool = False, seed: int = 0, **overrides):
    """A transformers Qwen3.5 (dense or MoE) CausalLM with non-degenerate random fp32 weights;
    ``overrides`` change fields of ``TINY`` (e.g. more heads)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    common = dict(TINY, **overrides, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, tie_word_embeddings=tie,
                  eos_token_id=299)
    if kind == "moe":
        config = Qwen3_5MoeTextConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48)
        model = Qwen3_5MoeForCausalLM(config)
    else:
        config = Qwen3_5TextConfig(**common, intermediate_size=96)
        model = Qwen3_5ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif p.dim() == 1:
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
                        + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.eval()


def save_checkpoint(model, path: Path, *, layout: str = "text", experts: str = "per_expert",
                    with_mtp: bool = False, shards: int = 1) -> Path:
    """Write ``model`` as a checkpoint: ``layout`` text (``model.*``) or multimodal
    (``model.language_model.*`` + nested text_config); experts ``per_expert``, ``fused`` or
    ``fused_transposed``; optional random ``mtp.*`` tensors; ``shards`` files with an index."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ".mlp.experts." in name and experts != "fused":
            prefix, which = name.rsplit(".", 1)
            if experts == "fused_transposed":
                out[name] = t.transpose(1, 2).contiguous()
                continue
            for e in range(t.shape[0]):
                if which == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    if with_mtp:
        out.update(mtp_tensors(model, experts))
        cfg["mtp_num_hidden_layers"] = 1
    if layout == "multimodal":
        out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in out.items()}
        out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)  # must be ignored
        moe = "num_experts" in cfg and cfg.get("num_experts")
        cfg = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": cfg,
               "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    names = sorted(out)
    if shards == 1:
        save_file(out, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: out[n] for n in names[i::shards]}
            save_file(part, str(path / fname))
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def mtp_tensors(model, experts: str) -> dict[str, torch.Tensor]:
    """Random MTP-head tensors with the shapes of one full-attention layer of ``model``."""
    c = model.config
    h = c.hidden_size
    src = next(i for i, t in enumerate(c.layer_types) if t == "full_attention")
    gen = torch.Generator().manual_seed(123)
    out = {f"mtp.{n}.weight": 0.1 * torch.randn(h, generator=gen)
           for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
    for name, t in model.state_dict().items():
        prefix = f"model.layers.{src}."
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        r = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]) if t.dim() > 1 else 0.1 * torch.randn(t.shape, generator=gen)
        if ".experts." in rest and experts == "per_expert":
            which = rest.rsplit(".", 1)[1]
            for e in range(r.shape[0]):
                base = f"mtp.layers.0.mlp.experts.{e}"
                if which == "gate_up_proj":
                    gate, up = r[e].chunk(2, dim=0)
                    out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = gate.contiguous(), up.contiguous()
                else:
                    out[f"{base}.down_proj.weight"] = r[e].contiguous()
        else:
            out[f"mtp.layers.0.{rest}"] = r.contiguous()
    return out


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy decode with transformers' own forward and cache: tokens, their logprobs, first logits."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    first = out.logits[0, -1].float().clone()
    tokens, logprobs = [], []
    logits = first
    for _ in range(steps):
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[0, -1]
    return tokens, logprobs, first
