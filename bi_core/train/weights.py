"""The trainer's parameters in Hugging Face names and layout, and the engine's fused parameters made
from them: one ``WeightMap`` (``models/weight_map.py``) says where every checkpoint tensor goes, so
the fusion here is the loader's, differentiable (autograd sees the slice copies), and its inverse
fills the HF tensors from an engine model (random presets, checkpoints in any layout the loader
reads)."""

from __future__ import annotations

import re

import attrs
import torch

from bi_core.models.args import ModelArgs
from bi_core.models.weight_map import ALL, weight_map

# one layout per tensor: experts fused ([E, 2I, H] and [E, H, I], transformers' own), so the
# per-expert names of the map are left out; k/v scales are calibration data, not weights
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
_SKIPPED = ("k_scale", "v_scale")


@attrs.frozen
class Piece:
    hf_name: str
    dst: tuple
    src: tuple


@attrs.frozen
class FusionPlan:
    """Per engine parameter, the HF tensors that make it; per HF tensor, its shape."""

    pieces: dict[str, tuple[Piece, ...]]
    shapes: dict[str, tuple[int, ...]]
    place_shapes: dict[str, tuple[int, ...]] = attrs.field(factory=dict)  # each HF tensor as the map places it

    def layer(self, i: int) -> FusionPlan:
        """The plan of decoder layer ``i``, names relative to the layer (``mixer.qkv_proj.weight`` from
        ``self_attn.q_proj.weight``...)."""
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pieces = {name[len(ours):]: tuple(attrs.evolve(p, hf_name=p.hf_name[len(hf):]) for p in ps)
                  for name, ps in self.pieces.items() if name.startswith(ours)}
        shapes = {name[len(hf):]: s for name, s in self.shapes.items() if name.startswith(hf)}
        place = {name[len(hf):]: s for name, s in self.place_shapes.items() if name.startswith(hf)}
        return FusionPlan(pieces, shapes, place)


def fusion_plan(args: ModelArgs) -> FusionPlan:
    wm = weight_map(args, with_mtp=False)
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    place_shapes: dict[str, tuple[int, ...]] = {}
    for name, place in wm.by_name.items():
        if _PER_EXPERT.search(name) or name.endswith(_SKIPPED):
            continue
        # transformers keeps the GDN conv as nn.Conv1d's [C, 1, K]; the map's shape is [C, K]
        shapes[name] = (place.shape[0], 1, *place.shape[1:]) if name.endswith("conv1d.weight") else place.shape
        place_shapes[name] = place.shape
        for dst, src in place.pieces:
            pieces.setdefault(place.param, []).append(Piece(name, dst, src))
    missing = sorted(set(wm.required) - set(pieces))
    assert not missing, f"no HF tensor fills {missing}"
    return FusionPlan({k: tuple(v) for k, v in pieces.items()}, shapes, place_shapes)


def fuse(shape: torch.Size, pieces: tuple[Piece, ...], tensors: dict[str, torch.Tensor],
         dtype: torch.dtype) -> torch.Tensor:
    """The engine parameter of ``shape`` from its HF tensors (zeros where none writes: narrower
    experts' padding), in ``dtype``; differentiable."""
    if len(pieces) == 1 and pieces[0].dst == ALL and pieces[0].src == ALL:
        return tensors[pieces[0].hf_name].to(dtype).reshape(shape)
    out = torch.zeros(shape, dtype=dtype, device=tensors[pieces[0].hf_name].device)
    for p in pieces:
        out[p.dst] = tensors[p.hf_name].to(dtype)[p.src]
    return out


@torch.no_grad()
def fuse_fp8(param: torch.nn.Parameter, pieces: tuple[Piece, ...], tensors: dict[str, torch.Tensor],
             place_shapes: dict[str, tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 engine parameter (float8 values, float32 block scales) from its HF tensors, as the
    engine's loader makes it at a weight sync: each tensor rounded to the model dtype and quantized
    per 128x128 block on its own, values and scales placed (``models/loader.py`` ``_copy``)."""
    from bi_core.quant.fp8_loading import block_index
    from bi_core.quant.fp8_numerics import FP8, quantize_blocks, scale_shape

    block, device = param.fp8.block, tensors[pieces[0].hf_name].device
    shape = tuple(param.shape)
    q = torch.zeros(shape, dtype=FP8, device=device)  # narrower experts' padding: zeros, as the engine holds
    scale = torch.ones(scale_shape(shape, block), dtype=torch.float32, device=device)
    for p in pieces:
        t = tensors[p.hf_name].detach().to(param.dense_dtype).reshape(place_shapes[p.hf_name])
        qt, st = quantize_blocks(t, block)
        q[p.dst] = qt[p.src]
        scale[block_index(p.dst, shape, block, p.hf_name, False)] = st[block_index(p.src, tuple(t.shape), block,
                                                                                   p.hf_name, True)]
    return q, scale


@torch.no_grad()
def unfuse(plan: FusionPlan, engine_params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF tensors holding exactly what the engine's parameters hold: in ``dtype``, or in the
    engine parameter's own dtype where that is wider (GDN's float32 ``A_log`` and ``dt_bias`` in a
    bf16 model: rounding them to bf16 changed every logprob)."""
    device = next(iter(engine_params.values())).device
    wider = {p.hf_name: torch.promote_types(dtype, engine_params[param].dtype)
             for param, pieces in plan.pieces.items() for p in pieces}
    out = {name: torch.empty(shape, dtype=wider[name], device=device) for name, shape in plan.shapes.items()}
    for param, pieces in plan.pieces.items():
        for p in pieces:
            dst = out[p.hf_name] if p.src != ALL else out[p.hf_name].view(engine_params[param][p.dst].shape)
            dst[p.src] = engine_params[param][p.dst].to(dst.dtype)
    return out
