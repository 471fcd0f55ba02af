"""The static inputs of CUDA graphs: the batch buckets and prompt-piece sizes graphs are captured
at, and ``StaticBatch``, one graph's device buffers, into which a step of B sequences is packed
padded to its bucket (padding rows' KV on the scratch page, their GDN state in the scratch slot,
so padding never reaches a real sequence's rows)."""

from __future__ import annotations

import numpy as np
import torch

from bi_core.ops.context import ForwardContext, GraphShape, HostBatch
from bi_core.runtime.batch import aligned_fields, context_from
from bi_core.runtime.graphs.spec import GraphRunnerSpec


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
    than running it eagerly (dev/benchmarks-history.md); a piece's real rows do not depend on how
    far it is padded."""
    return sorted({max(1, chunk // 4), chunk}) if chunk else []


LONE_MIN = 128  # the smallest piece size of a lone prompt's graphs (a quarter chunk, if smaller)


def lone_sizes(chunk: int) -> list[int]:
    """The piece sizes of bucket 0's mixed graphs (a prompt piece with no decode rows: a lone
    prompt's prefill, its time to first token): sizes doubling from ``LONE_MIN`` (or a quarter
    chunk) up to the chunk, so a short prompt pads to less than twice its length, not to a quarter
    chunk: a lone prompt's padding is its time to first token (dev/benchmarks-history.md)."""
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
                                       ("valid_tokens", seqs), ("lora_slots", t)])
        self.region = torch.zeros(max(end for _, end in self.fields.values()), dtype=torch.int64, device=device)
        # a padded prompt piece's padding rows sit past the sequence's pages, up to a chunk past
        # max_model_len: their reads go to the scratch page, inside the table
        width = spec.max_blocks_per_seq + (-(-chunk // block_size) if chunk else 0)
        self.block_tables = torch.full((seqs, width), spec.scratch_page, dtype=torch.int64, device=device)
        ids, pos, slots, token_states, keys, temps, logits, ctx_lens, states, valid, lora = (
            self.region[a:b] for a, b in self.fields.values())
        self.input_ids = ids
        self.views = dict(positions=pos, slot_mapping=slots, token_state_slots=token_states, context_lens=ctx_lens,
                          state_slots=states, sample_keys=keys, temperatures=temps.view(torch.float64),
                          logits_indices=logits, valid_tokens=valid if chunk else None,
                          lora_slots=lora if spec.lora else None)
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
            valid_tokens=per_seq(real.query_lens, [q] * pad) if chunk else None,
            lora_slots=split(real.lora_slots, [-1] * (pad * q), [-1] * extra) if real.lora_slots else [])

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
        put("lora_slots", p.lora_slots or [-1] * self.num_tokens)  # padding rows: no adapter
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
