"""CUDA graphs for uniform steps: every sequence runs the same number L of recurrent tokens
(L = 1: an AR decode step; L = 1 + N: an MTP verify step or MTP head catch-up); and for mixed
steps: one-token decode rows, then one prompt piece of at most the scheduler's chunk size
(``spec.prompt_chunk``), the step a long prompt runs among decoding streams; a prompt's last,
shorter piece is padded at its end to its graph's piece size (its padding rows' KV on the scratch page,
``ForwardContext.valid_tokens`` marks them: GDN zeroes them and keeps the real rows' state).

One graph per (L, batch bucket) with buckets 1, 2, 4, 8, then multiples of 16; one per (1,
bucket, piece size) with buckets 0, 1, 2, 4, 8, 16, then multiples of 32 (a mixed step's cost is
mostly its piece: coarser buckets, fewer graphs) and sizes the chunk and a quarter of it
(``mixed_sizes``: a piece is padded to the smallest that holds it); bucket 0 (a lone prompt's
piece) at sizes doubling up to the chunk (``lone_sizes``). A step of B sequences is packed straight into
the static buffers of the smallest bucket >= B (one transfer of the integer fields, one of the
block table); sequences B..bucket-1 are padding whose KV writes go to a reserved scratch page and
whose GDN state is a reserved scratch slot, so padding never touches a real sequence; in a mixed
step they sit between the real decode rows and the prompt chunk, which keeps its rows at a fixed
offset (``GraphShape.spans``). A uniform graph computes the logits of every row and samples every
row (greedy or plain temperature, keys and temperatures are static inputs too: decode and verify
sample every row); a mixed graph those of the decode rows and of one prompt row (an index filled
per step: the piece's last real row). Other steps (two prompt pieces, mixed lengths, L not
captured, more sequences than the largest bucket) run eagerly. ``prepare(ctx)`` (host-side
planning, e.g. FlashInfer's) runs before every forward, outside the graph. ``extra`` is an
optional per-token input (the MTP head's main-model hidden states) that gets a static buffer
like the token ids (a prompt piece alone, too: the MTP head's catch-up over a lone prompt).

With ``spec.capture`` off (``graph.capture: false``, or ``auto`` off a CUDA device) nothing is
captured: each graph step reruns eagerly on the same static buffers, with the same buckets,
padding and static contexts (``_Rerun``), and ``check_mirrors`` asserts that the device tensors a
graph would read agree with the host lists."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

from bi_core.ops.context import ForwardContext, GraphShape, HostBatch
from bi_core.runtime.batch import gather_ids, upload
from bi_core.runtime.graphs.spec import GraphRunnerSpec
from bi_core.runtime.graphs.static_batch import StaticBatch, buckets, lone_sizes, mixed_buckets, mixed_sizes


class _Captured:
    """A captured CUDA graph and its static outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.outs = graph, outs

    def replay(self, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outs


class _Rerun:
    """A graph in the rerun mode (``spec.capture`` off): reruns the step on the same static buffers
    (with this step's host lists, which the reference backend reads), so bucketing, padding and
    the static context are exercised without capturing (on a CPU too)."""

    def __init__(self, fn: Callable[[ForwardContext], tuple[torch.Tensor, ...]]) -> None:
        self.fn = fn
        self.outs: tuple[torch.Tensor, ...] = ()  # the last rerun's outputs (a graph's: its static ones)

    def replay(self, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        check_mirrors(ctx)
        self.outs = self.fn(ctx)
        return self.outs


class _Program:
    """A captured program (``CudaGraphRunner.program``): its graph, its static outputs, and
    the input tensors its graph reads."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outs: tuple[torch.Tensor, ...],
                 inputs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.outs, self.inputs = graph, outs, inputs

    def reads(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        return len(inputs) == len(self.inputs) and all(a is b for a, b in zip(inputs, self.inputs))


def check_mirrors(ctx: ForwardContext) -> None:
    """The static context's device tensors (what kernels read) agree with its host lists (what
    host-side planners and the reference backend read)."""
    pairs = {"state_slots": (ctx.state_slots, ctx.state_slots_host),
             "token_state_slots": (ctx.token_state_slots, ctx.token_state_slots_host),
             "cu_seqlens_q": (ctx.cu_seqlens_q, ctx.cu_seqlens_host)}
    # a chain moved by a device-side count (``shift``) on a GPU has no host mirror of its lengths
    lens = ctx.context_lens.tolist() if ctx.context_lens_host is None else ctx.context_lens_host
    pairs["context_lens"] = (ctx.context_lens, lens)
    if ctx.valid_tokens is not None:
        pairs["valid_tokens"] = (ctx.valid_tokens, ctx.valid_tokens_host)
    for name, (tensor, host) in pairs.items():
        assert tensor.tolist() == list(host), f"{name}: device {tensor.tolist()} != host {list(host)}"
    for i, pages in enumerate(ctx.block_tables_host):
        used = -(-lens[i] // ctx.block_size)
        device = ctx.block_tables[i, :used].tolist()
        assert device == list(pages[:used]), f"block_tables[{i}]: device {device} != host {pages[:used]}"


def _slots_from_lengths(ctx: ForwardContext) -> None:
    """Each row's KV slot from its index (its sequence's context length - 1) and its sequence's
    block table, on the device (a one-token graph: row i is sequence i). Not from ``positions``:
    an image request's rows sit at rotary positions its images shift (``runtime/batch.py``)."""
    bs, pos = ctx.block_size, ctx.context_lens - 1
    pages = ctx.block_tables.gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)
    torch.add(pages * bs, pos % bs, out=ctx.slot_mapping)


class CudaGraphRunner:
    """Graph steps of one forward (the main model's, or the MTP head's): captured CUDA graphs,
    or their static buffers rerun without capture (``spec.capture`` off)."""

    def __init__(self, spec: GraphRunnerSpec) -> None:
        self.spec = spec
        self.capture = spec.capture
        self.buckets = buckets(spec.max_batch_size)
        self.mixed_buckets = ((mixed_buckets(spec.max_batch_size) if spec.mixed_decode_rows else [0])
                              if spec.prompt_chunk else [])
        self.mixed_sizes = mixed_sizes(spec.prompt_chunk)
        self.lone_sizes = lone_sizes(spec.prompt_chunk)  # bucket 0's
        self.statics: dict[tuple[int, ...], StaticBatch] = {}
        self.graphs: dict[tuple[int, ...], _Captured | _Rerun] = {}
        self.programs: dict[tuple, _Program] = {}  # (name, the keys of the graphs whose buffers it uses)
        self.num_program_runs = 0  # programs replayed (or rerun) so far
        self.pool = None
        self.num_replays: dict[int, int] = {q: 0 for q in spec.query_lens}  # per query length (uniform steps)
        self.mixed_replays = 0  # mixed steps (decode rows + a prompt chunk) replayed
        self.capture_s: dict[tuple[int, ...], float] = {}  # seconds each capture_all capture took (host clock)
        # recorded after a step's host-staged inputs are queued, before it runs (wait_inputs)
        self._inputs = torch.cuda.Event() if spec.device.type == "cuda" else None

    def graph_key(self, hb: HostBatch) -> tuple[int, ...] | None:
        """(L, bucket) if this step can replay a uniform graph, (1, bucket, chunk) a mixed one,
        else None."""
        lens, rec = hb.query_lens, hb.is_recurrent
        if not self.spec.use_graphs or hb.ring != self.spec.state_ring:
            return None
        q = lens[0]
        if all(rec) and q in self.spec.query_lens and all(x == q for x in lens) and hb.num_seqs <= self.buckets[-1]:
            return q, next(x for x in self.buckets if x >= hb.num_seqs)
        chunk, head = self.spec.prompt_chunk, hb.num_seqs - 1
        if (chunk and not rec[-1] and lens[-1] <= chunk and all(rec[:-1]) and all(x == 1 for x in lens[:-1])
                and head <= self.mixed_buckets[-1]):
            bucket = next(x for x in self.mixed_buckets if x >= head)
            size = next(x for x in (self.lone_sizes if bucket == 0 else self.mixed_sizes) if x >= lens[-1])
            return 1, bucket, size
        return None

    def _static(self, key: tuple[int, ...], block_size: int, device: torch.device) -> StaticBatch:
        if key not in self.statics:
            assert key[0] <= block_size, "a padding sequence's tokens must fit in the scratch page"
            self.statics[key] = StaticBatch(self.spec, *key[:2], block_size, device, chunk=key[2] if len(key) > 2 else 0)
        return self.statics[key]

    def make_context(self, hb: HostBatch, device: torch.device) -> tuple[torch.Tensor, ForwardContext]:
        # a step with M-RoPE rows (vision tokens) runs eagerly: its per-frequency positions and
        # vision rows have no static buffers; image requests' other rows are text steps (plan_batch)
        key = None if hb.is_multimodal else self.graph_key(hb)
        if key is None:
            return upload(hb, device)
        static = self._static(key, hb.block_size, device)
        static.current = hb
        ctx = static.context(static.load(hb))
        ctx.logits_indices_host = list(hb.logits_rows)  # the rows the caller wants (a graph computes more)
        ids = static.input_ids if static.chunk else static.input_ids[: len(hb.token_ids)]
        return ids, ctx

    def capture_all(self, step, block_size: int, prepare=None, extra: torch.Tensor | None = None) -> int:
        """Capture every graph now, mixed ones first (the largest steps), then uniform ones by
        bucket, largest first (smaller graphs then reuse the largest one's memory pool), so no
        capture or first-time compile stalls a running batch. ``extra``: an example per-token
        input (its trailing shape and dtype). Returns how many graphs were captured."""
        if not self.spec.use_graphs:
            return 0
        keys = [(1, b, size) for b in self.mixed_buckets for size in (self.lone_sizes if b == 0 else self.mixed_sizes)]
        keys.sort(key=lambda k: (k[2], k[1]), reverse=True)  # by piece size, then bucket: the largest first
        keys += [(q, b) for q in self.spec.query_lens for b in reversed(self.buckets)]
        n = 0
        for key in keys:
            if key in self.graphs:
                continue
            self._static(key, block_size, self.spec.device)
            t0 = time.perf_counter()
            self._record(key, step, prepare, extra)
            self.capture_s[key] = time.perf_counter() - t0
            n += 1
        return n

    def run(self, step, input_ids, ctx: ForwardContext, prepare=None, extra: torch.Tensor | None = None,
            ids_from: torch.Tensor | None = None):
        """``step(input_ids, ctx[, extra])`` returns (per-token output, per-logits-row outputs...)."""
        key = ctx.graph.key if ctx.graph is not None else None
        if key is None:
            if ids_from is not None:
                gather_ids(input_ids, ids_from)
            if prepare is not None:
                prepare(ctx)
            self._mark_inputs()
            return step(input_ids, ctx) if extra is None else step(input_ids, ctx, extra)
        static = self.statics[key]
        # a mixed graph with decode rows takes host token ids and no per-token input; a prompt
        # piece alone (bucket 0: the MTP head's catch-up over it) may take both
        assert not static.chunk or static.bucket == 0 or (ids_from is None and extra is None), \
            "mixed graphs with decode rows: host token ids, no per-token input"
        if key not in self.graphs:
            self._record(key, step, prepare, extra)
            static.load(static.current)  # capture ran on padding: put this step's rows back
        if ids_from is not None:  # the host's packed ids: where every token is staged in order, one copy
            gather_ids(input_ids, ids_from, static.current.token_ids)
        if extra is not None:
            static.extra[: extra.shape[0]].copy_(extra)
        if prepare is not None:
            prepare(ctx)
        self._mark_inputs()
        outs = self.graphs[key].replay(ctx)
        if static.chunk:
            self.mixed_replays += 1
        else:
            self.num_replays[key[0]] += 1
        return static.outputs(outs)

    def advance(self, ctx: ForwardContext) -> ForwardContext | None:
        """The context of the next one-token step of the sequences ``ctx`` (a uniform one-token
        graph's static context, just run) ran: every position, KV slot and context length one
        further, written in place on the device (no host staging, no transfer) and in the host
        mirrors; None for any other context. GDN state slots are not advanced: for a model
        without GDN layers only (the MTP head's draft chain, ``ModelRunner.advance_mtp``). The
        caller writes the next input ids (and per-token input) before ``run``."""
        g = ctx.graph
        if g is None or g.chunk or g.q_len != 1:
            return None
        ctx.positions.add_(1)
        ctx.context_lens.add_(1)
        _slots_from_lengths(ctx)
        host = ctx.context_lens_host
        return attrs.evolve(ctx, context_lens_host=None if host is None else [n + 1 for n in host], step_tensors={})

    def shift(self, ctx: ForwardContext, by: torch.Tensor) -> ForwardContext:
        """The static context of a one-token graph just packed, its first ``len(by)`` sequences
        moved ``by`` positions on (their KV slots and context lengths with them), in place on the
        device: a draft chain that starts where a verify's accept count, still on the device,
        says. The host mirror of the context lengths is then unknown (None) unless reading
        ``by`` costs no wait (a CPU tensor): only for impls that read lengths on the device at
        replay (``ModelRunner.shifts_on_device``); like ``advance``, for a model without GDN
        layers (the MTP head)."""
        g = ctx.graph
        assert g is not None and not g.chunk and g.q_len == 1, "shift: a one-token graph's static context"
        n = by.shape[0]
        ctx.positions[:n].add_(by)
        ctx.context_lens[:n].add_(by)
        _slots_from_lengths(ctx)
        host = None
        if not by.is_cuda:
            host = [c + d for c, d in zip(ctx.context_lens_host, by.tolist())] + ctx.context_lens_host[n:]
        return attrs.evolve(ctx, context_lens_host=host, step_tensors={})

    def whole(self, shape: GraphShape) -> tuple[torch.Tensor, ...] | None:
        """(input ids, *outputs) of the uniform graph of ``shape`` as its last replay left them,
        every row (padding included), at addresses a program can read; None if not captured."""
        assert not shape.chunk, "whole: a uniform graph"
        graph = self.graphs.get(shape.key)
        return None if graph is None else (self.statics[shape.key].input_ids, *graph.outs)

    def static_inputs(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The token ids and the per-token input (None if the graph takes none) of the graph
        whose static context ``ctx`` is, every row: a program's body writes them."""
        static = self.statics[ctx.graph.key]
        return static.input_ids, static.extra

    def program(self, name: str, ctxs: list[ForwardContext], body: Callable[..., tuple[torch.Tensor, ...]],
                inputs: tuple[torch.Tensor, ...], prepare=None, extra: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Device work over the static buffers of uniform graphs and over ``inputs``, as one CUDA
        graph: ``body(ctxs, *inputs)``, ``ctxs`` being those graphs' static contexts as
        ``make_context`` packed this step's batches into them. The body writes their inputs
        (``static_inputs``), runs their steps (``direct``) and may move their positions on the
        device (``shift``, ``advance``). Captured at first use (``capture_program``) and replayed
        while ``inputs`` are the tensors it was captured with; the rerun mode calls ``body``
        on this step's contexts. So the host launches one graph where it launched several and
        the eager kernels between them. ``extra``: as ``capture_all``'s (the graphs' per-token
        inputs are allocated like it)."""
        keys = [c.graph.key for c in ctxs]
        if extra is not None:
            for key in keys:
                self.statics[key].extra_like(extra)
        self.num_program_runs += 1
        if not self.capture:
            return body(ctxs, *inputs)
        prog = self.programs.get((name, *keys))
        if prog is None or not prog.reads(inputs):
            self.capture_program(name, keys, body, inputs, ctxs[0].block_size, prepare, extra)
            for key in keys:  # the capture ran on padding: put this step's rows back
                self.statics[key].load(self.statics[key].current)
            prog = self.programs[(name, *keys)]
        if prepare is not None:
            for ctx in ctxs:
                prepare(ctx)
        prog.graph.replay()
        return prog.outs

    def capture_program(self, name: str, keys: list[tuple[int, ...]], body: Callable[..., tuple[torch.Tensor, ...]],
                        inputs: tuple[torch.Tensor, ...], block_size: int, prepare=None,
                        extra: torch.Tensor | None = None) -> bool:
        """Capture ``program``'s graph on padding rows (its warm-up runs move no real sequence:
        the buffers are loaded with padding again before each run, as the body may move
        positions in place); False in the rerun mode, which captures nothing."""
        if not self.capture:
            return False
        statics = [self._static(key, block_size, self.spec.device) for key in keys]
        if extra is not None:
            for static in statics:
                static.extra_like(extra)

        def padded() -> list[ForwardContext]:
            return [s.context(s.load(None)) for s in statics]

        if prepare is not None:
            for ctx in padded():
                prepare(ctx)
        stream = torch.cuda.Stream()
        for _ in range(2):  # compile and autotune outside the capture
            ctxs = padded()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body(ctxs, *inputs)
            torch.cuda.current_stream().wait_stream(stream)
        ctxs = padded()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = body(ctxs, *inputs)
        self.pool = graph.pool()
        self.programs[(name, *keys)] = _Program(graph, tuple(outs), inputs)
        return True

    def direct(self, step, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        """``step`` over the static buffers of the graph whose context ``ctx`` is (its per-token
        input too, if it has one), inside a program's body: every row's outputs. Its kernels let
        their successors start early as that graph's own do; the rerun mode checks the
        mirrors first, as its replay does."""
        static = self.statics[ctx.graph.key]
        args = (static.input_ids, ctx) if static.extra is None else (static.input_ids, ctx, static.extra)
        if not self.capture:
            check_mirrors(ctx)
            return step(*args)
        from bi_core.kernels.common import PDL_MAX_TOKENS, early_launch  # triton: a CUDA extra

        with early_launch(static.num_tokens <= PDL_MAX_TOKENS):
            return step(*args)

    def _mark_inputs(self) -> None:
        """Record that everything the host staged for this step is queued (``wait_inputs``)."""
        if self._inputs is not None:
            self._inputs.record()

    def wait_inputs(self) -> None:
        if self._inputs is not None:
            self._inputs.synchronize()

    def release(self) -> None:
        self.graphs.clear()
        self.programs.clear()
        self.statics.clear()
        self.pool = None
        self.capture_s.clear()

    def _record(self, key, step, prepare, extra) -> None:
        """Capture the graph of ``key`` on padding rows only (the static buffers hold this step's
        real rows: a warm-up on them would advance real sequences' GDN states)."""
        static = self.statics[key]
        pad_ctx = static.context(static.load(None))
        if extra is not None:
            static.extra_like(extra)

        def call(c: ForwardContext):
            return step(static.input_ids, c) if extra is None else step(static.input_ids, c, static.extra)

        if prepare is not None:
            prepare(pad_ctx)
        if not self.capture:
            self.graphs[key] = _Rerun(call)
            return
        from bi_core.kernels.common import PDL_MAX_TOKENS, early_launch  # triton: a CUDA extra

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with early_launch(static.num_tokens <= PDL_MAX_TOKENS):  # small steps: launch latency matters
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and autotune outside the capture
                    call(pad_ctx)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outs = call(pad_ctx)
        self.pool = graph.pool()
        self.graphs[key] = _Captured(graph, tuple(outs))
