"""CUDA graphs for uniform steps: every sequence runs the same number L of recurrent tokens
(L = 1: an AR decode step; L = 1 + N: an MTP verify step or MTP head catch-up).

One graph per (L, batch bucket) with buckets 1, 2, 4, 8, then multiples of 16. A step of B
sequences replays the graph of the smallest bucket >= B on static buffers; sequences B..bucket-1
are padding whose KV writes go to a reserved scratch page and whose GDN state is a reserved
scratch slot, so padding never touches a real sequence. Other steps (prefill rows, mixed
lengths, L not captured, more sequences than the largest bucket) run eagerly.
``prepare(ctx)`` (host-side planning, e.g. FlashInfer's) runs before every forward, outside the
graph. ``extra`` is an optional per-token input (the MTP head's main-model hidden states) that
gets a static buffer like the token ids."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bi_core.ops.context import ForwardContext
from bi_core.ops.graph_runner import GraphRunnerSpec


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class _Captured:
    """A captured CUDA graph and its static output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class _Rerun:
    """Test stand-in for a graph (``capture=False``): reruns the step on the same static buffers,
    so bucketing, padding and the static context are exercised without CUDA."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


def check_mirrors(ctx: ForwardContext) -> None:
    """The static context's device tensors (what kernels read) agree with its host lists (what
    host-side planners and the reference backend read)."""
    pairs = {"state_slots": (ctx.state_slots, ctx.state_slots_host),
             "token_state_slots": (ctx.token_state_slots, ctx.token_state_slots_host),
             "context_lens": (ctx.context_lens, ctx.context_lens_host),
             "cu_seqlens_q": (ctx.cu_seqlens_q, ctx.cu_seqlens_host)}
    for name, (tensor, host) in pairs.items():
        assert tensor.tolist() == list(host), f"{name}: device {tensor.tolist()} != host {list(host)}"
    for i, pages in enumerate(ctx.block_tables_host):
        used = -(-ctx.context_lens_host[i] // ctx.block_size)
        device = ctx.block_tables[i, :used].tolist()
        assert device == list(pages[:used]), f"block_tables[{i}]: device {device} != host {pages[:used]}"


class CudaGraphRunnerImpl:
    def __init__(self, spec: GraphRunnerSpec, *, capture: bool = True) -> None:
        self.spec = spec
        self.capture = capture
        self.buckets = buckets(spec.max_batch_size)
        self.max_q_len = max(spec.query_lens)
        self.graphs: dict[tuple[int, int], tuple[_Captured | _Rerun, ForwardContext]] = {}
        self.bufs: dict[str, torch.Tensor] | None = None
        self.pad_offsets: dict[int, torch.Tensor] = {}  # q -> 0..q-1 repeated for every bucket row
        self.pool = None
        self.num_replays: dict[int, int] = {q: 0 for q in spec.query_lens}  # per query length

    def graph_key(self, ctx: ForwardContext) -> tuple[int, int] | None:
        """(L, bucket) if this step can replay a graph, else None."""
        b, lens = ctx.num_seqs, ctx.query_lens_host
        q = lens[0]
        if not (self.spec.use_graphs and b <= self.buckets[-1] and q in self.spec.query_lens):
            return None
        if ctx.state_ring != self.spec.state_ring or any(x != q for x in lens) or not all(ctx.is_recurrent_host):
            return None
        return q, next(x for x in self.buckets if x >= b)

    def run(self, step, input_ids, ctx: ForwardContext, prepare=None, extra: torch.Tensor | None = None):
        key = self.graph_key(ctx)
        if key is None:
            if prepare is not None:
                prepare(ctx)
            return step(input_ids, ctx) if extra is None else step(input_ids, ctx, extra)
        if key not in self.graphs:
            self._record(key, step, ctx, prepare, extra)
        graph, ctx_s = self.graphs[key]
        self._fill(ctx_s, input_ids, ctx, extra, key)
        if prepare is not None:
            prepare(ctx_s)
        out = graph.replay()
        self.num_replays[key[0]] += 1
        return out[: ctx.num_tokens]

    # ------------------------------------------------------------------ static buffers

    def _alloc(self, ctx: ForwardContext, extra: torch.Tensor | None) -> None:
        n, dev = self.buckets[-1], ctx.positions.device
        t = n * self.max_q_len
        self.bufs = {
            "input_ids": torch.zeros(t, dtype=torch.int64, device=dev),
            "positions": torch.zeros(t, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(t, dtype=torch.int64, device=dev),
            "token_state_slots": torch.full((t,), self.spec.scratch_slot, dtype=torch.int64, device=dev),
            "context_lens": torch.ones(n, dtype=torch.int32, device=dev),
            "block_tables": torch.full((n, self.spec.max_blocks_per_seq), self.spec.scratch_page,
                                       dtype=torch.int32, device=dev),
            "state_slots": torch.full((n,), self.spec.scratch_slot, dtype=torch.int64, device=dev),
            "ids": torch.arange(n, dtype=torch.int32, device=dev),
        }
        if extra is not None:
            self.bufs["extra"] = torch.zeros((t, *extra.shape[1:]), dtype=extra.dtype, device=dev)

    def _static_ctx(self, key: tuple[int, int], block_size: int) -> ForwardContext:
        q, bucket = key
        b, t, dev = self.bufs, bucket * q, self.bufs["ids"].device
        scratch = self.spec.scratch_slot
        return ForwardContext(
            positions=b["positions"][:t],
            cu_seqlens_q=torch.arange(0, t + 1, q, dtype=torch.int32, device=dev),
            context_lens=b["context_lens"][:bucket], block_tables=b["block_tables"][:bucket],
            slot_mapping=b["slot_mapping"][:t], state_slots=b["state_slots"][:bucket],
            logits_indices=torch.arange(q - 1, t, q, dtype=torch.int64, device=dev),
            query_lens_host=[q] * bucket, cu_seqlens_host=list(range(0, t + 1, q)),
            context_lens_host=[q] * bucket, state_slots_host=[scratch] * bucket,
            token_state_slots=b["token_state_slots"][:t], token_state_slots_host=[scratch] * t,
            state_ring=self.spec.state_ring, is_recurrent_host=[True] * bucket, recurrent_ids=b["ids"][:bucket],
            block_tables_host=[[self.spec.scratch_page]] * bucket, block_size=block_size,
            extras={"graph_bucket": bucket, "graph_q_len": q})

    def _fill(self, ctx_s: ForwardContext, input_ids, ctx: ForwardContext, extra, key) -> None:
        q, bucket = key
        b, t, buf = ctx.num_seqs, ctx.num_tokens, self.bufs
        buf["input_ids"][:t].copy_(input_ids)
        buf["positions"][:t].copy_(ctx.positions)
        buf["slot_mapping"][:t].copy_(ctx.slot_mapping)
        buf["token_state_slots"][:t].copy_(ctx.token_state_slots)
        buf["context_lens"][:b].copy_(ctx.context_lens)
        buf["state_slots"][:b].copy_(ctx.state_slots)
        buf["block_tables"][:b, : ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if extra is not None:
            buf["extra"][:t].copy_(extra)
        self._pad(b, bucket, q, ctx.block_size)
        pad, scratch = bucket - b, self.spec.scratch_slot
        ctx_s.context_lens_host = ctx.context_lens_host + [q] * pad
        ctx_s.block_tables_host = ctx.block_tables_host + [[self.spec.scratch_page]] * pad
        ctx_s.state_slots_host = ctx.state_slots_host + [scratch] * pad
        ctx_s.token_state_slots_host = ctx.token_state_slots_host + [scratch] * (pad * q)

    def _pad(self, start: int, end: int, q: int, block_size: int) -> None:
        """Sequences [start, end) become padding: q tokens at positions 0..q-1 of the scratch page,
        the scratch state slot."""
        if start >= end:
            return
        buf, page = self.bufs, self.spec.scratch_page
        if q not in self.pad_offsets:
            self.pad_offsets[q] = torch.arange(q, device=buf["ids"].device).repeat(self.buckets[-1])
        offsets = self.pad_offsets[q][: (end - start) * q]
        tokens = slice(start * q, end * q)
        buf["input_ids"][tokens].zero_()  # (a stale ``extra`` row is harmless: its outputs go to scratch)
        buf["positions"][tokens].copy_(offsets)
        torch.add(offsets, page * block_size, out=buf["slot_mapping"][tokens])
        buf["token_state_slots"][tokens].fill_(self.spec.scratch_slot)
        buf["context_lens"][start:end].fill_(q)
        buf["state_slots"][start:end].fill_(self.spec.scratch_slot)
        buf["block_tables"][start:end].fill_(page)

    def _record(self, key, step, ctx: ForwardContext, prepare, extra) -> None:
        q, bucket = key
        assert q <= ctx.block_size, "a padding sequence's tokens must fit in the scratch page"
        if self.bufs is None:
            self._alloc(ctx, extra)
        # The static buffers still hold the last replay's real rows: warm-up and capture must run on
        # padding only, or they would advance real sequences' GDN states.
        self._pad(0, bucket, q, ctx.block_size)
        ctx_s = self._static_ctx(key, ctx.block_size)
        ids = self.bufs["input_ids"][: bucket * q]
        args = (ids, ctx_s) if extra is None else (ids, ctx_s, self.bufs["extra"][: bucket * q])
        if prepare is not None:
            prepare(ctx_s)
        if not self.capture:
            def rerun():
                check_mirrors(ctx_s)
                return step(*args)
            self.graphs[key] = (_Rerun(rerun), ctx_s)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune outside the capture
                step(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(*args)
        self.pool = graph.pool()
        self.graphs[key] = (_Captured(graph, out), ctx_s)
