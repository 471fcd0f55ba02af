"""Qwen3.5's vision tower (transformers' ``Qwen3_5VisionModel``): patch embedding (a linear over
each flattened ``C x T x P x P`` patch: the Conv3d of stride = kernel), learned position
embeddings resampled bilinearly to each image's grid, ViT blocks (LayerNorm, bidirectional
attention within each image or frame with 2-D rotary positions, GELU-tanh MLP), and the patch
merger (LayerNorm, 2x2 patches to one token, GELU MLP to the text model's width).

Every computation goes through an op (``linear``, ``layer_norm``, ``vision_attention``) or is
element-wise, and the host-side index work (positions, interpolation taps, segment offsets) is
done image by image: on a batch-invariant backend an image's embeddings are the same bits
whatever other images share the batch."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from bi_core.errors import CheckpointError
from bi_core.models.qwen3_5 import Linear, _param
from bi_core.ops.vision import LayerNormSpec, VisionAttentionSpec
from bi_core.selector import OpFactory

LN_EPS = 1e-6  # transformers' nn.LayerNorm(eps=1e-6) in the blocks and the merger


@attrs.frozen(kw_only=True)
class VisionArgs:
    """The ``vision_config`` of a multimodal checkpoint and the placeholder token ids."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @classmethod
    def published(cls, out_hidden_size: int, depth: int | None = None) -> VisionArgs:
        """The released Qwen3.5 tower's shape (transformers' Qwen3_5VisionConfig defaults: 27 blocks
        of width 1152, 16 heads, 16-pixel patches), feeding a text model of width ``out_hidden_size``;
        ``depth``: fewer blocks (random weights, benchmarks)."""
        return cls(depth=27 if depth is None else depth, hidden_size=1152, intermediate_size=4304, num_heads=16,
                   in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                   out_hidden_size=out_hidden_size, num_position_embeddings=2304)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionArgs | None:
        """The tower of a ``config.json``; None for a text-only checkpoint."""
        v = config.get("vision_config")
        if not v:
            return None
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"config.json: vision_config.hidden_act {act!r} is not supported "
                                  "(gelu_pytorch_tanh, gelu)")
        rope = v.get("rope_parameters") or {}
        try:
            return cls(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                       num_heads=v["num_heads"], in_channels=v.get("in_channels", 3), patch_size=v["patch_size"],
                       temporal_patch_size=v.get("temporal_patch_size", 2),
                       spatial_merge_size=v.get("spatial_merge_size", 2), out_hidden_size=v["out_hidden_size"],
                       num_position_embeddings=v["num_position_embeddings"], hidden_act=act,
                       rope_theta=float(rope.get("rope_theta", 10000.0)),
                       **{k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id") if k in config})
        except KeyError as e:
            raise CheckpointError(f"config.json: vision_config is missing field {e.args[0]!r}") from None


class BiasLinear(nn.Module):
    """``x @ W.T + b``: the linear op, then the bias added element-wise."""

    def __init__(self, factory: OpFactory, in_features: int, out_features: int, dtype, device) -> None:
        super().__init__()
        self.linear = Linear(factory, in_features, out_features, dtype, device)
        self.bias = _param(out_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias


class LayerNorm(nn.Module):
    def __init__(self, factory: OpFactory, size: int, dtype, device) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.bias = _param(size, dtype=dtype, device=device)
        self.impl = factory.build("layer_norm", LayerNormSpec(**factory.base, hidden_size=size, eps=LN_EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.forward(x, self.weight, self.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@attrs.frozen
class VisionBatch:
    """What a forward over several images needs besides the pixels: per-patch rotary tables and
    position-embedding taps, and the attention segments (one per image, or per video frame)."""

    cos: torch.Tensor  # [N, head_dim] float32
    sin: torch.Tensor
    taps: torch.Tensor  # [N, 4] int64 rows of pos_embed
    tap_weights: torch.Tensor  # [N, 4] float32
    cu_seqlens: torch.Tensor  # [S + 1] int64
    cu_seqlens_host: list[int]


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        h, self.heads = args.hidden_size, args.num_heads
        self.qkv = BiasLinear(factory, h, 3 * h, dtype, device)
        self.proj = BiasLinear(factory, h, h, dtype, device)
        self.attn = factory.build("vision_attention", VisionAttentionSpec(
            **factory.base, num_heads=args.num_heads, head_dim=args.head_dim, scale=args.head_dim ** -0.5))

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = batch.cos[:, None, :], batch.sin[:, None, :]
        # transformers' order: rotate in float32, cast back (element-wise: each row alone)
        q = ((q.float() * cos) + (rotate_half(q.float()) * sin)).to(x.dtype)
        k = ((k.float() * cos) + (rotate_half(k.float()) * sin)).to(x.dtype)
        o = self.attn.forward(q, k, v.contiguous(), batch.cu_seqlens, batch.cu_seqlens_host)
        return self.proj(o.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        self.norm1 = LayerNorm(factory, args.hidden_size, dtype, device)
        self.norm2 = LayerNorm(factory, args.hidden_size, dtype, device)
        self.attn = VisionAttention(args, factory, dtype, device)
        self.fc1 = BiasLinear(factory, args.hidden_size, args.intermediate_size, dtype, device)
        self.fc2 = BiasLinear(factory, args.intermediate_size, args.hidden_size, dtype, device)
        self.approximate = "tanh" if args.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), batch)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class VisionTower(nn.Module):
    """Pixels ``[N, C*T*P*P]`` (the processor's ``pixel_values``) and each image's ``(t, h, w)``
    patch grid -> one embedding per merged 2x2 patch, ``[N / 4, out_hidden_size]``."""

    def __init__(self, args: VisionArgs, factory: OpFactory, dtype, device) -> None:
        super().__init__()
        self.args, self.dtype, self.device = args, dtype, device
        self.patch_embed = BiasLinear(factory, args.patch_dim, args.hidden_size, dtype, device)
        self.pos_embed = _param(args.num_position_embeddings, args.hidden_size, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(VisionBlock(args, factory, dtype, device) for _ in range(args.depth))
        merged = args.hidden_size * args.merge_unit
        self.merger_norm = LayerNorm(factory, args.hidden_size, dtype, device)
        self.merger_fc1 = BiasLinear(factory, merged, merged, dtype, device)
        self.merger_fc2 = BiasLinear(factory, merged, args.out_hidden_size, dtype, device)
        head = args.head_dim // 2
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, head, 2, dtype=torch.float32) / head))

    def batch(self, grids: list[tuple[int, int, int]]) -> VisionBatch:
        """The host-side index work of a forward over ``grids``, image by image."""
        from transformers.vision_utils import (
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        a, side = self.args, int(self.args.num_position_embeddings ** 0.5)
        cos, sin, taps, weights, cu = [], [], [], [], [0]
        for t, h, w in grids:
            grid = torch.tensor([[t, h, w]])
            pos = get_vision_position_ids(grid, a.spatial_merge_size)  # [t*h*w, 2]: (row, col)
            freqs = pos[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
            emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
            emb = torch.cat([emb, emb], dim=-1)
            cos.append(emb.cos())
            sin.append(emb.sin())
            idx, wts = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=side, mode="bilinear", align_corners=True,
                spatial_merge_size=a.spatial_merge_size)
            taps.append(idx)
            weights.append(wts)
            cu += [cu[-1] + h * w * (i + 1) for i in range(t)]  # each frame its own segment
        dev = self.device
        cu_t = torch.tensor(cu, dtype=torch.int64)
        return VisionBatch(torch.cat(cos).to(dev), torch.cat(sin).to(dev), torch.cat(taps).to(dev),
                           torch.cat(weights).to(dev), cu_t.to(dev), cu)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        batch = self.batch(grids)
        x = self.patch_embed(pixels.to(self.dtype))
        rows = self.pos_embed[batch.taps]  # [N, 4, hidden]
        w = batch.tap_weights.to(self.dtype)
        # the four taps summed in a fixed order (a reduction whose order no batch changes)
        pos = rows[:, 0] * w[:, 0:1] + rows[:, 1] * w[:, 1:2] + rows[:, 2] * w[:, 2:3] + rows[:, 3] * w[:, 3:4]
        x = x + pos
        for block in self.blocks:
            x = block(x, batch)
        x = self.merger_norm(x).view(-1, self.args.hidden_size * self.args.merge_unit)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))


def checkpoint_names(args: VisionArgs) -> dict[str, str]:
    """Our parameter name -> the checkpoint's (``model.visual.`` omitted)."""
    names = {"patch_embed.linear.weight": "patch_embed.proj.weight", "patch_embed.bias": "patch_embed.proj.bias",
             "pos_embed": "pos_embed.weight", "merger_norm.weight": "merger.norm.weight",
             "merger_norm.bias": "merger.norm.bias"}
    for ours, theirs in (("merger_fc1", "merger.linear_fc1"), ("merger_fc2", "merger.linear_fc2")):
        names[f"{ours}.linear.weight"], names[f"{ours}.bias"] = f"{theirs}.weight", f"{theirs}.bias"
    for i in range(args.depth):
        b = f"blocks.{i}."
        for ours, theirs in (("attn.qkv", "attn.qkv"), ("attn.proj", "attn.proj"), ("fc1", "mlp.linear_fc1"),
                             ("fc2", "mlp.linear_fc2")):
            names[f"{b}{ours}.linear.weight"], names[f"{b}{ours}.bias"] = f"{b}{theirs}.weight", f"{b}{theirs}.bias"
        for n in ("norm1", "norm2"):
            names[f"{b}{n}.weight"], names[f"{b}{n}.bias"] = f"{b}{n}.weight", f"{b}{n}.bias"
    return names


@torch.no_grad()
def init_random_vision(tower: VisionTower, seed: int) -> None:
    """Random weights drawn on the tower's device: linears ~ N(0, 1/fan_in), biases and the
    position table small, LayerNorm scales near 1 (activations stay O(1) through the depth)."""
    gen = torch.Generator(device=tower.device)
    gen.manual_seed(seed)
    for name, p in tower.named_parameters():
        noise = torch.randn(p.shape, device=p.device, generator=gen)
        if p.dim() == 2 and name != "pos_embed":
            p.copy_(noise / p.shape[1] ** 0.5)
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
