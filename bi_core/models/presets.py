"""Model shapes by name: tiny random models (the embedded default, no download) and the
published Qwen3.5 shapes (random weights, for benchmarks)."""

from __future__ import annotations

from typing import Any

from bi_core.models.args import ModelArgs
from bi_core.quant.scheme import resolve

BYTE_VOCAB = 260  # 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>
BYTE_EOS = 256

_TINY = dict(
    vocab_size=BYTE_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, mtp_num_hidden_layers=1, eos_token_ids=(BYTE_EOS,),
)
_TINY_B128 = dict(
    _TINY, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128, linear_num_key_heads=2,
    linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
)
_REAL = dict(
    vocab_size=248320, head_dim=256, rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144,
    rms_norm_eps=1e-6, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    mtp_num_hidden_layers=1, eos_token_ids=(248044, 248046),
)
_LARGE_MOE = dict(  # what Qwen3.5-122B-A10B and -397B-A17B share
    _REAL, num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=64,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-dense": {**_TINY, "intermediate_size": 128},
    "tiny-moe": {**_TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 32},
    "qwen3.5-0.8b": {**_REAL, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
                     "num_key_value_heads": 2, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                     "intermediate_size": 3584, "tie_word_embeddings": True},
    "qwen3.5-4b": {**_REAL, "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "intermediate_size": 9216, "tie_word_embeddings": True},
    "qwen3.5-9b": {**_REAL, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "intermediate_size": 12288},
    "qwen3.5-35b-a3b": {**_REAL, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512},
    # The three below: dev/qwen3_5.md table 1.2, each value checked against published config.json
    # text_config copies (Qwen/Qwen3.5-27B: H 5120, 64 layers, 24/4 heads, GDN 16/48, I 17408;
    # 122B-A10B: H 3072, 48 layers, 32/2, 16/64, 256 experts top-8, I = Is = 1024; 397B-A17B: H 4096,
    # 60 layers, 32/2, 16/64, 512 experts top-10, I = Is = 1024). Their FP8 releases share the shapes.
    "qwen3.5-27b": {**_REAL, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
                    "num_key_value_heads": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                    "intermediate_size": 17408},
    "qwen3.5-122b-a10b": {**_LARGE_MOE, "hidden_size": 3072, "num_hidden_layers": 48, "num_experts": 256,
                          "num_experts_per_tok": 8},
    "qwen3.5-397b-a17b": {**_LARGE_MOE, "hidden_size": 4096, "num_hidden_layers": 60, "num_experts": 512,
                          "num_experts_per_tok": 10},
    # Tiny shapes whose fused projection parts are whole 128-row FP8 blocks, also when split over two
    # tensor-parallel ranks (q|k|v, in_proj qkv|z, gate|up, experts): what model.quantization: fp8 needs.
    "tiny-dense-b128": {**_TINY_B128, "intermediate_size": 256},
    "tiny-moe-b128": {**_TINY_B128, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                      "shared_expert_intermediate_size": 256},
}


def preset_args(name: str, num_hidden_layers: int | None = None, quantization: str | None = None) -> ModelArgs:
    """The preset's args; ``quantization``: ``model.quantization`` (``fp8``: block-wise FP8 weights,
    quantized from the random full-precision ones)."""
    fields = dict(PRESETS[name])
    if num_hidden_layers is not None:
        fields["num_hidden_layers"] = num_hidden_layers
    n = fields["num_hidden_layers"]
    fields["layer_types"] = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))
    if "full_attention" not in fields["layer_types"]:  # keep one attention layer in cut-down models
        fields["layer_types"] = fields["layer_types"][:-1] + ("full_attention",)
    return ModelArgs(**fields, quantization=resolve(quantization, None))
