"""Adapter stacks on the MoE experts (``lora.experts``), in the ``lora`` op's layout: per MoE layer,
the routed experts' stacks of ``max_loras * E`` rows (row ``slot * E + expert``: PEFT's
``target_parameters`` on ``experts.gate_up_proj`` / ``experts.down_proj``, one A shared by gate and
up) and the shared expert's of ``max_loras`` rows (PEFT's ``shared_expert.gate_proj`` / ``up_proj``
/ ``down_proj``: gate and up own ``max_rank`` rank columns each, as a fused dense projection's
parts). Each step, every (token, slot) pair is given its stack row (``bind``) and the MoE op adds
its deltas between the expert GEMMs (``ops/moe.py`` ``ExpertLora``)."""

from __future__ import annotations

from functools import partial

import attrs
import torch

from bi_core.errors import ConfigError
from bi_core.lora.peft import Adapter
from bi_core.ops.moe import ExpertLora

SHARED = ("gate_proj", "up_proj", "down_proj")


@attrs.define
class ExpertTarget:
    """One MoE layer's expert adapter stacks and where PEFT's names go in them."""

    prefix: str  # its Hugging Face module: model.layers.N.mlp
    routed: tuple[torch.Tensor, ...]  # a13 [S*E, R, H], b13 [S*E, 2W, R], a2 [S*E, R, W], b2 [S*E, H, R]
    shared: tuple[torch.Tensor, ...] | None  # a13 [S, 2R, H], b13 [S, 2W, 2R], a2 [S, R, W], b2 [S, H, R]
    num_experts: int  # routed E
    inter: int  # the routed experts' intermediate size (W, the padded width, may be larger)
    shared_inter: int
    width: int
    hidden: int
    max_rank: int

    def bind(self, ids: torch.Tensor, slots: torch.Tensor | None) -> ExpertLora:
        """The step's ExpertLora: pair (t, j) of routed expert ``ids[t, j]`` reads row
        ``slots[t] * E + ids[t, j]`` (-1 without an adapter); the shared expert's pairs row ``slots[t]``."""
        if slots is None:
            slots = torch.full((ids.shape[0],), -1, dtype=torch.int64, device=ids.device)
        s = slots.to(torch.int64)[:, None]
        pairs = torch.where(s >= 0, s * self.num_experts + ids, -1)
        if self.shared is not None:  # the shared expert's slot of each token: its own stacks
            pairs = torch.cat([pairs, torch.full_like(s, -1)], dim=1)
        return ExpertLora(*self.routed, pairs=pairs.reshape(-1), shared=self.shared, slots=slots)

    def names(self) -> dict[str, str]:
        """PEFT module name -> what it adapts here."""
        return {f"{self.prefix}.shared_expert.{m}": m for m in SHARED} if self.shared is not None else {}

    def claim(self, adapter: Adapter, max_rank: int) -> tuple[dict[str, str], list[str]]:
        """The adapter's modules and expert parameters this layer takes (name -> what), and the
        problems with their shapes."""
        placed, problems = {}, []
        for name, (a, b) in adapter.modules.items():
            what = self.names().get(name)
            if what is None:
                continue
            k = self.shared_inter if what == "down_proj" else self.hidden
            n = self.hidden if what == "down_proj" else self.shared_inter
            if a.shape[1] != k or b.shape[0] != n:
                problems.append(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit its weight "
                                f"[{n}, {k}]")
            placed[name] = what
        for name, (a, b) in adapter.params.items():
            if name.split(".experts")[0] != self.prefix:
                continue
            kind = self._param_kind(a, b)
            if kind is None or a.shape[0] % self.num_experts:
                problems.append(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are neither "
                                f"experts.gate_up_proj's [{self.num_experts}*r, {self.hidden}] / [{2 * self.inter}, "
                                f"{self.num_experts}*r] nor experts.down_proj's [{self.num_experts}*r, {self.inter}] "
                                f"/ [{self.hidden}, {self.num_experts}*r]")
            elif kind in placed.values():
                problems.append(f"{name}: a second adapter on {kind}")
            elif a.shape[0] // self.num_experts > max_rank:
                problems.append(f"{name}: rank {a.shape[0] // self.num_experts} exceeds lora.max_rank={max_rank}")
            else:
                placed[name] = kind
        return placed, problems

    def _param_kind(self, a: torch.Tensor, b: torch.Tensor) -> str | None:
        if a.shape[1] == self.hidden and b.shape[0] == 2 * self.inter:
            return "experts.gate_up_proj"
        if a.shape[1] == self.inter and b.shape[0] == self.hidden:
            return "experts.down_proj"
        return None

    @torch.no_grad()
    def write(self, slot: int, adapter: Adapter | None, placed: dict[str, str]) -> None:
        """Slot ``slot``'s rows hold ``adapter``'s modules of this layer (zeros elsewhere)."""
        e = self.num_experts
        rows = slice(slot * e, (slot + 1) * e)
        for t in self.routed:
            t[rows].zero_()
        for t in self.shared or ():
            t[slot].zero_()
        if adapter is None:
            return
        for name, what in placed.items():
            if name in adapter.params:
                self._write_param(rows, what, *adapter.params[name], adapter)
            elif name.startswith(self.prefix + ".") and name in adapter.modules:
                self._write_shared(slot, what, *adapter.modules[name])

    def _write_param(self, rows: slice, what: str, a: torch.Tensor, b: torch.Tensor, adapter: Adapter) -> None:
        # PEFT's ParamWrapper: A [r*E, in] is expert-major (E, r, in); B [out, r*E] is (out, r, E)
        e, i, w = self.num_experts, self.inter, self.width
        r = a.shape[0] // e
        a_e = a.reshape(e, r, -1)
        b_e = b.reshape(b.shape[0], r, e).permute(2, 0, 1) * adapter.scale(r)  # (E, out, r)
        a13, b13, a2, b2 = self.routed
        if what == "experts.gate_up_proj":  # gate rows [0, I), up rows at the padded width W
            a13[rows, :r].copy_(a_e)
            b13[rows, :i, :r].copy_(b_e[:, :i])
            b13[rows, w:w + i, :r].copy_(b_e[:, i:])
        else:
            a2[rows, :r, :i].copy_(a_e)
            b2[rows, :, :r].copy_(b_e)

    def _write_shared(self, slot: int, what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        a13, b13, a2, b2 = self.shared
        r, n, m = a.shape[0], self.shared_inter, self.max_rank
        if what == "down_proj":
            a2[slot, :r, :n].copy_(a)
            b2[slot, :, :r].copy_(b)
            return
        c0, r0 = (0, 0) if what == "gate_proj" else (m, self.width)
        a13[slot, c0:c0 + r].copy_(a)
        b13[slot, r0:r0 + n, c0:c0 + r].copy_(b)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.routed, *(self.shared or ())))


def attach_experts(model, factory, max_loras: int, max_rank: int) -> dict[str, ExpertTarget]:
    """Give every main-model MoE layer its expert stacks (zeros) and rebuild its moe op to take
    them; module path (``layers.N.mlp``) -> target."""
    from bi_core.models.qwen3_5 import SparseMoE

    out = {}
    for n, layer in enumerate(model.layers):
        moe = layer.mlp
        if not isinstance(moe, SparseMoE):
            continue
        if moe.fp8 is not None:
            raise ConfigError("lora.experts", "adapters on FP8 MoE experts are not supported yet (serve the "
                                              "bf16 checkpoint, or lora.experts: false)")
        moe.experts = factory.build("moe", attrs.evolve(moe.spec, lora=True))
        e, (_, h, w), m = moe.num_experts, moe.w2.shape, max_rank
        zeros = partial(_zeros, dtype=factory.base["dtype"], device=moe.w13.device)  # (meta when explain plans)
        routed = (zeros(max_loras * e, m, h), zeros(max_loras * e, 2 * w, m), zeros(max_loras * e, m, w),
                  zeros(max_loras * e, h, m))
        shared = (zeros(max_loras, 2 * m, h), zeros(max_loras, 2 * w, 2 * m), zeros(max_loras, m, w),
                  zeros(max_loras, h, m)) if moe.shared else None
        moe.lora = out[f"layers.{n}.mlp"] = ExpertTarget(f"model.layers.{n}.mlp", routed, shared, e, moe.widths[0],
                                                         moe.widths[1], w, h, max_rank)
    return out


def _zeros(*shape: int, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)
