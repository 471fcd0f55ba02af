"""Which projections of a Qwen3.5 model are FP8: an :class:`Fp8Scheme`, read from a checkpoint's
``config.json`` ``quantization_config`` or chosen by ``model.quantization: fp8``.

A scheme names *kinds* of projection (Hugging Face module names inside a decoder layer, e.g.
``self_attn.q_proj``, ``mlp.experts``) kept unquantized; every other kind the engine can hold in
FP8 is FP8, in every layer alike (the MTP head's layer has its own set). The official releases
(``Qwen3.5-*-FP8``) keep the GDN ``in_proj_b``/``in_proj_a`` and the MTP head's ``fc`` in bf16
and quantize the attention and GDN projections, dense MLPs, routed and shared experts; the
embeddings, lm_head, norms, the router ``mlp.gate``, ``shared_expert_gate`` and the GDN
``A_log``/``conv1d``/``dt_bias``/``norm`` are never FP8 in this engine (a checkpoint storing one of
them in FP8 is refused at load).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from bi_core.errors import CheckpointError, ConfigError

BLOCK = (128, 128)
SUPPORTED = ("the official block-wise FP8 of Qwen3.5-*-FP8: quant_method fp8, fmt e4m3, activation_scheme "
             "dynamic, weight_block_size [128, 128] (float32 or bfloat16 weight_scale_inv)")
WHERE = "config.json quantization_config"

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
GDN = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
       "linear_attn.out_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MOE = ("mlp.experts", "mlp.shared_expert")
MTP_FC = "fc"  # the MTP head's input projection, mtp.fc
GDN_HEAD, GDN_TAIL = GDN[:2], GDN[2:4]  # in_proj = qkv|z (head) then b|a (tail)

OFFICIAL_DENSE = frozenset(GDN_TAIL)
OFFICIAL_MTP_DENSE = frozenset({MTP_FC})


@attrs.frozen
class Fp8Weights:
    """One engine projection held in FP8: its block and the Hugging Face modules fused in it."""

    block: tuple[int, int]
    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        return "|".join(m.rsplit(".", 1)[-1] for m in self.modules)


@attrs.frozen(kw_only=True)
class Fp8Scheme:
    """Block-wise W8A8 FP8: weights float8_e4m3fn with one float32 scale per ``block`` (N, K),
    activations quantized per token in groups of ``block[1]`` at run time."""

    block: tuple[int, int] = BLOCK
    dense: frozenset[str] = OFFICIAL_DENSE  # kinds kept unquantized in the main layers
    mtp_dense: frozenset[str] = OFFICIAL_MTP_DENSE  # in the MTP head (its layer's kinds, and fc)
    origin: str = "model.quantization: fp8 (the official Qwen3.5-FP8 scheme)"

    def weights(self, *kinds: str) -> Fp8Weights | None:
        """The FP8 format of a projection fusing ``kinds`` (None: unquantized); all or none must be FP8."""
        dense = [k for k in kinds if k in self.dense]
        if not dense:
            return Fp8Weights(self.block, kinds)
        if len(dense) == len(kinds):
            return None
        fp8 = [k for k in kinds if k not in self.dense]
        raise CheckpointError(f"{self.origin}: {', '.join(kinds)} are fused into one projection of the engine, but "
                              f"{', '.join(dense)} is kept unquantized and {', '.join(fp8)} is FP8; convert all or "
                              "none of them")

    def for_mtp(self) -> Fp8Scheme:
        """The scheme the MTP head's layer and fc follow."""
        return attrs.evolve(self, dense=self.mtp_dense)


def fp8_weights(scheme: Fp8Scheme | None, *kinds: str) -> Fp8Weights | None:
    return None if scheme is None else scheme.weights(*kinds)


def splits_gdn_in_proj(scheme: Fp8Scheme | None) -> bool:
    """Whether the GDN in_proj is two projections (qkv|z in FP8, b|a unquantized, as officially)."""
    return scheme is not None and (scheme.weights(*GDN_HEAD) is None) != (scheme.weights(*GDN_TAIL) is None)


def resolve(setting: str | None, scheme: Fp8Scheme | None) -> Fp8Scheme | None:
    """``model.quantization`` (None: as the checkpoint is; ``fp8``; ``none``) against the checkpoint's
    own scheme (None for a bf16/fp32 checkpoint or a random preset)."""
    if setting == "none" and scheme is not None:
        raise ConfigError("model.quantization", "none, but the checkpoint is FP8 (config.json quantization_config "
                          "quant_method fp8); leave model.quantization unset or set fp8 (an FP8 checkpoint is not "
                          "dequantized on load)")
    if setting == "fp8" and scheme is None:
        return Fp8Scheme()
    return scheme


# ---------------------------------------------------------------------------------- config.json


def from_quantization_config(qc: Any, layer_types: Sequence[str], is_moe: bool, has_mtp: bool) -> Fp8Scheme:
    """The scheme of a checkpoint's ``quantization_config``; anything but the official block-wise
    FP8 is refused with one error naming what is supported."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{WHERE} must be a mapping, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        raise CheckpointError(f"{WHERE}: quant_method 'compressed-tensors' (llm-compressor checkpoints, e.g. "
                              f"FP8_DYNAMIC per-channel) is not supported; supported: {SUPPORTED}")
    block = qc.get("weight_block_size")
    bad = [f"{key} {qc.get(key)!r}" for key, ok in (
        ("quant_method", method == "fp8"), ("fmt", qc.get("fmt", "e4m3") == "e4m3"),
        ("activation_scheme", qc.get("activation_scheme", "dynamic") == "dynamic"),
        ("weight_block_size", isinstance(block, (list, tuple)) and list(block) == list(BLOCK)),
        ("scale_fmt", qc.get("scale_fmt") in (None, "float"))) if not ok]
    if bad:
        raise CheckpointError(f"{WHERE}: {', '.join(bad)} not supported; supported: {SUPPORTED}")
    patterns = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise CheckpointError(f"{WHERE}.modules_to_not_convert must be a list of module names")
    match = _matcher(patterns)
    ffn = MOE if is_moe else DENSE_MLP
    main = [(f"layers.{i}", (ATTENTION if t == "full_attention" else GDN) + ffn) for i, t in enumerate(layer_types)]
    dense = _dense_kinds(main, match)
    mtp_dense = _dense_kinds([("mtp.layers.0", ATTENTION + ffn)], match) if has_mtp else OFFICIAL_MTP_DENSE
    if has_mtp and _matches(match, "mtp.fc"):
        mtp_dense |= {MTP_FC}
    return Fp8Scheme(block=BLOCK, dense=dense, mtp_dense=frozenset(mtp_dense), origin=WHERE)


def _matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """transformers' ``should_convert_module`` rule, negated: a pattern names a module if it matches
    from the start up to a module boundary (as a regex, or literally), or is a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    compiled = []
    for key in patterns:
        try:
            compiled.append((key, re.compile(rf"(?:{key}){boundary}")))
        except re.error:
            compiled.append((key, re.compile(rf"(?:{re.escape(key)}){boundary}")))
    return lambda name: any(rx.match(name) or name.endswith(key) for key, rx in compiled)


def _spellings(name: str) -> tuple[str, ...]:
    """A module's names in the text-only and the multimodal checkpoints (``mtp.*`` is the same in both)."""
    if name.startswith("mtp."):
        return (name,)
    return (f"model.{name}", f"model.language_model.{name}")


def _matches(match: Callable[[str], bool], name: str) -> bool:
    return any(match(n) for n in _spellings(name))


LEAVES = {"mlp.experts": ("0.gate_proj", "0.up_proj", "0.down_proj"),
          "mlp.shared_expert": ("gate_proj", "up_proj", "down_proj")}


def _kind_dense(match: Callable[[str], bool], prefix: str, kind: str) -> bool | None:
    """Whether ``kind`` of the layer at ``prefix`` is unquantized (None: only some of its linears)."""
    if _matches(match, f"{prefix}.{kind}"):
        return True
    leaves = [_matches(match, f"{prefix}.{kind}.{leaf}") for leaf in LEAVES.get(kind, ())]
    if leaves and all(leaves):
        return True
    return None if any(leaves) else False


def _dense_kinds(layers: list[tuple[str, tuple[str, ...]]], match: Callable[[str], bool]) -> frozenset[str]:
    where: dict[str, dict[bool | None, list[str]]] = {}
    for prefix, kinds in layers:
        for kind in kinds:
            where.setdefault(kind, {}).setdefault(_kind_dense(match, prefix, kind), []).append(prefix)
    dense = set()
    for kind, by in where.items():
        if None in by:
            raise CheckpointError(f"{WHERE}.modules_to_not_convert keeps some linears of {kind} unquantized (in "
                                  f"{by[None][0]}) and not others; the engine holds {kind} in one format")
        if True in by and False in by:
            raise CheckpointError(f"{WHERE}.modules_to_not_convert keeps {kind} unquantized in {by[True][0]} but "
                                  f"not in {by[False][0]}; the engine holds each projection kind in one format in "
                                  "every layer")
        if True in by:
            dense.add(kind)
    return frozenset(dense)
