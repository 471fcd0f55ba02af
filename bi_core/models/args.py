"""Model hyper-parameters read from a Hugging Face Qwen3.5 ``config.json`` (``text_config`` or
top level), never hard-coded."""

from __future__ import annotations

from typing import Any

import attrs

from bi_core.errors import CheckpointError
from bi_core.quant.scheme import Fp8Scheme, from_quantization_config, resolve

TEXT_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


@attrs.frozen(kw_only=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int | None = None  # dense models
    num_experts: int = 0  # MoE models
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    quantization: Fp8Scheme | None = None  # FP8 projections (bi_core.quant.scheme); None: all in the model dtype
    kv_cache_dtype: str = "auto"  # the attention layers' KV cache: auto (the model dtype) | fp8_e4m3 (cache.kv_cache_dtype)
    # M-RoPE (vision tokens' 3-D positions): rotary frequencies per axis t, h, w, and whether interleaved
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True

    @property
    def kv_scales(self) -> bool:
        """The attention layers store and read an FP8 cache at the checkpoint's calibrated k/v scales
        (one each per layer: ``self_attn.k_scale`` / ``v_scale``); else at scale 1."""
        return self.kv_cache_dtype == "fp8_e4m3" and self.quantization is not None and self.quantization.kv_scales

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], quantization: str | None = None) -> ModelArgs:
        """The args of a ``config.json``; ``quantization``: ``model.quantization`` (None: as the
        checkpoint is stored, its ``quantization_config`` read; ``fp8``; ``none``)."""
        text = config.get("text_config") or config
        model_type = text.get("model_type", config.get("model_type"))
        if model_type not in TEXT_MODEL_TYPES:
            raise CheckpointError(f"config.json: model_type {model_type!r} is not a Qwen3.5 model ({', '.join(TEXT_MODEL_TYPES)})")
        try:
            args = cls._parse(text, config)
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        qc = config.get("quantization_config") or text.get("quantization_config")
        scheme = None if qc is None else from_quantization_config(qc, args.layer_types, args.is_moe,
                                                                  args.mtp_num_hidden_layers > 0)
        return attrs.evolve(args, quantization=resolve(quantization, scheme))

    @classmethod
    def _parse(cls, text: dict[str, Any], top: dict[str, Any]) -> ModelArgs:
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise CheckpointError(f"config.json: rope_type {rope_type!r} is not supported (default only)")
        if text.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json: hidden_act {text['hidden_act']!r} is not supported (silu)")
        if text.get("output_gate_type", "swish") != "swish":
            raise CheckpointError(f"config.json: output_gate_type {text['output_gate_type']!r} is not supported (swish)")
        if text.get("attention_bias", False):
            raise CheckpointError("config.json: attention_bias=true is not supported by Qwen3.5")
        num_layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "linear_attention"}:
            raise CheckpointError(f"config.json: layer_types must list {num_layers} of full_attention/linear_attention")
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_experts = text.get("num_experts", 0) or 0
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text["num_key_value_heads"],
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=text.get("max_position_embeddings", 262144),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            intermediate_size=None if num_experts else text["intermediate_size"],
            num_experts=num_experts,
            num_experts_per_tok=text.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=text.get("moe_intermediate_size", 0) if num_experts else 0,
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0) if num_experts else 0,
            tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0) or 0,
            eos_token_ids=eos_ids,
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        )

    def to_hf_text_config(self) -> dict[str, Any]:
        """The transformers ``text_config`` for these args (used to save random presets)."""
        d: dict[str, Any] = {
            "model_type": "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "rms_norm_eps": self.rms_norm_eps, "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads, "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim, "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "tie_word_embeddings": self.tie_word_embeddings, "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "eos_token_id": list(self.eos_token_ids) or None, "hidden_act": "silu",
        }
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        else:
            d["intermediate_size"] = self.intermediate_size
        return d
