from __future__ import annotations

import torch

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.attention import AttentionBuilder, AttentionSpec
from bi_core.ops.context import ForwardContext


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter this step's keys/values into their cache slots (page * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence, ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


class ReferenceAttentionImpl:
    """Eager attention per sequence, HF's rounding: scores in the model dtype, softmax in fp32."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.group = spec.num_heads // spec.num_kv_heads

    def forward(self, q, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = torch.empty_like(q)
        for i in range(ctx.num_seqs):
            start, end = ctx.token_range(i)
            length, past = ctx.context_lens_host[i], ctx.past_len(i)
            keys = gather_kv(k_cache, ctx.block_tables[i], length).repeat_interleave(self.group, dim=1)
            values = gather_kv(v_cache, ctx.block_tables[i], length).repeat_interleave(self.group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * self.spec.scale
            q_pos = torch.arange(past, length, device=q.device)[:, None]
            k_pos = torch.arange(length, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
        return out


class ReferenceAttentionBuilder(AttentionBuilder):
    def check(self, spec: AttentionSpec, policy) -> list[str]:
        reasons = check_dtype(spec)
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        return reasons

    def build(self, spec: AttentionSpec) -> ReferenceAttentionImpl:
        return ReferenceAttentionImpl(spec)
