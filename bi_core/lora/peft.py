"""PEFT's LoRA format: ``adapter_config.json`` (r, lora_alpha, target_modules, use_rslora) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight [r, in]`` and
``lora_B.weight [out, r]``), read into one ``Adapter``: per Hugging Face module name (normalised as
checkpoint names are: ``model.layers.3.self_attn.q_proj``) its A and its B with the scale folded in
(``lora_alpha / r``, or ``/ sqrt(r)`` with rslora; ``r`` per module from its tensors, which is what
PEFT's ``rank_pattern`` changes). Adapters on the MoE experts' fused parameters
(``target_parameters``: ``experts.gate_up_proj``, ``experts.down_proj``; tensors
``<layer>.mlp.experts[.base_layer].lora_A.weight [r*E, in]``, ``lora_B.weight [out, r*E]``) are
kept raw in ``params``: their rank and scale need the number of experts (``lora/experts.py``).
What inference cannot honour is refused by name (DoRA, biases, modules_to_save, alpha_pattern,
embedding adapters, parameters other than the experts')."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import torch

from bi_core.errors import CheckpointError
from bi_core.models.loader import _normalise

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
_PARAM_MODULE = re.compile(r"\.experts(?:\.base_layer)*$")  # PEFT nests one ParamWrapper per parameter
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@attrs.frozen
class Adapter:
    """One adapter's tensors: module name -> (A [r, in], B [out, r] times its scale)."""

    rank: int  # the largest rank of its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    source: str  # where it came from, for errors
    params: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.Factory(dict)  # experts: raw A, B
    alpha: float = 0.0
    rslora: bool = False

    def scale(self, r: int) -> float:
        """The scale of a rank-``r`` module (``lora_alpha / r``, or ``/ sqrt(r)`` with rslora)."""
        return self.alpha / (math.sqrt(r) if self.rslora else r)


def _refusals(cfg: dict) -> list[str]:
    out = []
    if cfg.get("peft_type", "LORA") != "LORA":
        out.append(f"peft_type is {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        out.append("use_dora: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        out.append(f"bias is {cfg.get('bias')!r}: adapters that train biases are not supported (bias: none)")
    if cfg.get("modules_to_save"):
        out.append(f"modules_to_save {cfg['modules_to_save']}: fully trained modules are not an adapter")
    if cfg.get("alpha_pattern"):
        out.append("alpha_pattern: per-module alphas are not supported (rank_pattern is)")
    params = cfg.get("target_parameters") or []
    other = [p for p in params if not (isinstance(p, str) and p.endswith(_EXPERT_PARAMS))]
    if other:
        out.append(f"target_parameters {other}: only the MoE experts' {' and '.join(_EXPERT_PARAMS)} are supported")
    return out


def adapter_from_tensors(cfg: dict, tensors: dict[str, torch.Tensor], source: str) -> Adapter:
    """An adapter from its config dict and its tensors as PEFT names them."""
    bad = _refusals(cfg)
    if bad:
        raise CheckpointError(f"LoRA adapter {source}: {'; '.join(bad)}")
    try:
        alpha = float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"LoRA adapter {source}: adapter_config lora_alpha missing or not a number") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"LoRA adapter {source}: tensor {key!r} is not a LoRA A/B weight (embedding "
                                  "adapters, DoRA magnitudes and saved modules are not supported)")
        pairs.setdefault(_normalise(m["module"]), {})[m["ab"]] = t
    rslora = bool(cfg.get("use_rslora"))
    modules, params = {}, {}
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"LoRA adapter {source}: {name} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(f"LoRA adapter {source}: {name} lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)} are not [r, in] and [out, r]")
        if cfg.get("target_parameters") and _PARAM_MODULE.search(name):
            params[name] = (a.float(), b.float())
            continue
        r = a.shape[0]
        modules[name] = (a.float(), b.float() * (alpha / (math.sqrt(r) if rslora else r)))
    if not modules and not params:
        raise CheckpointError(f"LoRA adapter {source}: no lora_A / lora_B tensors")
    rank = max([a.shape[0] for a, _ in modules.values()] + ([_int_r(cfg, source)] if params else []))
    return Adapter(rank=rank, modules=modules, source=source, params=params, alpha=alpha, rslora=rslora)


def _int_r(cfg: dict, source: str) -> int:
    """The config's ``r``: the rank of expert-parameter adapters (``lora/experts.py`` checks it
    against their tensors)."""
    r = cfg.get("r", 8)  # PEFT's default
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise CheckpointError(f"LoRA adapter {source}: adapter_config r must be a positive integer, got {r!r}")
    return r


def read_adapter(path: str | Path) -> Adapter:
    """A PEFT adapter directory (``save_pretrained``'s output)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"LoRA adapter {path}: {CONFIG} cannot be read: {e}") from None
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"LoRA adapter {path}: no {WEIGHTS} (PEFT's save_pretrained writes it)")
    return adapter_from_tensors(cfg, load_file(str(path / WEIGHTS)), str(path))
