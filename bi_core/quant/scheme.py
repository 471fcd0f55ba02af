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
             "dynamic, weight_block_size [128, 128] (float32 or bfloat16 weight_scale_inv); or the same arithmetic "
             "as compressed-tensors writes it (llm-compressor's FP8_BLOCK): format float-quantized, weights "
             "float 8-bit, strategy block, block_structure [128, 128]; input_activations float 8-bit, dynamic, "
             "strategy group, group_size 128 (weight_scale); per-channel or per-tensor FP8 (compressed-tensors "
             "FP8_DYNAMIC, FP8) only under model.quantization: fp8, which re-quantizes it block-wise on load; a "
             "kv_cache_scheme of one static float 8-bit scale per tensor (self_attn.k_scale / v_scale)")
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
    scale_suffix: str = "_scale_inv"  # a checkpoint's scales: weight + this (compressed-tensors: "_scale")
    # how the checkpoint's scales are laid out: "block" (as held), or "row" (one per output row, or one
    # per tensor: compressed-tensors' channel / tensor strategies), re-quantized block-wise on load
    source_scales: str = "block"
    # the checkpoint brings calibrated per-tensor k/v scales for an FP8 KV cache (compressed-tensors'
    # kv_cache_scheme: self_attn.k_scale / v_scale, fixed per layer); used under cache.kv_cache_dtype fp8
    kv_scales: bool = False

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


def describe(scheme: Fp8Scheme) -> str:
    """The explain line of a model held in FP8: the arithmetic, where the scheme came from, what stays unquantized."""
    kept = ", ".join(sorted(scheme.dense)) or "none"
    again = ("; the checkpoint's scales are per output row or per tensor: re-quantized block-wise on load"
             if scheme.source_scales == "row" else "")
    kv = "; the checkpoint's calibrated k/v scales (one per layer) for an FP8 KV cache" if scheme.kv_scales else ""
    return (f"weights: block-wise FP8 W8A8 ({scheme.block[0]}x{scheme.block[1]} weight blocks, activations per token "
            f"and group of {scheme.block[1]}) from {scheme.origin}{again}; projections kept unquantized: {kept}{kv}")


def fp8_weights(scheme: Fp8Scheme | None, *kinds: str) -> Fp8Weights | None:
    return None if scheme is None else scheme.weights(*kinds)


def splits_gdn_in_proj(scheme: Fp8Scheme | None) -> bool:
    """Whether the GDN in_proj is two projections (qkv|z in FP8, b|a unquantized, as officially)."""
    return scheme is not None and (scheme.weights(*GDN_HEAD) is None) != (scheme.weights(*GDN_TAIL) is None)


def resolve(setting: str | None, scheme: Fp8Scheme | None) -> Fp8Scheme | None:
    """``model.quantization`` (None: as the checkpoint is; ``fp8``; ``none``) against the checkpoint's
    own scheme (None for a bf16/fp32 checkpoint or a random preset)."""
    if scheme is not None and scheme.source_scales == "row" and setting != "fp8":
        raise ConfigError("model.quantization", f"{setting or 'unset'}, but the checkpoint's FP8 weights have a scale "
                          f"per output row or per tensor ({scheme.origin}), which this engine does not compute; set "
                          "model.quantization: fp8 to re-quantize them block-wise on load (each weight dequantized, "
                          "rounded to model.dtype, quantized per 128x128 block: a second rounding; activations per "
                          "token and group of 128 at run time)")
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
        return _compressed_tensors(qc, layer_types, is_moe, has_mtp)
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
    return _scheme(_matcher(patterns), layer_types, is_moe, has_mtp, origin=WHERE)


def _scheme(match: Callable[[str], bool], layer_types: Sequence[str], is_moe: bool, has_mtp: bool,
            **fields: Any) -> Fp8Scheme:
    """The scheme whose unquantized modules are those ``match`` names (Hugging Face module names)."""
    ffn = MOE if is_moe else DENSE_MLP
    main = [(f"layers.{i}", (ATTENTION if t == "full_attention" else GDN) + ffn) for i, t in enumerate(layer_types)]
    dense = _dense_kinds(main, match)
    mtp_dense = _dense_kinds([("mtp.layers.0", ATTENTION + ffn)], match) if has_mtp else OFFICIAL_MTP_DENSE
    if has_mtp and _matches(match, "mtp.fc"):
        mtp_dense |= {MTP_FC}
    return Fp8Scheme(block=BLOCK, dense=dense, mtp_dense=frozenset(mtp_dense), **fields)


# compressed-tensors (llm-compressor's checkpoints): the arguments of its FP8_BLOCK preset, which
# are this engine's arithmetic (weights in 128x128 blocks, activations per token and group of 128
# at run time); keys not listed here must be absent or None
CT_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
              "symmetric": True, "dynamic": False}
CT_INPUTS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "symmetric": True,
             "dynamic": True}
# per-channel / per-tensor weights (FP8_DYNAMIC, FP8): re-quantized block-wise on load under
# model.quantization: fp8, so only the weights' own format is checked (the activations' is replaced)
CT_ROW = ("channel", "tensor")
# kv_cache_scheme: one fixed (calibrated) scale per layer for keys and one for values: the cache
# stores x / scale in e4m3; per-head or dynamic scales are not read (a dynamic scale would come from the batch)
CT_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
ANY = object()  # a key that may hold anything
CT_ROW_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": ANY}
CT_ROW_INPUTS = {"num_bits": 8, "type": "float", "strategy": ANY, "dynamic": ANY, "group_size": ANY,
                 "symmetric": ANY, "block_structure": ANY}
CT_OPTIONAL = {"symmetric"}  # absent means the default, True
CT_IGNORED_KEYS = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype", "actorder"}  # calibration-only


def _compressed_tensors(qc: dict, layer_types: Sequence[str], is_moe: bool, has_mtp: bool) -> Fp8Scheme:
    """A compressed-tensors ``quantization_config`` whose groups are all FP8_BLOCK (this engine's
    arithmetic), or all per-channel / per-tensor FP8 (``source_scales`` "row": re-quantized on load,
    see ``resolve``): the scheme it gives (the linears its groups' ``targets`` name, less
    ``ignore``); anything else refused with what is not supported and what is."""
    where = f"{WHERE} (quant_method compressed-tensors)"
    bad = []
    if qc.get("format") not in ("float-quantized", "mixed-precision", None):
        bad.append(f"format {qc['format']!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        bad.append(f"quantization_status {qc['quantization_status']!r}")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, dict):
        bad.append(f"kv_cache_scheme {kv!r}")
    elif kv is not None:
        bad += [f"kv_cache_scheme.{k} {kv.get(k)!r}" for k in _ct_mismatches(kv, CT_KV)]
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        bad.append(f"config_groups {groups!r}")
        groups = {}
    targets: list[str] = []
    row = {n: isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("strategy") in CT_ROW
           for n, g in groups.items()}
    if len(set(row.values())) > 1:
        bad.append(f"config_groups mixing block-wise and per-channel/per-tensor weights ({', '.join(groups)})")
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        if group.get("format", "float-quantized") != "float-quantized":
            bad.append(f"config_groups.{name}.format {group.get('format')!r}")
        wants = ((("weights", CT_ROW_WEIGHTS), ("input_activations", CT_ROW_INPUTS)) if row[name] else
                 (("weights", CT_WEIGHTS), ("input_activations", CT_INPUTS)))
        for key, want in wants:
            args = group.get(key)
            if args is None and want is CT_ROW_INPUTS:  # FP8 weight-only: activations quantized here anyway
                continue
            if not isinstance(args, dict):
                bad.append(f"config_groups.{name}.{key} {args!r}")
                continue
            bad += [f"config_groups.{name}.{key}.{k} {args.get(k)!r}" for k in _ct_mismatches(args, want)]
        if group.get("output_activations") is not None:
            bad.append(f"config_groups.{name}.output_activations {group['output_activations']!r}")
        t = group.get("targets")
        if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
            bad.append(f"config_groups.{name}.targets {t!r}")
        else:
            targets += t
    if bad:
        raise CheckpointError(f"{where}: {', '.join(bad)} not supported; supported: {SUPPORTED}")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise CheckpointError(f"{where}.ignore must be a list of module names or 're:' patterns")
    targeted, ignored = _ct_matcher(targets), _ct_matcher(ignore)

    def unquantized(name: str) -> bool:  # a container (the experts) is decided by its linears
        return ignored(name) or (not name.endswith(tuple(LEAVES)) and not targeted(name))

    return _scheme(unquantized, layer_types, is_moe, has_mtp, origin=where, scale_suffix="_scale",
                   source_scales="row" if any(row.values()) else "block", kv_scales=kv is not None)


def _ct_mismatches(args: dict, want: dict) -> list[str]:
    """The keys of a compressed-tensors QuantizationArgs mapping that differ from ``want`` (or that
    it sets and ``want`` does not have, calibration-only keys aside)."""
    out = [k for k, v in want.items() if v is not ANY and args.get(k, v if k in CT_OPTIONAL else None) != v]
    return out + [k for k, v in args.items() if k not in want and k not in CT_IGNORED_KEYS and v is not None]


def _ct_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """compressed-tensors' rule (vLLM's ``find_matched_target``, for names): ``re:<regex>`` matches from
    the start of a module's name, anything else is the name itself; ``Linear`` (the class its
    targets usually name) matches every projection (the engine only ever quantizes linears)."""
    if "Linear" in patterns:
        return lambda name: True
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    names = {p for p in patterns if not p.startswith("re:")}
    return lambda name: name in names or any(rx.match(name) for rx in regexes)


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
