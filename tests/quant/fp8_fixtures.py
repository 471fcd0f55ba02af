"""Tiny block-FP8 checkpoints in the official Qwen3.5-*-FP8 layout, made in the test: a transformers
Qwen3.5 (dense or MoE) whose fused projection parts are whole 128-row blocks, saved per expert,
its projections quantized block-wise (float8_e4m3fn ``weight`` + float32 ``weight_scale_inv``),
with the official ``quantization_config``; and a transformers model holding the dequantized
weights (the reference run)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import torch
from hf_fixtures import TINY, save_checkpoint
from safetensors.torch import load_file, save_file

from bi_core.models.weight_map import weight_map
from bi_core.quant.fp8_numerics import (
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)

BLOCK = (128, 128)
# the shapes of the presets tiny-*-b128, as a transformers config (vocab 300, five layers)
B128 = dict(TINY, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
# what the official releases quantize (everything else stays as it is)
QUANTIZED = re.compile(r".*\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|"
                       r"mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)\.weight$")


def quantization_config(num_layers: int = len(LAYER_TYPES)) -> dict:
    """Official-style: every kept-unquantized module by name, per layer."""
    keep = ["lm_head", "model.embed_tokens", "mtp.fc"]
    for i in range(num_layers):
        keep += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.shared_expert_gate",
                 f"model.layers.{i}.linear_attn.in_proj_a", f"model.layers.{i}.linear_attn.in_proj_b"]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
            "modules_to_not_convert": keep}


def compressed_tensors_config(num_layers: int = len(LAYER_TYPES)) -> dict:
    """llm-compressor's FP8_BLOCK preset as it writes it (targets Linear, the official set's
    unquantized modules in ``ignore``, by name and by ``re:`` pattern)."""
    ignore = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_[ab]$", "mtp.fc"]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": list(BLOCK),
                            "symmetric": True, "dynamic": False, "observer": "static_minmax", "group_size": None},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                      "symmetric": True, "dynamic": True, "observer": None},
                "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


def as_compressed_tensors(path: Path, config: dict | None = None) -> None:
    """An official-layout FP8 checkpoint at ``path`` rewritten as compressed-tensors stores it:
    ``weight_scale`` for ``weight_scale_inv`` (the same numbers: both multiply), its config."""
    tensors = load_file(str(path / "model.safetensors"))
    save_file({n.removesuffix("_inv") if n.endswith(".weight_scale_inv") else n: t for n, t in tensors.items()},
              str(path / "model.safetensors"))
    add_quantization_config(path, config or compressed_tensors_config())


# compressed-tensors' kv_cache_scheme as llm-compressor writes it: one static float 8-bit scale per
# tensor (per layer for keys and for values: ``self_attn.k_scale`` / ``v_scale``)
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
             "observer": "minmax"}
ATTENTION = [i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"]


def kv_scaled_checkpoint(hf, path: Path, scales: dict[int, tuple[float, float]] | None,
                         scheme: dict | None = KV_SCHEME) -> Path:
    """``hf`` as a compressed-tensors FP8_BLOCK checkpoint at ``path`` with ``kv_cache_scheme``
    ``scheme`` and these attention layers' (k_scale, v_scale)."""
    save_fp8_checkpoint(hf, path)
    as_compressed_tensors(path, {**compressed_tensors_config(), "kv_cache_scheme": scheme})
    tensors = load_file(str(path / "model.safetensors"))
    for layer, (k, v) in (scales or {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, str(path / "model.safetensors"))
    return path


def make_hf_b128(kind: str, seed: int = 0):
    """A transformers Qwen3.5 CausalLM (fp32) with the block-aligned tiny shapes and random weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    common = dict(B128, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, tie_word_embeddings=False,
                  eos_token_id=299)
    if kind == "moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=128,
                                                           shared_expert_intermediate_size=256))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, intermediate_size=256))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                values = torch.rand(p.shape, generator=gen).mul(15).add(1).log()
            elif p.dim() == 1:  # zero-centred norms (the GDN norm: around 1)
                values = 0.1 * values + float(name.endswith("linear_attn.norm.weight"))
            else:
                values = values / math.sqrt(p.shape[-1])
            p.copy_(values)
    if kind == "moe":  # experts through F.linear, one expert at a time (``w8a8`` intercepts those calls)
        model.set_experts_implementation("eager")
    return model.eval()


def quantize_file(path: Path, scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Quantize the official set of ``path``'s tensors in place; returns the dequantized tensors."""
    tensors = load_file(str(path))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if not QUANTIZED.match(name):
            out[name] = t
            continue
        q, s = quantize_blocks(t, BLOCK)
        out[name], out[name + "_scale_inv"] = q, s.to(scale_dtype)
        dequantized[name] = dequantize_blocks(q, s.to(scale_dtype), BLOCK)
    save_file(out, str(path))
    return dequantized


def add_quantization_config(path: Path, config: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def save_fp8_checkpoint(hf, path: Path, *, with_mtp: bool = False, layout: str = "text",
                        scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``hf`` as an official-layout FP8 checkpoint (per-expert, one file); returns the dequantized
    weights by (text-layout) name."""
    save_checkpoint(hf, path, layout=layout, experts="per_expert", with_mtp=with_mtp)
    dequantized = quantize_file(path / "model.safetensors", scale_dtype)
    add_quantization_config(path, quantization_config())
    return {n.replace("model.language_model.", "model."): t for n, t in dequantized.items()}


@torch.no_grad()
def dequantized_hf(hf, dequantized: dict[str, torch.Tensor]):
    """``hf`` with its quantized projections replaced by their dequantized values (fp32)."""
    sd = hf.state_dict()
    for name, t in dequantized.items():
        if name.startswith("mtp."):  # transformers runs no MTP head
            continue
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            sd[name].copy_(t)
        elif m.group(3) == "down":
            sd[f"{m.group(1)}.down_proj"][int(m.group(2))].copy_(t)
        else:  # fused gate_up_proj [E, 2I, H]: gate rows, then up rows
            rows = sd[f"{m.group(1)}.gate_up_proj"].shape[1] // 2
            part = slice(0, rows) if m.group(3) == "gate" else slice(rows, 2 * rows)
            sd[f"{m.group(1)}.gate_up_proj"][int(m.group(2)), part].copy_(t)
    return hf


def export_hf(model) -> dict[str, torch.Tensor]:
    """An engine model's (one rank, unquantized) weights under Hugging Face names, experts per expert."""
    wmap = weight_map(model.args, with_mtp=model.mtp is not None)
    params = dict(model.named_parameters())
    out = {}
    for name, pl in wmap.by_name.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue  # the fused spellings of the per-expert tensors
        t = torch.empty(pl.shape, dtype=params[pl.param].dtype)
        for dst, src in pl.pieces:
            t[src] = params[pl.param].detach()[dst]
        out[name] = t
    return out


@contextlib.contextmanager
def w8a8(hf, dequantized: dict[str, torch.Tensor]):
    """Run ``hf`` (holding the dequantized weights) as W8A8: every GEMM with a quantized weight
    quantizes its input per token in groups of 128 first (transformers' own forward, its
    ``F.linear`` calls intercepted by weight address)."""
    sd = hf.state_dict()
    ptrs = set()
    for name in dequantized:
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if name.startswith("mtp."):
            continue
        if m is None:
            ptrs.add(sd[name].data_ptr())
        else:
            fused = sd[f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"]
            ptrs.add(fused[int(m.group(2))].data_ptr())
    linear = torch.nn.functional.linear

    def quantized_linear(x, weight, bias=None):
        if weight.data_ptr() in ptrs:
            q, scale = quantize_activations(x, BLOCK[1])
            x = dequantize_activations(q, scale, BLOCK[1]).to(x.dtype)
        return linear(x, weight, bias)

    torch.nn.functional.linear = quantized_linear
    try:
        yield hf
    finally:
        torch.nn.functional.linear = linear
