"""Random LoRA adapters in PEFT's naming for an engine's adaptable modules (tests, benchmarks),
as ``bi_core/models/random_init.py`` gives random base weights."""

from __future__ import annotations

import torch

from bi_core.lora.experts import ExpertTarget


def random_adapter(engine, *, r: int = 8, seed: int = 0, scale: float = 0.5, only: tuple[str, ...] = ()
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A rank-``r`` adapter on every module ``engine`` can adapt (or those whose name contains one
    of ``only``), A and B drawn from N(0, 1) scaled by ``scale / sqrt(fan-in)``: (its
    adapter_config dict, its tensors by PEFT's names). With ``lora.experts``, the MoE experts'
    fused parameters too, as PEFT's ``target_parameters`` stores them."""
    gen = torch.Generator().manual_seed(seed)
    tensors, params = {}, set()

    def add(name: str, rows_a: int, k: int, n: int, cols_b: int) -> None:
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rows_a, k, generator=gen) * (scale / k ** 0.5)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n, cols_b, generator=gen) * (scale / r ** 0.5)

    for target in engine.model.lora_targets.values():
        if isinstance(target, ExpertTarget):
            _expert_modules(target, r, only, add, params)
            continue
        for hf, part in target.parts.items():
            if not only or any(o in hf for o in only):
                add(hf, r, part.in_features, part.rows[1] - part.rows[0], r)
    cfg = {"r": r, "lora_alpha": r, "peft_type": "LORA"}
    if params:
        cfg["target_parameters"] = sorted(params)
    return cfg, tensors


def _expert_modules(t: ExpertTarget, r: int, only: tuple[str, ...], add, params: set) -> None:
    e, h, i, si = t.num_experts, t.hidden, t.inter, t.shared_inter
    for name, k, n in ((f"{t.prefix}.shared_expert.gate_proj", h, si), (f"{t.prefix}.shared_expert.up_proj", h, si),
                       (f"{t.prefix}.shared_expert.down_proj", si, h)) if t.shared is not None else ():
        if not only or any(o in name for o in only):
            add(name, r, k, n, r)
    # PEFT nests a ParamWrapper per parameter: the first targeted is the inner one (``base_layer``)
    for name, k, n, param in ((f"{t.prefix}.experts.base_layer", h, 2 * i, "mlp.experts.gate_up_proj"),
                              (f"{t.prefix}.experts", i, h, "mlp.experts.down_proj")):
        if not only or any(o in name for o in only):
            add(name, r * e, k, n, r * e)
            params.add(param)
