"""Attention impls: the batch-invariant Triton paged kernel, and FlashInfer's paged wrappers."""

from __future__ import annotations

import inspect

import attrs
import torch

from bi_core.ops.attention import AttentionSpec, inv_scale
from bi_core.ops.context import ForwardContext

WORKSPACE_BYTES = 128 << 20


def _inv_freq(spec: AttentionSpec) -> torch.Tensor:
    dim = spec.rotary_dim
    return 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=spec.device) / dim))


def _qk_norm_rope(spec: AttentionSpec, inv_freq, qkv, q_norm, k_norm, k_cache, v_cache, ctx,
                  kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    from bi_core.kernels.qk_norm_rope import qk_norm_rope_write

    scales = tuple(inv_scale(x) for x in kv_scales)
    if ctx.rope_positions is not None:  # a step with images: M-RoPE
        from bi_core.kernels.mrope import qk_norm_mrope_write

        return qk_norm_mrope_write(qkv, q_norm, k_norm, inv_freq, ctx.rope_positions, ctx.slot_mapping, k_cache,
                                   v_cache, spec.num_heads, spec.norm_eps, spec.rotary_dim, scales)
    return qk_norm_rope_write(qkv, q_norm, k_norm, inv_freq, ctx.positions, ctx.slot_mapping, k_cache, v_cache,
                              spec.num_heads, spec.norm_eps, spec.rotary_dim, scales)


@attrs.frozen
class _TritonPlan:
    dec_seqs: torch.Tensor  # sequences in decode form (recurrent, at most a tile of query tokens)
    max_q: int
    splits: int  # programs per decode sequence and KV head (scheduling only: any value gives the same bits)
    tile_seq: torch.Tensor  # prefill tiles
    tile_start: torch.Tensor
    chunks: int  # KV chunks the decode sequences read: sizes the workspace (eager steps)


EXACT_DECODE_ROWS = 64  # MMA rows a decode-form step keeps one-token decode's bits up to (split kernel on 2 warps)


def exact_decode_tokens(group: int, tile_tokens: int) -> int:
    """The most query tokens a decode-form step runs with one-token decode's bits: a power of two
    whose tile (``decode_rows``) has at most EXACT_DECODE_ROWS rows, a power of two itself (a group
    of 6 heads, as 27B's, stops at 2 tokens: 4 would need 24 rows)."""
    from bi_core.kernels.attention import decode_rows

    def fits(q: int) -> bool:
        rows = decode_rows(q, group)
        return q <= tile_tokens and rows <= EXACT_DECODE_ROWS and rows & (rows - 1) == 0

    q = 1
    while fits(2 * q):
        q *= 2
    return q


CHUNKS_PER_PROGRAM = 4  # KV chunks a decode program folds in series at most
# decode programs that keep an H100/H200 (132 SMs) streaming KV: four per SM, as many as the split
# kernel's registers let an SM hold (2 warps). Two per SM left loads unissued: at batch 1 and long
# contexts the split kernel was slower (dev/benchmarks-history.md)
PROGRAMS_WANTED = 528


class TritonPagedAttentionImpl:
    """The fused per-token kernel (q/k norm, RoPE, KV write), then the fixed-split paged attention
    of ``kernels/attention.py``: decode/verify sequences through split programs and an ordered
    merge, prefill tiles in one program each; both end in the output gate."""

    graph_prompt_rows = True  # its plan depends on the step's shape only: mixed steps replay from graphs

    def __init__(self, spec: AttentionSpec) -> None:
        from bi_core.kernels.attention import prefill_tile_tokens, tokens_per_tile

        self.spec = spec
        self.tile_tokens = tokens_per_tile(spec.num_heads, spec.num_kv_heads)  # decode form: up to this many
        self.prefill_tokens = prefill_tile_tokens(spec.num_heads, spec.num_kv_heads)  # query tokens per prompt tile
        # Recurrent queries up to a tile run in decode form, and up to EXACT_DECODE_ROWS MMA rows
        # (tokens x query heads per KV head) they get the bits of one-token decode rows. With the
        # split kernel on 4 warps (a warpgroup MMA) 64-row steps differed from decode, so the limit
        # was 32; on 2 warps 64 rows hold (dev/benchmarks-history.md): 8 tokens on 35B-A3B, 4 on
        # 122B-A10B / 397B-A17B (MTP verifies 3 drafts there).
        self.decode_query_len = exact_decode_tokens(spec.num_heads // spec.num_kv_heads, self.tile_tokens)
        self.inv_freq = _inv_freq(spec)

    def prepare(self, ctx: ForwardContext) -> _TritonPlan:
        """Which sequences run in decode form, and the prefill tiles (a graph's static context
        keeps the plan made at capture: every sequence decodes)."""
        from bi_core.kernels.attention import KV_SPLIT, make_tiles

        key = ("attn_plan", self.tile_tokens)
        if key not in ctx.op_plans:
            dev, lens = ctx.positions.device, ctx.query_lens_host
            dec = [i for i, q in enumerate(lens) if ctx.is_recurrent_host[i] and q <= self.tile_tokens]
            pre = sorted(set(range(len(lens))) - set(dec))
            dec_seqs = ctx.recurrent_ids if len(dec) == len(lens) else torch.tensor(dec, dtype=torch.int64, device=dev)
            # programs per (sequence, KV head): enough to fill the GPU, and enough that none folds
            # more than CHUNKS_PER_PROGRAM chunks in series at the longest context the plan serves
            # (a graph's: its block table's width; dev/benchmarks-history.md). The split count
            # changes no bit (chunks merge in order)
            longest = (ctx.block_tables.shape[1] * ctx.block_size if ctx.graph is not None
                       else max((ctx.context_lens_host[i] for i in dec), default=1))
            # No cap but the chunk count: at 131k tokens a cap of 64 left B=1 with 128 programs
            # folding 8 chunks each, far behind the default backend's step (dev/benchmarks-history.md)
            splits = max(-(-PROGRAMS_WANTED // max(1, len(dec) * self.spec.num_kv_heads)),
                         -(-longest // (KV_SPLIT * CHUNKS_PER_PROGRAM)))
            splits = max(1, min(-(-longest // KV_SPLIT), splits))
            tile_seq, tile_start = make_tiles(lens, pre, self.prefill_tokens, dev)
            chunks = sum(-(-ctx.context_lens_host[i] // KV_SPLIT) for i in dec)
            ctx.op_plans[key] = _TritonPlan(dec_seqs, max((lens[i] for i in dec), default=1), splits, tile_seq,
                                          tile_start, chunks)
        return ctx.op_plans[key]

    def forward(self, qkv, q_norm, k_norm, k_cache, v_cache, ctx: ForwardContext,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """``kv_scales``: an FP8 cache's (k_scale, v_scale) (AttentionSpec.kv_scales): k_scale folds
        into the softmax scale, v_scale multiplies the gated output; (1, 1) is the unscaled path."""
        from bi_core.kernels.attention import KV_SPLIT, decode_attention, prefill_attention

        s = self.spec
        k_scale, v_scale = kv_scales
        scale = s.scale * k_scale  # the scores of stored keys, times k_scale: those of the keys
        q = _qk_norm_rope(s, self.inv_freq, qkv, q_norm, k_norm, k_cache, v_cache, ctx, kv_scales)
        out = torch.empty((qkv.shape[0], s.num_heads * s.head_dim), dtype=qkv.dtype, device=qkv.device)
        gate = qkv[:, s.head_dim:]  # head h's gate at columns h*2D + D (q_proj's [query | gate] layout)
        plan = self.prepare(ctx)
        args = (q, k_cache, v_cache, gate, out, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():  # replays see other lengths: all at their longest
            chunks = plan.dec_seqs.shape[0] * -(-ctx.block_tables.shape[1] * k_cache.shape[1] // KV_SPLIT)
        else:
            chunks = plan.chunks
        decode_attention(*args, plan.dec_seqs, scale, plan.max_q, plan.splits, chunks)
        prefill_attention(*args, plan.tile_seq, plan.tile_start, scale)
        if v_scale != 1.0:  # the output of stored values, times v_scale: that of the values
            out.mul_(v_scale)
        return out


class FlashInferAttentionImpl:
    """FlashInfer paged attention with its own split heuristics: the decode wrapper for steps
    where every row is a decode row, the prefill (append) wrapper otherwise. Planned once per step
    and shared by all attention layers of the step."""

    decode_query_len = None  # not bitwise with decode steps at any length (its own split heuristics)
    graph_prompt_rows = False  # the prefill wrapper plans from the step's pages on the host (no mixed graphs)
    plans_from_host_lengths = True  # every replay re-plans from ctx.context_lens_host

    def __init__(self, spec: AttentionSpec) -> None:
        import flashinfer

        self.spec = spec
        self.inv_freq = _inv_freq(spec)
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
        bucket = ctx.graph.bucket if ctx.graph is not None else None
        if key in ctx.op_plans and bucket is None:
            return ctx.op_plans[key]
        s, dev = self.spec, ctx.positions.device
        page_size = ctx.block_size
        pages = ctx.block_tables_host
        used = [-(-n // page_size) for n in ctx.context_lens_host]
        # FlashInfer plans on the host: indptr and last-page lengths go in as pinned host tensors
        # (device ones it reads back, waiting for the step in flight: no overlapped decode), the
        # page indices to the device without a wait (its copy of host indices is synchronous)
        indptr = _pinned([0] + list(_cumsum(used)))
        indices = _pinned([p for blk, n in zip(pages, used) for p in blk[:n]]).to(dev, non_blocking=True)
        last = _pinned([n - (u - 1) * page_size for n, u in zip(ctx.context_lens_host, used)])
        q_len = ctx.graph.q_len if ctx.graph is not None else 1
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
            qo_indptr = _pinned(ctx.cu_seqlens_host)
            wrapper.plan(qo_indptr, indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_dim,
                         page_size, causal=True, sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.dtype,
                         **hint)
        ctx.op_plans[key] = wrapper
        return wrapper

    def forward(self, qkv, q_norm, k_norm, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
        from bi_core.kernels.qk_norm_rope import apply_gate

        q = _qk_norm_rope(self.spec, self.inv_freq, qkv, q_norm, k_norm, k_cache, v_cache, ctx)
        wrapper = ctx.op_plans.get(("flashinfer", id(self))) or self.prepare(ctx)
        return apply_gate(wrapper.run(q, (k_cache, v_cache)), qkv[:, self.spec.head_dim:])


def _pinned(values) -> torch.Tensor:
    """An int32 host tensor in pinned memory (its asynchronous copies need no wait)."""
    return torch.tensor(values, dtype=torch.int32).pin_memory()


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total
