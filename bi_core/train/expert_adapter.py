"""The trainer's adapter on the MoE experts (``lora.experts``): PEFT's ``target_parameters`` on the
routed experts' fused ``experts.gate_up_proj`` / ``experts.down_proj`` (A ``[r*E, in]``, B ``[out,
r*E]``, under PEFT's module names: ``mlp.experts.base_layer`` for gate_up when both are targeted, as
PEFT nests its wrappers, else ``mlp.experts``) and the shared expert's ``gate_proj`` / ``up_proj`` /
``down_proj``. Each forward fills a layer's ``ExpertTarget`` stacks (one slot) from them as the
engine's loader writes them (``lora/experts.py``: ``round(A)``, ``round(B * scale)``), differentiably."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from bi_core.lora.experts import SHARED, ExpertTarget

PARAMS = ("gate_up_proj", "down_proj")  # in PEFT's order of wrapping (the experts module's parameters)


@attrs.frozen
class ExpertPart:
    """One adapted expert module: its MoE layer (``layers.N.mlp``), what it adapts there, its shapes."""

    module: str
    kind: str  # experts.gate_up_proj | experts.down_proj | gate_proj | up_proj | down_proj (shared)
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]


def _param_matches(key: str, wanted: list[str]) -> bool:
    """PEFT's rule for ``target_parameters``: the full parameter name or a dotted suffix of it."""
    return any(key == w or key.endswith("." + w) for w in wanted)


def expert_parts(cfg: dict, tm, targets: dict, r: int, matches: Callable[[str, object], bool]) -> dict[str, ExpertPart]:
    """PEFT module name -> its part, for the shared-expert modules ``tm`` matches and the expert
    parameters ``cfg``'s ``target_parameters`` name, on this model's MoE layers."""
    params = list(cfg.get("target_parameters") or [])
    out = {}
    for module, t in targets.items():
        if not isinstance(t, ExpertTarget):
            continue
        e, h, i, si = t.num_experts, t.hidden, t.inter, t.shared_inter
        for what in SHARED if t.shared is not None and tm is not None else ():
            name = f"{t.prefix}.shared_expert.{what}"
            if matches(name, tm):
                k, n = (si, h) if what == "down_proj" else (h, si)
                out[name] = ExpertPart(module, what, (r, k), (n, r))
        hit = [p for p in PARAMS if _param_matches(f"{t.prefix}.experts.{p}", params)]
        for j, p in enumerate(hit):
            k, n = (h, 2 * i) if p == "gate_up_proj" else (i, h)
            name = f"{t.prefix}.experts" + (".base_layer" * (len(hit) - 1 - j))
            out[name] = ExpertPart(module, f"experts.{p}", (r * e, k), (n, r * e))
    return out


def fill(t: ExpertTarget, parts: list[tuple[str, torch.Tensor, torch.Tensor]], scale: float,
         dtype: torch.dtype) -> None:
    """``t``'s routed and shared stacks (one slot) from the parts' A and B, as ``ExpertTarget.write``
    writes the engine's from ``lora/peft.py``'s adapter."""
    device = parts[0][1].device
    a13, b13, a2, b2 = (torch.zeros(s.shape, dtype=dtype, device=device) for s in t.routed)
    shared = tuple(torch.zeros(s.shape, dtype=dtype, device=device) for s in t.shared or ())
    e, i, w, m, n = t.num_experts, t.inter, t.width, t.max_rank, t.shared_inter
    for kind, a, b in parts:
        a, b = a.float(), b.float()
        if kind.startswith("experts."):  # PEFT's ParamWrapper: A (E, r, in), B (out, r, E)
            r = a.shape[0] // e
            a_e = a.reshape(e, r, -1)
            b_e = b.reshape(b.shape[0], r, e).permute(2, 0, 1) * scale
            if kind == "experts.gate_up_proj":  # gate rows [0, I), up rows at the padded width W
                a13[:, :r] = a_e
                b13[:, :i, :r] = b_e[:, :i]
                b13[:, w:w + i, :r] = b_e[:, i:]
            else:
                a2[:, :r, :i] = a_e
                b2[:, :, :r] = b_e
            continue
        s13, t13, s2, t2 = shared
        r = a.shape[0]
        if kind == "down_proj":
            s2[0, :r, :n] = a
            t2[0, :, :r] = b * scale
            continue
        c0, r0 = (0, 0) if kind == "gate_proj" else (m, w)
        s13[0, c0:c0 + r] = a
        t13[0, r0:r0 + n, c0:c0 + r] = b * scale
    t.routed, t.shared = (a13, b13, a2, b2), (shared or None)


def materialize(t: ExpertTarget, device: torch.device) -> None:
    """Zero stacks on the device (``attach_experts`` made them on the meta device, one slot)."""
    t.routed = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in t.routed)
    if t.shared is not None:
        t.shared = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in t.shared)
