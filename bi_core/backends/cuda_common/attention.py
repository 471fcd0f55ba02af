"""Attention impls: the batch-invariant Triton paged kernel, and FlashInfer's paged wrappers."""

from __future__ import annotations

import inspect

import torch

from bi_core.backends.reference.attention import write_kv
from bi_core.ops.attention import AttentionSpec
from bi_core.ops.context import ForwardContext

WORKSPACE_BYTES = 128 << 20


class TritonPagedAttentionImpl:
    """One kernel for prefill, decode and mixed steps (see bi_core/kernels/attention.py)."""

    def __init__(self, spec: AttentionSpec) -> None:
        from bi_core.kernels.attention import tokens_per_tile

        self.spec = spec
        self.tile_tokens = tokens_per_tile(spec.num_heads, spec.num_kv_heads)

    def prepare(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Query tiles of the step (a graph's static context keeps the ones made at capture)."""
        from bi_core.kernels.attention import make_tiles

        key = ("attn_tiles", self.tile_tokens)
        if key not in ctx.extras:
            ctx.extras[key] = make_tiles(ctx.query_lens_host, self.tile_tokens, ctx.positions.device)
        return ctx.extras[key]

    def forward(self, q, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
        from bi_core.kernels.attention import paged_attention

        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        tile_seq, tile_start = self.prepare(ctx)
        return paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q,
                               tile_seq, tile_start, self.spec.scale)


class FlashInferAttentionImpl:
    """FlashInfer paged attention with its own split heuristics: the decode wrapper for steps
    where every row is a decode row, the prefill (append) wrapper otherwise. Planned once per step
    and shared by all attention layers of the step."""

    def __init__(self, spec: AttentionSpec) -> None:
        import flashinfer

        self.spec = spec
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        # graph-mode verify steps: every request has the same query length (newer FlashInfer sizes
        # its fa2 query tile from this hint instead of the ragged worst case)
        self._takes_uniform_q_len = "uniform_q_len" in inspect.signature(self.prefill.plan).parameters
        self.graph_wrappers: dict[tuple[int, int], object] = {}  # (q_len, bucket) -> wrapper with fixed buffers

    def _graph_wrapper(self, q_len: int, bucket: int, max_pages: int):
        """Graph-mode wrappers own their index buffers: the decode wrapper for one-token steps,
        the append (prefill) wrapper for uniform multi-token steps (MTP verify)."""
        import flashinfer

        key = (q_len, bucket)
        if key not in self.graph_wrappers:
            dev = self.spec.device
            bufs = dict(workspace=torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
                        indptr=torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
                        indices=torch.zeros(bucket * max_pages, dtype=torch.int32, device=dev),
                        last=torch.zeros(bucket, dtype=torch.int32, device=dev))
            if q_len == 1:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    bufs["workspace"], "NHD", use_cuda_graph=True, use_tensor_cores=True,
                    paged_kv_indptr_buffer=bufs["indptr"], paged_kv_indices_buffer=bufs["indices"],
                    paged_kv_last_page_len_buffer=bufs["last"])
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    bufs["workspace"], "NHD", use_cuda_graph=True,
                    qo_indptr_buf=torch.arange(0, bucket * q_len + 1, q_len, dtype=torch.int32, device=dev),
                    paged_kv_indptr_buf=bufs["indptr"], paged_kv_indices_buf=bufs["indices"],
                    paged_kv_last_page_len_buf=bufs["last"])
            self.graph_wrappers[key] = wrapper
        return self.graph_wrappers[key]

    def prepare(self, ctx: ForwardContext) -> object:
        """Plan the step on the host (once, shared by all layers); graphs re-plan before each replay."""
        key = ("flashinfer", id(self))
        bucket = ctx.extras.get("graph_bucket")
        if key in ctx.extras and bucket is None:
            return ctx.extras[key]
        s, dev = self.spec, ctx.positions.device
        page_size = ctx.block_size
        pages = ctx.block_tables_host
        used = [-(-n // page_size) for n in ctx.context_lens_host]
        indptr = torch.tensor([0] + list(_cumsum(used)), dtype=torch.int32, device=dev)
        indices = torch.tensor([p for blk, n in zip(pages, used) for p in blk[:n]], dtype=torch.int32, device=dev)
        last = torch.tensor([n - (u - 1) * page_size for n, u in zip(ctx.context_lens_host, used)],
                            dtype=torch.int32, device=dev)
        q_len = ctx.extras.get("graph_q_len", 1)
        one_token = q_len == 1 if bucket is not None else all(q == 1 for q in ctx.query_lens_host)
        if bucket is not None:
            wrapper = self._graph_wrapper(q_len, bucket, ctx.block_tables.shape[1])
        else:
            wrapper = self.decode if one_token else self.prefill
        if one_token:
            wrapper.plan(indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_dim, page_size,
                         q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.scale)
        else:
            hint = {"uniform_q_len": q_len} if bucket is not None and self._takes_uniform_q_len else {}
            wrapper.plan(ctx.cu_seqlens_q, indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_dim,
                         page_size, causal=True, sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.dtype,
                         **hint)
        ctx.extras[key] = wrapper
        return wrapper

    def forward(self, q, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        wrapper = ctx.extras.get(("flashinfer", id(self))) or self.prepare(ctx)
        return wrapper.run(q, (k_cache, v_cache))


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total
