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
like the token ids (a prompt piece alone, too: the MTP head's catch-up over a lone prompt)."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import numpy as np
import torch

from bi_core.ops.context import ForwardContext, GraphShape, HostBatch
from bi_core.ops.graph_runner import GraphRunnerSpec
from bi_core.runtime.batch import aligned_fields, context_from, gather_ids, upload


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


def mixed_buckets(max_batch: int) -> list[int]:
    """Decode-row buckets of mixed steps: 0 (the chunk alone), then as ``buckets`` up to 16, then
    multiples of 32 (and the largest)."""
    return [0] + [b for b in buckets(max_batch) if b <= 16 or b % 32 == 0 or b == max_batch]


def mixed_sizes(chunk: int) -> list[int]:
    """The prompt-piece sizes mixed graphs are captured at: the chunk, and a quarter of it (a
    piece takes the smallest that holds it). A short prompt padded to a whole chunk took longer
    than running it eagerly (dev/benchmarks-history.md section 21); a piece's real rows do not depend
    on how far it is padded."""
    return sorted({max(1, chunk // 4), chunk}) if chunk else []


LONE_MIN = 128  # the smallest piece size of a lone prompt's graphs (a quarter chunk, if smaller)


def lone_sizes(chunk: int) -> list[int]:
    """The piece sizes of bucket 0's mixed graphs (a prompt piece with no decode rows: a lone
    prompt's prefill, its time to first token): sizes doubling from ``LONE_MIN`` (or a quarter
    chunk) up to the chunk, so a short prompt pads to less than twice its length, not to a quarter
    chunk (measured: dev/benchmarks-history.md section 29)."""
    if not chunk:
        return []
    size, sizes = min(LONE_MIN, max(1, chunk // 4)), []
    while size < chunk:
        sizes.append(size)
        size *= 2
    return [*sizes, chunk]


def _staging(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host tensor shaped like ``like`` (holding its current values), pinned when the device
    copies from it asynchronously."""
    host = like.cpu()
    return host.pin_memory() if pinned else host


def _aligned_fields(sizes: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """``name -> (start, end)`` in one int64 region, each start even (16 bytes)."""
    return dict(zip([name for name, _ in sizes], aligned_fields([n for _, n in sizes])))


class StaticBatch:
    """The static inputs of one graph: int64 device buffers the graph reads, filled per step
    from pinned host staging buffers of the same layout (reused: a step waits for the previous
    step's copy out of them first). The block table is staged row by row: a row is rewritten
    only when its sequence's pages differ from what the row holds, and copied only when a row
    changed (a decode step at 256 sequences no longer converts 256 page lists)."""

    def __init__(self, spec: GraphRunnerSpec, q: int, bucket: int, block_size: int, device: torch.device,
                 chunk: int = 0) -> None:
        self.spec, self.q, self.bucket, self.block_size, self.chunk = spec, q, bucket, block_size, chunk
        self.decode = decode = bucket * q
        t = decode + chunk
        seqs = bucket + (1 if chunk else 0)
        self.num_tokens = t
        # the rows whose logits the graph computes (and samples): every row of a uniform step; the
        # decode rows and one row of the prompt piece of a mixed one (its last real row, or the
        # chunk's last when no prompt row is asked for), an index filled per step
        self.num_logits = t if not chunk else decode + 1
        r = self.num_logits
        # every field starts 16-byte aligned (an even number of int64 before it): Triton compiles a
        # kernel variant per pointer alignment, so odd token counts (bucket 1, a mixed graph's
        # logits rows) compiled every index-reading kernel a second time
        self.fields = _aligned_fields([("input_ids", t), ("positions", t), ("slot_mapping", t),
                                       ("token_state_slots", t), ("sample_keys", r), ("temperatures", r),
                                       ("logits_indices", r), ("context_lens", seqs), ("state_slots", seqs),
                                       ("valid_tokens", seqs)])
        self.region = torch.zeros(max(end for _, end in self.fields.values()), dtype=torch.int64, device=device)
        # a padded prompt piece's padding rows sit past the sequence's pages, up to a chunk past
        # max_model_len: their reads go to the scratch page, inside the table
        width = spec.max_blocks_per_seq + (-(-chunk // block_size) if chunk else 0)
        self.block_tables = torch.full((seqs, width), spec.scratch_page, dtype=torch.int64, device=device)
        ids, pos, slots, token_states, keys, temps, logits, ctx_lens, states, valid = (
            self.region[a:b] for a, b in self.fields.values())
        self.input_ids = ids
        self.views = dict(positions=pos, slot_mapping=slots, token_state_slots=token_states, context_lens=ctx_lens,
                          state_slots=states, sample_keys=keys, temperatures=temps.view(torch.float64),
                          logits_indices=logits, valid_tokens=valid if chunk else None)
        if not chunk:  # every row, never rewritten (a uniform graph reads all rows: logits_all_rows)
            logits.copy_(torch.arange(t, dtype=torch.int64, device=device))
        self.cu_seqlens = torch.tensor(list(range(0, decode + 1, q)) + ([t] if chunk else []), dtype=torch.int64,
                                       device=device)
        self.seq_ids = torch.arange(bucket, dtype=torch.int64, device=device)
        self.shape = GraphShape(q, bucket, chunk)
        self.op_plans: dict = {}  # shared by every step of this graph (ops keep the plans made at capture)
        self.extra: torch.Tensor | None = None  # static per-token input, allocated at capture (``extra_like``)
        self.current: HostBatch | None = None  # the real batch last loaded
        pinned = device.type == "cuda"
        self._stage_region = _staging(self.region, pinned)
        self._stage_table = _staging(self.block_tables, pinned)
        self._table_rows: list[list[int] | None] = [None] * seqs  # the pages each staged row holds
        self._copied = torch.cuda.Event() if pinned else None  # the last copy out of the staging buffers

    def extra_like(self, like: torch.Tensor) -> torch.Tensor:
        """The static per-token input (allocated at first use, shaped like ``like``'s rows)."""
        if self.extra is None:
            self.extra = torch.zeros((self.num_tokens, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return self.extra

    def padded(self, hb: HostBatch | None) -> HostBatch:
        """``hb`` plus padding sequences up to the bucket (all padding when ``hb`` is None): q
        tokens at positions 0..q-1 of the scratch page, the scratch state slot, no logits. In a
        mixed step they go before the prompt piece, which is padded at its end to the graph's size (its
        extra rows: KV on the scratch page, its final state slot, ``valid_tokens`` says how many
        are real); with no batch, a padding chunk (all in the scratch page, from position 0)."""
        q, bs, chunk = self.q, self.block_size, self.chunk
        page, slot = self.spec.scratch_page, self.spec.scratch_slot
        real = hb or HostBatch([], [], [], [], [], [], [], [], [], [], bs, self.spec.state_ring)
        if chunk and hb is None:  # the padding chunk
            real = HostBatch(token_ids=[0] * chunk, positions=list(range(chunk)),
                             slot_mapping=[page * bs + i % bs for i in range(chunk)], token_state_slots=[slot] * chunk,
                             query_lens=[chunk], context_lens=[chunk], state_slots=[slot], blocks=[[page] * -(-chunk // bs)],
                             is_recurrent=[False], logits_rows=[], block_size=bs, ring=self.spec.state_ring)
        head = real.num_seqs - (1 if chunk else 0)  # real decode sequences
        cut, pad = head * q, self.bucket - head
        extra = chunk - real.query_lens[-1] if chunk else 0  # padding rows at the prompt piece's end
        after = real.positions[-1] + 1 if chunk else 0

        def split(values: list, between: list, end: list = ()) -> list:  # decode rows, padding, the prompt, its padding
            return values[:cut] + between + values[cut:] + list(end)

        def per_seq(values: list, between: list) -> list:
            return values[:head] + between + values[head:]

        lens = per_seq(real.query_lens, [q] * pad)
        ctx_lens = per_seq(real.context_lens, [q] * pad)
        blocks = per_seq(real.blocks, [[page]] * pad)
        if chunk:  # the prompt piece: its padding rows' positions read the scratch page
            lens[-1], ctx_lens[-1] = chunk, ctx_lens[-1] + extra
            blocks[-1] = blocks[-1] + [page] * max(0, -(-ctx_lens[-1] // bs) - len(blocks[-1]))
        return HostBatch(
            token_ids=split(real.token_ids, [0] * (pad * q), [0] * extra),
            positions=split(real.positions, list(range(q)) * pad, range(after, after + extra)),
            slot_mapping=split(real.slot_mapping, [page * bs + i for i in range(q)] * pad,
                               [page * bs + i % bs for i in range(extra)]),
            token_state_slots=split(real.token_state_slots, [slot] * (pad * q),
                                    [real.token_state_slots[-1]] * extra if extra else []),
            query_lens=lens, context_lens=ctx_lens, state_slots=per_seq(real.state_slots, [slot] * pad),
            blocks=blocks, is_recurrent=per_seq(real.is_recurrent, [True] * pad),
            logits_rows=self.graph_rows(real, real.logits_rows) if hb else [], block_size=bs, ring=real.ring,
            sample_keys=real.sample_keys, temperatures=real.temperatures,
            valid_tokens=per_seq(real.query_lens, [q] * pad) if chunk else None)

    def logit_pos(self, rows: list[int]) -> list[int]:
        """Where graph rows' logits are among the graph's logits rows (a uniform graph: the same)."""
        if not self.chunk:
            return rows
        return [row if row < self.decode else self.num_logits - 1 for row in rows]

    def load(self, hb: HostBatch | None) -> HostBatch:
        """Copy a (padded) batch into the static buffers; returns the padded batch."""
        p = self.padded(hb)
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again (normally long since)
        region, f = self._stage_region.numpy(), self.fields

        def put(name: str, values) -> None:
            a, b = f[name]
            region[a:b] = values

        put("input_ids", p.token_ids)
        put("positions", p.positions)
        put("slot_mapping", p.slot_mapping)
        put("token_state_slots", p.token_state_slots)
        keys, temps = (region[slice(*f[name])] for name in ("sample_keys", "temperatures"))
        keys[:], temps[:] = 0, 0  # every logits row samples in a graph (padding: greedy, key 0)
        n = min(len(p.logits_rows), len(p.sample_keys))  # rows sampled with a key (none when the caller samples)
        if n:
            at = np.asarray(self.logit_pos(p.logits_rows[:n]))
            keys[at] = p.sample_keys[:n]
            temps.view(np.float64)[at] = p.temperatures[:n]
        if self.chunk:  # the prompt row whose logits the graph computes (the decode rows' are fixed)
            prompt = [row for row in p.logits_rows if row >= self.decode]
            assert len(prompt) <= 1, "a mixed graph computes one logits row of its prompt piece"
            put("logits_indices", list(range(self.decode)) + [prompt[0] if prompt else self.num_tokens - 1])
        put("context_lens", p.context_lens)
        put("state_slots", p.state_slots)
        put("valid_tokens", p.valid_tokens or [0] * len(p.state_slots))
        self.region.copy_(self._stage_region, non_blocking=True)
        table, rows, changed = self._stage_table.numpy(), self._table_rows, False
        for i, pages in enumerate(p.blocks):
            if rows[i] != pages:
                table[i, : len(pages)] = pages
                table[i, len(pages):] = self.spec.scratch_page
                rows[i], changed = list(pages), True
        if changed:
            self.block_tables.copy_(self._stage_table, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return p

    def context(self, p: HostBatch) -> ForwardContext:
        return context_from(p, cu_seqlens=self.cu_seqlens, block_tables=self.block_tables, recurrent_ids=self.seq_ids,
                            graph=self.shape, op_plans=self.op_plans, logits_all_rows=not self.chunk, **self.views)

    def graph_rows(self, hb: HostBatch, rows: list[int]) -> list[int]:
        """Flat rows of the real batch ``hb`` -> rows of the graph (a mixed step's chunk comes
        after the padding)."""
        if not self.chunk:
            return rows
        head = hb.num_seqs - 1
        cut, shift = head * self.q, (self.bucket - head) * self.q
        return [r if r < cut else r + shift for r in rows]

    def outputs(self, outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The graph's static outputs as the real batch (``current``) lays them out: its tokens'
        rows of the per-token output, and the logits rows it asked for (a graph computes more)."""
        hb = self.current
        at = self.logit_pos(self.graph_rows(hb, hb.logits_rows))
        spans = self.shape.spans(hb.num_seqs, hb.query_lens[-1] if self.chunk else None)
        return (_rows(outs[0], spans), *(_rows(o, _runs(at)) for o in outs[1:]))


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of ``rows`` as (start, end) spans."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return [(rows[0], rows[-1] + 1)]  # the usual case (every row of a decode step): one list compare
    spans: list[tuple[int, int]] = []
    for r in rows:
        if spans and spans[-1][1] == r:
            spans[-1] = (spans[-1][0], r + 1)
        else:
            spans.append((r, r + 1))
    return spans


def _rows(t: torch.Tensor, spans: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The rows of ``spans`` of ``t`` along ``dim``: a view for one span, else one concatenation
    (no index upload: a host-to-device copy from pageable memory would wait for the stream)."""
    if len(spans) == 1:
        return t.narrow(dim, spans[0][0], spans[0][1] - spans[0][0])
    if not spans:
        return t.narrow(dim, 0, 0)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans], dim=dim)


class _Captured:
    """A captured CUDA graph and its static outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.outs = graph, outs

    def replay(self, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outs


class _Rerun:
    """Test stand-in for a graph (``capture=False``): reruns the step on the same static buffers
    (with this step's host lists, which the reference backend reads), so bucketing, padding and
    the static context are exercised without CUDA."""

    def __init__(self, fn: Callable[[ForwardContext], tuple[torch.Tensor, ...]]) -> None:
        self.fn = fn
        self.outs: tuple[torch.Tensor, ...] = ()  # the last rerun's outputs (a graph's: its static ones)

    def replay(self, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        check_mirrors(ctx)
        self.outs = self.fn(ctx)
        return self.outs


class _Program:
    """A captured program (``CudaGraphRunnerImpl.program``): its graph, its static outputs, and
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


def _slots_from_positions(ctx: ForwardContext) -> None:
    """Each row's KV slot from its position and its sequence's block table, on the device (a
    one-token graph: row i is sequence i)."""
    bs, pos = ctx.block_size, ctx.positions
    pages = ctx.block_tables.gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)
    torch.add(pages * bs, pos % bs, out=ctx.slot_mapping)


class CudaGraphRunnerImpl:
    def __init__(self, spec: GraphRunnerSpec, *, capture: bool = True) -> None:
        self.spec = spec
        self.capture = capture
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
        key = self.graph_key(hb)
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
        _slots_from_positions(ctx)
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
        _slots_from_positions(ctx)
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
        while ``inputs`` are the tensors it was captured with; the rerun stand-in calls ``body``
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
        positions in place); False in the rerun stand-in, which captures nothing."""
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
        their successors start early as that graph's own do; the rerun stand-in checks the
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
