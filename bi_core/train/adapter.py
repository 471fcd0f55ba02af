"""A LoRA adapter trained on ``PolicyModel``: PEFT's adapter (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) on the projections the engine adapts (``lora/targets.py``),
its A and B trainable parameters, the base weights frozen.

The forward mirrors a LoRA-on engine's rows on that adapter: the trainer's model gets the engine's
adapter stacks (``targets.attach`` with the rollout config's ``lora.max_rank``: the same padded
rank and part columns, so the same kernel blocks), one slot filled from A and B as the engine's
loader fills it (``round(A)``, ``round(B * scale)`` in the model dtype), every row on that slot.
The lora op's backward differentiates ``y + (x A^T) B^T`` (``train/math.py``), so A and B get
gradients through the stacks. ``adapter_tensors`` and ``adapter_config`` give the adapter back in
PEFT's names, as the engine's ``load_lora_adapter`` takes it. With ``lora.experts`` the MoE
layers' expert stacks are filled so too (``train/expert_adapter.py``)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import torch

from bi_core.errors import ConfigError
from bi_core.lora.experts import ExpertTarget
from bi_core.lora.peft import _KEY, _PARAM_MODULE, _refusals
from bi_core.lora.targets import LoraTarget, Part
from bi_core.models.loader import _normalise
from bi_core.train import expert_adapter
from bi_core.train.expert_adapter import ExpertPart, expert_parts

PREFIX = "base_model.model."  # PEFT's names of a CausalLM's modules


@attrs.frozen
class AdapterSpec:
    """What the trainer's adapter is: its rank, alpha, rslora, and the modules it adapts."""

    r: int
    alpha: float
    rslora: bool
    target_modules: list[str] | str
    modules: dict[str, tuple[str, Part]]  # Hugging Face module name -> (engine projection, its part)
    experts: dict[str, ExpertPart] = attrs.Factory(dict)  # lora.experts: PEFT module name -> its expert part
    target_parameters: list[str] | None = None

    @property
    def scale(self) -> float:
        # the engine's loader computes it so (``lora/peft.py``): the same float, the same bits of B * scale
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def config(self, base_model: str | None) -> dict:
        """PEFT's ``adapter_config.json`` of the adapter."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.r, "lora_alpha": self.alpha, "use_rslora": self.rslora, "lora_dropout": 0.0,
                "bias": "none", "target_modules": self.target_modules, "init_lora_weights": True,
                **({"target_parameters": self.target_parameters} if self.target_parameters else {})}

    def shapes(self) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
        """PEFT module name -> the shapes of its A and B."""
        dense = {hf: ((self.r, p.in_features), (p.rows[1] - p.rows[0], self.r)) for hf, (_, p) in self.modules.items()}
        return dense | {name: (p.a_shape, p.b_shape) for name, p in self.experts.items()}


def _bad(msg: str) -> ConfigError:
    return ConfigError("lora (PolicyModel)", msg)


def _matches(name: str, targets: list[str] | str) -> bool:
    """PEFT's rule: a string is a regex on the full module name, a list of module-name suffixes;
    ``all-linear``: every projection the engine adapts."""
    if targets is None:  # (target_parameters alone)
        return False
    if targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def adapter_spec(cfg: dict, targets: dict[str, LoraTarget], max_rank: int,
                 named: set[str] | None = None) -> AdapterSpec:
    """The adapter an adapter_config dict describes, on this model's adaptable projections; one
    error naming what the trainer cannot train or the rollout engine cannot serve. ``named``: the
    modules of the tensors it starts from (they stand for ``target_modules`` when the dict has none,
    as the engine's loader reads such an adapter)."""
    if not isinstance(cfg, dict):
        raise _bad(f"give the adapter as PEFT's adapter_config dict (r, lora_alpha, target_modules), got "
                   f"{type(cfg).__name__}")
    problems = list(_refusals(cfg))
    r, alpha, tm = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        problems.append(f"r must be an integer in [1, lora.max_rank={max_rank}] (the rollout engine's), got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        problems.append(f"lora_alpha must be a finite number (PEFT's adapter_config has it), got {alpha!r}")
    if cfg.get("lora_dropout", 0.0) not in (0, 0.0, None):
        problems.append(f"lora_dropout {cfg['lora_dropout']!r}: dropout changes the forward, whose logprobs must be "
                        "the rollout's (use 0)")
    if len(set((cfg.get("rank_pattern") or {}).values()) - {r}):
        problems.append("rank_pattern: the trainer trains one rank on every module (r)")
    tp = cfg.get("target_parameters") or None
    named_modules = {n for n in (named or ()) if _PARAM_MODULE.search(n) is None}
    if tm is None and named_modules:
        tm = sorted({n.rsplit(".", 1)[-1] for n in named_modules})
    if isinstance(tm, (list, tuple, set)):
        tm = sorted(str(t) for t in tm)
    if not (isinstance(tm, str) or (isinstance(tm, list) and tm) or (tm is None and tp)):
        problems.append(f"target_modules must be a list of module names or a regex string, got {tm!r}")
    modules, experts = {}, {}
    if not problems:
        dense = {k: t for k, t in targets.items() if isinstance(t, LoraTarget)}
        modules = {hf: (module, part) for module, t in dense.items() for hf, part in t.parts.items()
                   if _matches(hf, tm)}
        experts = expert_parts(cfg, tm, targets, r, _matches)
        if tp and not any(p.kind.startswith("experts.") for p in experts.values()):
            problems.append(f"target_parameters {tp}: no MoE expert parameter here (expert adapters train with "
                            "lora.experts: true on a MoE model)")
        elif not modules and not experts:
            names = sorted({hf.rsplit(".", 1)[-1] for t in dense.values() for hf in t.parts})
            problems.append(f"target_modules {tm!r} match no projection the engine adapts ({', '.join(names)})")
    if problems:
        raise _bad("; ".join(problems))
    return AdapterSpec(r, float(alpha), bool(cfg.get("use_rslora")), tm, modules, experts, tp)


def initial_tensors(spec: AdapterSpec, tensors: dict[str, torch.Tensor] | None, seed: int, dtype: torch.dtype,
                    device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted module, its A ``[r, in]`` and B ``[out, r]``: ``tensors`` (PEFT's names, the adapter to
    start from), or PEFT's initialisation (A kaiming-uniform, B zeros: the base model's logprobs)."""
    if tensors is None:
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for hf, (a_shape, b_shape) in sorted(spec.shapes().items()):
            bound = 1.0 / math.sqrt(a_shape[1])  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear
            out[hf] = (torch.empty(a_shape).uniform_(-bound, bound, generator=gen), torch.zeros(b_shape))
        return {k: (a.to(dtype=dtype, device=device), b.to(dtype=dtype, device=device)) for k, (a, b) in out.items()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _bad(f"lora_tensors: {key!r} is not a LoRA A/B weight in PEFT's names")
        pairs.setdefault(_normalise(m["module"]), {})[m["ab"]] = t
    shapes = spec.shapes()
    missing, extra = sorted(set(shapes) - set(pairs)), sorted(set(pairs) - set(shapes))
    problems = ([f"no tensors for {missing}"] if missing else []) + ([f"{extra} are not in target_modules (or target_parameters)"]
                                                                     if extra else [])
    for hf, ab in sorted(pairs.items()):
        if hf not in shapes:
            continue
        for k, shape in zip("AB", shapes[hf]):
            if k not in ab or tuple(ab[k].shape) != shape:
                got = tuple(ab[k].shape) if k in ab else "missing"
                problems.append(f"{hf}.lora_{k}: {got}, expected {shape}")
    if problems:
        raise _bad("lora_tensors: " + "; ".join(problems))
    return {hf: (ab["A"].detach().to(dtype=dtype, device=device).clone(),
                 ab["B"].detach().to(dtype=dtype, device=device).clone()) for hf, ab in pairs.items()}


def stacks(target: LoraTarget, parts: list[tuple[Part, torch.Tensor, torch.Tensor]], scale: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's ``a [1, R, K]`` and ``b [1, N, R]`` from the parts' A and B (differentiable), as
    ``targets.write_slot`` writes the engine's from ``lora/peft.py``'s ``(A, B * scale)``."""
    device = parts[0][1].device
    a = torch.zeros(target.a.shape[1:], dtype=dtype, device=device)
    b = torch.zeros(target.b.shape[1:], dtype=dtype, device=device)
    for part, pa, pb in parts:
        c0, r = part.cols[0], pa.shape[0]
        a[c0:c0 + r] = pa.float()
        b[part.rows[0]:part.rows[1], c0:c0 + r] = pb.float() * scale
    return a[None], b[None]


def save_adapter(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """PEFT's adapter directory (``save_pretrained``'s files), which the engine and PEFT load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


@attrs.define
class LayerAdapter:
    """A decoder layer's adapter stacks: per engine projection of the layer, the parts the adapter
    covers (names relative to the layer: ``self_attn.q_proj``)."""

    targets: list[tuple[LoraTarget, list[tuple[str, Part]]]]
    scale: float
    dtype: torch.dtype
    experts: list[tuple[ExpertTarget, list[tuple[str, str]]]] = attrs.Factory(list)  # (rel name, kind)

    def fill(self, params: dict[str, torch.Tensor]) -> None:
        """Each covered projection's slot-0 stacks from the layer's ``<part>.lora_A/B.weight``."""
        for target, parts in self.targets:
            if parts:
                target.a, target.b = stacks(target, [(p, params[f"{rel}.lora_A.weight"], params[f"{rel}.lora_B.weight"])
                                                     for rel, p in parts], self.scale, self.dtype)
        for target, parts in self.experts:
            if parts:
                expert_adapter.fill(target, [(kind, params[f"{rel}.lora_A.weight"], params[f"{rel}.lora_B.weight"])
                                             for rel, kind in parts], self.scale, self.dtype)


def materialize(targets: dict[str, LoraTarget], rank: int, dtype: torch.dtype, device: torch.device) -> None:
    """One zero slot per projection on the device (``attach`` made them on the meta device): the
    projections the adapter does not cover add exact zeros there, as in the engine's slot."""
    ranks = torch.full((1,), rank, dtype=torch.int32, device=device)
    for t in targets.values():
        if isinstance(t, ExpertTarget):
            expert_adapter.materialize(t, device)
            continue
        t.a = torch.zeros((1, *t.a.shape[1:]), dtype=dtype, device=device)
        t.b = torch.zeros((1, *t.b.shape[1:]), dtype=dtype, device=device)
        t.ranks = ranks


def is_adapter_param(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def build(config, engine, factory, cfg: dict | None, tensors: dict[str, torch.Tensor] | None, seed: int,
          dtype: torch.dtype) -> tuple[AdapterSpec | None, dict[int, LayerAdapter], dict[int, dict]]:
    """The trainer's engine model with the rollout engine's adapter stacks (when its config serves
    adapters) and the adapter ``cfg`` describes: (its spec, per layer its stacks, per layer its
    initial A and B by module name relative to the layer)."""
    from bi_core.lora.targets import attach

    lo = config.lora
    if not lo.max_loras:
        if cfg is not None or tensors is not None:
            raise ConfigError("lora.max_loras", "the trainer's adapter mirrors a rollout engine that serves adapters: "
                              "build the policy from that engine's config (lora.max_loras > 0, its lora.max_rank)")
        return None, {}, {}
    if not (dtype.is_floating_point and dtype.itemsize >= 2):
        raise _bad(f"lora_dtype must be a floating dtype of 16 bits or more (float32, bfloat16...: the trainable A and B), got {dtype}")
    if cfg is None and tensors is not None:
        raise _bad("lora_tensors without lora: give the adapter's adapter_config dict as lora")
    # one slot: every training row is on the adapter; the rank padding (R) is the engine's, so its blocks
    # (lora.experts: the MoE layers' expert stacks too; attach_experts refuses FP8 experts by name)
    targets = attach(engine, factory, 1, lo.max_rank, experts=lo.experts)
    named = {_normalise(m["module"]) for m in map(_KEY.match, tensors or {}) if m is not None}
    spec = adapter_spec(cfg, targets, lo.max_rank, named) if cfg is not None else None
    compute, device = factory.base["dtype"], factory.base["device"]
    materialize(targets, spec.r if spec else 0, compute, device)
    init = initial_tensors(spec, tensors, seed, dtype, device) if spec else {}
    layers: dict[int, LayerAdapter] = {}
    inits: dict[int, dict] = {}
    for module, t in targets.items():
        i = int(module.split(".")[1])  # layers.<i>.
        hf_prefix = f"model.layers.{i}."
        layer = layers.setdefault(i, LayerAdapter([], spec.scale if spec else 1.0, compute))
        if isinstance(t, ExpertTarget):
            parts = [(hf[len(hf_prefix):], p.kind) for hf, p in (spec.experts if spec else {}).items()
                     if p.module == module]
            layer.experts.append((t, parts))
        else:
            parts = [(hf[len(hf_prefix):], p) for hf, p in t.parts.items() if hf in init]
            layer.targets.append((t, parts))
        inits.setdefault(i, {}).update({rel: init[hf_prefix + rel] for rel, _ in parts})
    return spec, layers, inits
