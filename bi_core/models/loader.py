"""Loads Hugging Face Qwen3.5 checkpoints (config.json + single or sharded safetensors) into
:class:`Qwen35Model`, fusing projections as the model expects.

Accepted: ``model.language_model.*`` (multimodal) and ``model.*`` (text-only) names; fused
``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (or transposed), or per-expert
``experts.{e}.{gate,up,down}_proj.weight``, independently for main and MTP layers; ``mtp.*``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from bi_core.errors import CheckpointError
from bi_core.models.args import ModelArgs
from bi_core.models.qwen3_5 import pad_experts

log = logging.getLogger(__name__)
IGNORED_PREFIXES = ("model.visual.", "visual.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "conv1d.bias")


def read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/config.json cannot be read: {e}") from None


def _normalise(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


class CheckpointIndex:
    """Normalised tensor name -> (file, stored name), over every ``*.safetensors`` in a directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        self.where: dict[str, tuple[Path, str]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key.startswith(IGNORED_PREFIXES) or key.endswith(IGNORED_SUFFIXES):
                        continue
                    self.where[_normalise(key)] = (f, key)
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"tensor {name} is missing from checkpoint {self.path}")
        f, key = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        self.used.add(name)
        return self._handles[f].get_tensor(key)

    def shape(self, name: str) -> tuple[int, ...]:
        f, key = self.where[name]
        with safe_open(str(f), framework="pt") as st:
            return tuple(st.get_slice(key).get_shape())

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.used)


@attrs.frozen
class Concat:
    """Our tensor = concatenation of checkpoint tensors along dim 0."""

    names: tuple[str, ...]


@attrs.frozen
class Experts:
    """Our stacked expert tensor from a fused or per-expert layout under ``prefix`` (``...mlp.experts``),
    with the shared expert under ``shared`` (``...mlp.shared_expert``) appended as the last expert."""

    prefix: str
    which: str  # "w13" or "w2"
    shared: str | None = None


def _layer_sources(ours: str, hf: str, layer_type: str, args: ModelArgs) -> dict[str, object]:
    s: dict[str, object] = {
        f"{ours}.input_layernorm.weight": Concat((f"{hf}.input_layernorm.weight",)),
        f"{ours}.post_attention_layernorm.weight": Concat((f"{hf}.post_attention_layernorm.weight",)),
    }
    if layer_type == "full_attention":
        a = f"{hf}.self_attn"
        s[f"{ours}.mixer.qkv_proj.weight"] = Concat(tuple(f"{a}.{x}_proj.weight" for x in "qkv"))
        s[f"{ours}.mixer.o_proj.weight"] = Concat((f"{a}.o_proj.weight",))
        for n in ("q_norm", "k_norm"):
            s[f"{ours}.mixer.{n}"] = Concat((f"{a}.{n}.weight",))
    else:
        a = f"{hf}.linear_attn"
        s[f"{ours}.mixer.in_proj.weight"] = Concat(tuple(f"{a}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")))
        s[f"{ours}.mixer.conv1d"] = Concat((f"{a}.conv1d.weight",))
        s[f"{ours}.mixer.A_log"] = Concat((f"{a}.A_log",))
        s[f"{ours}.mixer.dt_bias"] = Concat((f"{a}.dt_bias",))
        s[f"{ours}.mixer.norm_weight"] = Concat((f"{a}.norm.weight",))
        s[f"{ours}.mixer.out_proj.weight"] = Concat((f"{a}.out_proj.weight",))
    m = f"{hf}.mlp"
    if args.is_moe:
        shared = args.shared_expert_intermediate_size > 0
        se = f"{m}.shared_expert" if shared else None
        s[f"{ours}.mlp.gate.weight"] = Concat((f"{m}.gate.weight",) + ((f"{m}.shared_expert_gate.weight",) if shared else ()))
        s[f"{ours}.mlp.w13"] = Experts(f"{m}.experts", "w13", se)
        s[f"{ours}.mlp.w2"] = Experts(f"{m}.experts", "w2", se)
    else:
        s[f"{ours}.mlp.gate_up_proj.weight"] = Concat((f"{m}.gate_proj.weight", f"{m}.up_proj.weight"))
        s[f"{ours}.mlp.down_proj.weight"] = Concat((f"{m}.down_proj.weight",))
    return s


def weight_sources(args: ModelArgs, with_mtp: bool) -> dict[str, object]:
    """For every parameter of :class:`Qwen35Model`, where it comes from in a normalised checkpoint."""
    s: dict[str, object] = {
        "embed_tokens": Concat(("model.embed_tokens.weight",)),
        "norm.weight": Concat(("model.norm.weight",)),
    }
    if not args.tie_word_embeddings:
        s["lm_head.weight"] = Concat(("lm_head.weight",))
    for i, t in enumerate(args.layer_types):
        s.update(_layer_sources(f"layers.{i}", f"model.layers.{i}", t, args))
    if with_mtp:
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"):
            s[f"mtp.{n}.weight"] = Concat((f"mtp.{n}.weight",))
        s.update(_layer_sources("mtp.layer", "mtp.layers.0", "full_attention", args))
    return s


def _is_transposed(index: CheckpointIndex, prefix: str, num_experts: int, hidden: int, inter: int) -> bool:
    """Fused experts stored [E, in, out] (Qwen3-VL-MoE) instead of [E, out, in]. Decided from both
    tensors, since one alone is ambiguous when H == 2I (gate_up) or H == I (down)."""
    up = index.shape(f"{prefix}.gate_up_proj") if index.has(f"{prefix}.gate_up_proj") else None
    down = index.shape(f"{prefix}.down_proj") if index.has(f"{prefix}.down_proj") else None
    e, h, i = num_experts, hidden, inter
    return ((up == (e, h, 2 * i) and up != (e, 2 * i, h)) or (down == (e, i, h) and down != (e, h, i)))


def _expert_shape(which: str, hidden: int, inter: int) -> tuple[int, int]:
    return (2 * inter, hidden) if which == "w13" else (hidden, inter)


def _load_experts(index: CheckpointIndex, src: Experts, shape: torch.Size, args: ModelArgs) -> torch.Tensor:
    """Routed experts, then (with ``src.shared``) the shared expert, each zero-padded to the
    parameter's width (``pad_experts``)."""
    h, inter, shared_inter = args.hidden_size, args.moe_intermediate_size, args.shared_expert_intermediate_size
    width = shape[1] // 2 if src.which == "w13" else shape[2]
    routed_shape = torch.Size((args.num_experts, *_expert_shape(src.which, h, inter)))
    routed = pad_experts(_load_routed(index, src, routed_shape, h, inter), src.which, width)
    if src.shared is None:
        return routed
    names = ((f"{src.shared}.gate_proj.weight", f"{src.shared}.up_proj.weight") if src.which == "w13"
             else (f"{src.shared}.down_proj.weight",))
    shared = _check_shape(" + ".join(names), torch.cat([index.get(n) for n in names], dim=0),
                          torch.Size(_expert_shape(src.which, h, shared_inter)))
    return torch.cat([routed, pad_experts(shared[None].to(routed.dtype), src.which, width)])


def _load_routed(index: CheckpointIndex, src: Experts, shape: torch.Size, hidden: int, inter: int) -> torch.Tensor:
    num_experts = shape[0]
    fused_name = f"{src.prefix}.{'gate_up_proj' if src.which == 'w13' else 'down_proj'}"
    if index.has(fused_name):
        t = index.get(fused_name)
        if _is_transposed(index, src.prefix, num_experts, hidden, inter):
            t = t.transpose(1, 2)
        return _check_shape(fused_name, t, shape)
    parts = []
    for e in range(num_experts):
        names = ((f"{src.prefix}.{e}.gate_proj.weight", f"{src.prefix}.{e}.up_proj.weight")
                 if src.which == "w13" else (f"{src.prefix}.{e}.down_proj.weight",))
        if not index.has(names[0]):
            raise CheckpointError(
                f"tensor {fused_name} (fused) or {names[0]} (per-expert) is missing from checkpoint {index.path}")
        parts.append(torch.cat([index.get(n) for n in names], dim=0))
    return _check_shape(f"{src.prefix}.*.{src.which}", torch.stack(parts), shape)


def _check_shape(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if t.shape != shape:
        if t.numel() == shape.numel() and [d for d in t.shape if d != 1] == [d for d in shape if d != 1]:
            return t.reshape(shape)  # e.g. conv1d [C, 1, K] -> [C, K]
        raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(shape)}")
    return t


def load_weights(model: torch.nn.Module, index: CheckpointIndex) -> None:
    """Fill every parameter of ``model`` from ``index``; errors name the tensor and both shapes."""
    sources = weight_sources(model.args, with_mtp=model.mtp is not None)
    params = dict(model.named_parameters())
    missing = set(params) - set(sources)
    if missing:
        raise CheckpointError(f"internal: no checkpoint source for parameters {sorted(missing)[:5]}")
    for name, param in params.items():
        src = sources[name]
        if isinstance(src, Experts):
            t = _load_experts(index, src, param.shape, model.args)
        else:
            parts = [index.get(n) for n in src.names]
            for n, p in zip(src.names, parts):
                if len(src.names) > 1 and p.shape[1:] != param.shape[1:]:
                    raise CheckpointError(f"tensor {n}: checkpoint shape {tuple(p.shape)}, "
                                          f"model expects [*, {', '.join(map(str, param.shape[1:]))}]")
            t = _check_shape(" + ".join(src.names), torch.cat(parts, dim=0) if len(parts) > 1 else parts[0], param.shape)
        with torch.no_grad():
            param.copy_(t.to(param.dtype))
    unused = [n for n in index.unused() if not (model.args.tie_word_embeddings and n == "lm_head.weight")]
    mtp = [n for n in unused if n.startswith("mtp.")]
    if mtp and not model.args.mtp_num_hidden_layers:
        log.warning("checkpoint has %d MTP head tensors (mtp.*) but config.json has no mtp_num_hidden_layers: the "
                    "MTP head is not loaded (add \"mtp_num_hidden_layers\": 1 to use strategy mtp)", len(mtp))
        unused = [n for n in unused if not n.startswith("mtp.")]
    if unused:
        log.warning("checkpoint has %d tensors the model does not use, e.g. %s", len(unused), unused[:5])
