"""CUDA graphs for decode steps, one graph per batch-size bucket (1, 2, 4, 8, then multiples of 16).

Every decode step of B rows replays the graph of the smallest bucket >= B on static buffers;
rows B..bucket-1 are padding whose KV write goes to a reserved scratch page and whose GDN state
is a reserved scratch slot, so padding never touches a real sequence. Steps with prefill rows,
or larger than the largest bucket, run eagerly. ``prepare(ctx)`` (host-side planning, e.g.
FlashInfer's) runs before every forward, outside the graph."""

from __future__ import annotations

import torch

from bi_core.ops.context import ForwardContext
from bi_core.ops.graph_runner import GraphRunnerSpec


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class CudaGraphRunnerImpl:
    def __init__(self, spec: GraphRunnerSpec) -> None:
        self.spec = spec
        self.buckets = buckets(spec.max_batch_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardContext]] = {}
        self.bufs: dict[str, torch.Tensor] | None = None
        self.pool = None
        self.num_replays = 0

    def run(self, step, input_ids, ctx: ForwardContext, prepare=None) -> torch.Tensor:
        b = ctx.num_seqs
        decode_only = ctx.num_tokens == b and all(ctx.is_recurrent_host) and ctx.state_ring == self.spec.state_ring
        if not (self.spec.use_graphs and decode_only and b <= self.buckets[-1]):
            if prepare is not None:
                prepare(ctx)
            return step(input_ids, ctx)
        bucket = next(x for x in self.buckets if x >= b)
        if bucket not in self.graphs:
            self._capture(bucket, step, ctx, prepare)
        graph, out, ctx_s = self.graphs[bucket]
        self._fill(ctx_s, input_ids, ctx, bucket)
        if prepare is not None:
            prepare(ctx_s)
        graph.replay()
        self.num_replays += 1
        return out[:b]

    # ------------------------------------------------------------------ static buffers

    def _alloc(self, ctx: ForwardContext) -> None:
        n, dev = self.buckets[-1], ctx.positions.device
        width = self.spec.max_blocks_per_seq
        self.bufs = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "context_lens": torch.ones(n, dtype=torch.int32, device=dev),
            "block_tables": torch.full((n, width), self.spec.scratch_page, dtype=torch.int32, device=dev),
            "slot_mapping": torch.full((n,), self.spec.scratch_page * ctx.block_size, dtype=torch.int64, device=dev),
            "state_slots": torch.full((n,), self.spec.scratch_slot, dtype=torch.int64, device=dev),
            "token_state_slots": torch.full((n,), self.spec.scratch_slot, dtype=torch.int64, device=dev),
            "ids": torch.arange(n, dtype=torch.int32, device=dev),
        }

    def _static_ctx(self, bucket: int, block_size: int) -> ForwardContext:
        b = self.bufs
        return ForwardContext(
            positions=b["positions"][:bucket], cu_seqlens_q=b["cu"][: bucket + 1],
            context_lens=b["context_lens"][:bucket], block_tables=b["block_tables"][:bucket],
            slot_mapping=b["slot_mapping"][:bucket], state_slots=b["state_slots"][:bucket],
            logits_indices=b["ids"][:bucket].long(), query_lens_host=[1] * bucket,
            cu_seqlens_host=list(range(bucket + 1)), context_lens_host=[1] * bucket,
            state_slots_host=[self.spec.scratch_slot] * bucket, token_state_slots=b["token_state_slots"][:bucket],
            token_state_slots_host=[self.spec.scratch_slot] * bucket, state_ring=self.spec.state_ring,
            is_recurrent_host=[True] * bucket,
            recurrent_ids=b["ids"][:bucket], block_tables_host=[[self.spec.scratch_page]] * bucket,
            block_size=block_size, extras={"graph_bucket": bucket})

    def _fill(self, ctx_s: ForwardContext, input_ids, ctx: ForwardContext, bucket: int) -> None:
        b, buf, pad = ctx.num_seqs, self.bufs, bucket - ctx.num_seqs
        buf["input_ids"][:b].copy_(input_ids)
        buf["positions"][:b].copy_(ctx.positions)
        buf["context_lens"][:b].copy_(ctx.context_lens)
        buf["slot_mapping"][:b].copy_(ctx.slot_mapping)
        buf["state_slots"][:b].copy_(ctx.state_slots)
        buf["token_state_slots"][:b].copy_(ctx.token_state_slots)
        width = ctx.block_tables.shape[1]
        buf["block_tables"][:b, :width].copy_(ctx.block_tables)
        self._pad(b, bucket, ctx.block_size)
        ctx_s.context_lens_host = ctx.context_lens_host + [1] * pad
        ctx_s.block_tables_host = ctx.block_tables_host + [[self.spec.scratch_page]] * pad
        ctx_s.state_slots_host = ctx.state_slots_host + [self.spec.scratch_slot] * pad
        ctx_s.token_state_slots_host = ctx.token_state_slots_host + [self.spec.scratch_slot] * pad

    def _pad(self, start: int, end: int, block_size: int) -> None:
        """Rows [start, end) become padding: scratch page, scratch state slot, one-token context."""
        if start >= end:
            return
        buf = self.bufs
        buf["input_ids"][start:end].zero_()
        buf["positions"][start:end].zero_()
        buf["context_lens"][start:end].fill_(1)
        buf["slot_mapping"][start:end].fill_(self.spec.scratch_page * block_size)
        buf["state_slots"][start:end].fill_(self.spec.scratch_slot)
        buf["token_state_slots"][start:end].fill_(self.spec.scratch_slot)
        buf["block_tables"][start:end].fill_(self.spec.scratch_page)

    def _capture(self, bucket: int, step, ctx: ForwardContext, prepare) -> None:
        if self.bufs is None:
            self._alloc(ctx)
        # The static buffers still hold the last replay's real rows: warm-up and capture must run on
        # padding only, or they would advance real sequences' GDN states.
        self._pad(0, bucket, ctx.block_size)
        ctx_s = self._static_ctx(bucket, ctx.block_size)
        ids = self.bufs["input_ids"][:bucket]
        if prepare is not None:
            prepare(ctx_s)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune outside the capture
                step(ids, ctx_s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(ids, ctx_s)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out, ctx_s)
