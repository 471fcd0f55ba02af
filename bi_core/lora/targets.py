"""The model's projections with per-slot adapter stacks. Every ``Linear`` of the main model's
layers that Hugging Face modules fill (``weight_map``: q|k|v in ``qkv_proj``, GDN's
in_proj_qkv|z|b|a in ``in_proj``, gate|up in ``gate_up_proj``, o_proj, out_proj, down_proj, the MoE
router and shared-expert gate) gets ``A [slots, R, K]`` and ``B [slots, N, R]``: each fused part
owns ``max_rank`` columns of R and its rows of N, so one shrink and one expand serve the fused
projection (the zero blocks add exact zeros). With ``lora.experts`` the MoE layers' experts get
theirs too (``lora/experts.py``, ``ExpertTarget`` entries of the same dict). The MTP head keeps the
base weights (its drafts are proposals; the main model decides every token), as does lm_head."""

from __future__ import annotations

import attrs
import torch

from bi_core.errors import CheckpointError
from bi_core.lora.experts import ExpertTarget, attach_experts
from bi_core.lora.peft import Adapter
from bi_core.models.weight_map import weight_map
from bi_core.ops.lora import LoraSpec


@attrs.define
class Part:
    """One Hugging Face module inside a projection: its rows of N and its rank columns of R."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    in_features: int


@attrs.define
class LoraTarget:
    """A projection's adapter stack and the op that applies it."""

    a: torch.Tensor  # [slots, R, K]
    b: torch.Tensor  # [slots, N, R]
    impl: object
    parts: dict[str, Part]  # Hugging Face module name -> where it sits
    ranks: torch.Tensor  # [slots] int32, shared by every target: each slot's rank (its used columns per part)


def _projections(model) -> dict[str, dict[str, tuple[int, int]]]:
    """Linear module path -> {Hugging Face module name: its rows}, for the main model's layers."""
    from bi_core.models.qwen3_5 import Linear

    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, place in weight_map(model.args, with_mtp=False).by_name.items():
        if not (name.startswith("model.layers.") and name.endswith(".weight") and place.param.endswith(".weight")):
            continue
        module = place.param[: -len(".weight")]
        try:
            lin = model.get_submodule(module)
        except AttributeError:
            continue
        if not isinstance(lin, Linear) or len(place.pieces) != 1:
            continue
        rows = place.pieces[0][0][0]
        out.setdefault(module, {})[name[: -len(".weight")]] = (rows.start or 0, rows.stop or lin.weight.shape[0])
    return out


def attach(model, factory, max_loras: int, max_rank: int, experts: bool = False) -> dict[str, LoraTarget]:
    """Give every adaptable projection its stacks (zeros: no adapter) and its lora op; a fused
    ``[gate; up]`` projection's GEMM runs without SiLU-and-mul then (the lora op applies it after
    the delta). Returns module path -> target; ``Linear.lora`` holds it too. ``experts``: the MoE
    layers' expert stacks as well (``SparseMoE.lora``)."""
    targets, ranks = {}, None
    for module, parts in _projections(model).items():
        lin = model.get_submodule(module)
        n, k = lin.weight.shape
        rank = max_rank * len(parts)
        spec = LoraSpec(**factory.base, in_features=k, out_features=n, rank=rank, max_loras=max_loras,
                        part_rank=max_rank, silu_mul=lin.spec.silu_mul)
        if lin.spec.silu_mul:
            lin.impl = factory.build("linear", attrs.evolve(lin.spec, silu_mul=False))
        dtype, device = factory.base["dtype"], lin.weight.device  # (the meta device when explain plans)
        if ranks is None:
            ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)
        placed = {hf: Part(rows, (j * max_rank, (j + 1) * max_rank), k) for j, (hf, rows) in enumerate(parts.items())}
        lin.lora = targets[module] = LoraTarget(
            a=torch.zeros((max_loras, rank, k), dtype=dtype, device=device),
            b=torch.zeros((max_loras, n, rank), dtype=dtype, device=device),
            impl=factory.build("lora", spec), parts=placed, ranks=ranks)
    if experts:
        targets |= attach_experts(model, factory, max_loras, max_rank)
    return targets


def check_adapter(adapter: Adapter, targets: dict[str, LoraTarget], max_rank: int) -> dict[str, tuple[str, Part]]:
    """Where each of the adapter's modules goes (module name -> (projection, part)); one error
    naming every module this engine cannot adapt or whose shapes do not fit."""
    where = {hf: (module, part) for module, t in _dense(targets).items() for hf, part in t.parts.items()}
    problems = []
    if adapter.rank > max_rank:
        problems.append(f"rank {adapter.rank} exceeds lora.max_rank={max_rank}")
    placed = {}
    for module, t in _experts(targets).items():
        got, bad = t.claim(adapter, max_rank)
        placed |= {name: (module, what) for name, what in got.items()}
        problems += bad
    experts_on = bool(_experts(targets))
    for name in adapter.params:
        if name not in placed:
            problems.append(f"{name} (expert parameters: {_EXPERTS_OFF if not experts_on else 'no MoE layer here'})")
    for hf, (a, b) in adapter.modules.items():
        if hf in placed:
            continue
        if hf not in where:
            why = _EXPERTS_OFF if ".mlp.shared_expert." in hf and not experts_on else _NOT_ADAPTABLE
            problems.append(f"{hf} ({why})")
            continue
        module, part = where[hf]
        rows = part.rows[1] - part.rows[0]
        if a.shape[1] != part.in_features or b.shape[0] != rows:
            problems.append(f"{hf}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit its weight "
                            f"[{rows}, {part.in_features}]")
        placed[hf] = (module, part)
    if problems:
        raise CheckpointError(f"LoRA adapter {adapter.source}: " + "; ".join(problems))
    return placed


@torch.no_grad()
def write_slot(targets: dict[str, LoraTarget], slot: int, adapter: Adapter | None, placed: dict) -> None:
    """Slot ``slot`` of every stack holds ``adapter`` (zeros where it has no module; None: all zeros)."""
    for t in _dense(targets).values():
        t.a[slot].zero_()
        t.b[slot].zero_()
        t.ranks[slot] = 0 if adapter is None else adapter.rank
    for module, t in _experts(targets).items():
        t.write(slot, adapter, {name: what for name, (m, what) in placed.items() if m == module})
    if adapter is None:
        return
    for hf, (a, b) in adapter.modules.items():
        module, part = placed[hf]
        if isinstance(targets[module], ExpertTarget):
            continue
        t, r = targets[module], a.shape[0]
        c0 = part.cols[0]
        t.a[slot, c0:c0 + r].copy_(a)
        t.b[slot, part.rows[0]:part.rows[1], c0:c0 + r].copy_(b)


def stack_bytes(targets: dict[str, LoraTarget]) -> int:
    """Device bytes of every adapter stack (what ``lora.max_loras`` x ``lora.max_rank`` costs)."""
    return sum(t.nbytes() if isinstance(t, ExpertTarget) else t.a.numel() * t.a.element_size()
               + t.b.numel() * t.b.element_size() for t in targets.values())


_EXPERTS_OFF = "the MoE experts and the shared expert take adapters with lora.experts: true"
_NOT_ADAPTABLE = ("no adaptable projection: LoRA serves attention, GDN, dense-MLP and MoE-router projections, and "
                  "with lora.experts the MoE experts; not lm_head or embeddings")


def _dense(targets: dict) -> dict[str, LoraTarget]:
    return {k: t for k, t in targets.items() if isinstance(t, LoraTarget)}


def _experts(targets: dict) -> dict[str, ExpertTarget]:
    return {k: t for k, t in targets.items() if isinstance(t, ExpertTarget)}
