"""Random LoRA adapters in PEFT's naming for an engine's adaptable modules (tests, benchmarks),
as ``bi_core/models/random_init.py`` gives random base weights."""

from __future__ import annotations

import torch


def random_adapter(engine, *, r: int = 8, seed: int = 0, scale: float = 0.5, only: tuple[str, ...] = ()
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A rank-``r`` adapter on every module ``engine`` can adapt (or those whose name contains one
    of ``only``), A and B drawn from N(0, 1) scaled by ``scale / sqrt(fan-in)``: (its
    adapter_config dict, its tensors by PEFT's names)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for target in engine.model.lora_targets.values():
        for hf, part in target.parts.items():
            if only and not any(o in hf for o in only):
                continue
            rows = part.rows[1] - part.rows[0]
            tensors[f"base_model.model.{hf}.lora_A.weight"] = torch.randn(r, part.in_features, generator=gen) * (
                scale / part.in_features ** 0.5)
            tensors[f"base_model.model.{hf}.lora_B.weight"] = torch.randn(rows, r, generator=gen) * (scale / r ** 0.5)
    return {"r": r, "lora_alpha": r, "peft_type": "LORA"}, tensors
