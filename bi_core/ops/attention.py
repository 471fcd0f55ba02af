"""Qwen3.5 gated attention over a paged KV cache, from the qkv projection to the o_proj input:
q/k zero-centred RMSNorm per head, partial RoPE, the KV-cache write, causal GQA attention
(prefill, decode and verify rows mixed), and the sigmoid output gate."""

from __future__ import annotations

import functools
from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec
from bi_core.ops.context import ForwardContext

# cache.kv_cache_dtype -> the KV cache's element type (None: the model dtype). FP8 (e4m3): each key
# and value element stored as float8_e4m3fn at a fixed scale of 1: clamped to +-448, rounded to the
# nearest e4m3 value (ties to even), read back exactly (e4m3 values are bf16 values). A fixed scale
# depends on no batch, so an FP8 cache stays batch-invariant; 1 is vLLM's scale when a checkpoint
# brings no k/v scales. A checkpoint's calibrated ones (compressed-tensors' kv_cache_scheme, one
# per layer for keys and one for values; AttentionSpec.kv_scales): keys and values are multiplied
# by 1 / scale in float32 before that rounding; a read folds k_scale into the softmax scale and
# multiplies the gated output by v_scale (exact at scale 1: the bits of the unscaled cache).
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
KV_FP8_MAX = 448.0


@functools.cache  # on every attention forward (eager steps are host-bound): a layer's scales are fixed
def inv_scale(scale: float) -> float:
    """1 / a k or v scale as the cache writes use it: rounded once to float32 (every impl multiplies
    float32 keys and values by this same number; exactly 1 for scale 1)."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def kv_cache_dtype_name(value: str) -> str:
    """The config's value in its one spelling (``fp8`` is ``fp8_e4m3``, as in vLLM)."""
    return "fp8_e4m3" if value == "fp8" else value


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES[name] or model_dtype


@attrs.frozen(kw_only=True)
class AttentionSpec(OpSpec):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary_dim: int  # NeoX RoPE on the first rotary_dim dims of q and k
    rope_theta: float
    norm_eps: float  # q_norm / k_norm
    kv_cache_dtype: str = "auto"  # a key of KV_CACHE_DTYPES: the caches the impl reads and writes
    # an FP8 cache at a checkpoint's calibrated scales: forward gets kv_scales=(k_scale, v_scale), stores
    # x / scale (x * (1 / scale) in float32, then as at scale 1) and reads stored * scale
    kv_scales: bool = False


class AttentionImpl(Protocol):
    # The most query tokens per sequence that a recurrent (decode-form) sequence may have for its
    # rows to get the arithmetic of one-token decode steps (longer ones may take a prefill path);
    # None: any length. Exact scoring steps its continuations by this much.
    decode_query_len: int | None
    # Optional (default False): prompt rows can run inside a captured CUDA graph, i.e. nothing the
    # impl plans on the host depends on more than the step's shape (graph.mixed)
    graph_prompt_rows: bool

    def forward(
        self,
        qkv: torch.Tensor,  # [T, 2*Hq*D + 2*Hkv*D]: per head [query | gate], then keys, then values
        q_norm: torch.Tensor,  # [D] zero-centred RMSNorm weights (scale - 1)
        k_norm: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], kv_cache_torch_dtype(spec's, dtype)
        v_cache: torch.Tensor,
        ctx: ForwardContext,
        # kv_scales=(k_scale, v_scale): passed only when the spec's kv_scales is set (an impl that
        # serves it takes the keyword; its builder refuses such a spec otherwise)
    ) -> torch.Tensor:  # [T, Hq*D]: attention output times sigmoid(gate)
        """Normalise and rotate q and k, write k/v at ``ctx.slot_mapping``, attend causally over
        each sequence, apply the output gate."""


class AttentionBuilder(OpBuilder[AttentionSpec]):
    op = "attention"
