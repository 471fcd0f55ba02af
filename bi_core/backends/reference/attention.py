from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.backends.reference.norm import rms_norm_1p
from bi_core.ops.attention import KV_FP8_MAX, AttentionBuilder, AttentionSpec, inv_scale
from bi_core.ops.context import ForwardContext


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its bytes (indexing ops take those on every device), others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Keys or values as the cache stores them: FP8 is times 1 / ``scale`` (``inv_scale``: float32;
    exact at 1), clamped to +-448 and rounded to the nearest e4m3 value (torch's cast rounds to
    nearest even; ops/attention.py's format)."""
    if cache.dtype != torch.float8_e4m3fn:
        return x
    y = x.float() if scale == 1.0 else x.float() * torch.tensor(inv_scale(scale), dtype=torch.float32)
    return y.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(torch.float8_e4m3fn)


def write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Scatter this step's keys/values into their cache slots (page * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for x, cache, scale in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])):
        _bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                                   _bytes(to_cache(x, cache, scale)))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence, ``[length, Hkv, D]``, in ``dtype`` (FP8
    values convert exactly)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = _bytes(cache)[block_table[:num_blocks].long()].flatten(0, 1)[:length]
    return rows.view(cache.dtype).to(dtype)


class Rope:
    """Partial NeoX RoPE on the first ``rotary_dim`` dims; tables in fp32, applied in the model dtype
    (text-only M-RoPE equals 1-D RoPE)."""

    def __init__(self, rotary_dim: int, theta: float, device: torch.device) -> None:
        self.dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, rope_positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_positions`` [T, dim / 2] (M-RoPE: each frequency's own position; the same product
        as the 1-D one where the three axes agree)."""
        if rope_positions is not None:
            freqs = rope_positions.float() * self.inv_freq[None, :]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def split_qkv(qkv: torch.Tensor, spec: AttentionSpec):
    """``[T, 2HqD + 2HkvD]`` -> q ``[T, Hq, D]``, gate ``[T, Hq*D]``, k, v ``[T, Hkv, D]`` (q_proj rows are
    per-head [query | gate])."""
    t, hq, hkv, d = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    qg = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k = qkv[:, 2 * hq * d : 2 * hq * d + hkv * d].view(t, hkv, d)
    v = qkv[:, 2 * hq * d + hkv * d :].view(t, hkv, d)
    return q, gate, k, v


class ReferenceAttentionImpl:
    """Transformers' order: q/k norm, RoPE, then eager attention per sequence (scores in the model
    dtype, softmax in fp32), then ``o * sigmoid(gate)``."""

    decode_query_len = None  # one code path for every query length

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.group = spec.num_heads // spec.num_kv_heads
        self.rope = Rope(spec.rotary_dim, spec.rope_theta, spec.device)

    def forward(self, qkv, q_norm, k_norm, k_cache, v_cache, ctx: ForwardContext,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """``kv_scales``: an FP8 cache's (k_scale, v_scale): the cache holds k / k_scale and
        v / v_scale; k_scale folds into the softmax scale, v_scale multiplies the gated output."""
        s = self.spec
        k_scale, v_scale = kv_scales
        q, gate, k, v = split_qkv(qkv, s)
        q, k = rms_norm_1p(q.contiguous(), q_norm, s.norm_eps), rms_norm_1p(k.contiguous(), k_norm, s.norm_eps)
        cos, sin = self.rope.cos_sin(ctx.positions, qkv.dtype, ctx.rope_positions)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        write_kv(k, v.contiguous(), k_cache, v_cache, ctx.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        for i in range(ctx.num_seqs):
            start, end = ctx.token_range(i)
            length, past = ctx.context_lens_host[i], ctx.past_len(i)
            keys = gather_kv(k_cache, ctx.block_tables[i], length, q.dtype).repeat_interleave(self.group, dim=1)
            values = gather_kv(v_cache, ctx.block_tables[i], length, q.dtype).repeat_interleave(self.group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * (s.scale * k_scale)
            q_pos = torch.arange(past, length, device=q.device)[:, None]
            k_pos = torch.arange(length, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
        out = out.reshape(out.shape[0], -1) * torch.sigmoid(gate)
        return out if v_scale == 1.0 else out * v_scale


class ReferenceAttentionBuilder(AttentionBuilder):
    def check(self, spec: AttentionSpec, policy) -> list[str]:
        reasons = check_dtype(spec)
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        return reasons

    def build(self, spec: AttentionSpec) -> ReferenceAttentionImpl:
        return ReferenceAttentionImpl(spec)
