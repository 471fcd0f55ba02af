"""Turns the scheduled sequences of a step into model inputs and a ForwardContext.

``plan_batch`` computes everything on the host (plain lists); ``upload`` packs the integer fields
into one pinned host tensor and copies it to the device in one transfer, either into fresh
tensors (eager steps) or into a CUDA graph's static buffers, padded to the graph's bucket (see
``runtime/graphs/static_batch.py``)."""

from __future__ import annotations

import torch

from bi_core.ops.context import ForwardContext, GraphShape, HostBatch


def plan_batch(
    token_ids: list[list[int]],  # per sequence, the tokens this step processes
    past_lens: list[int],  # per sequence, tokens already in the cache
    blocks: list[list[int]],
    state_slots: list[int],  # per sequence, its GDN state slot (the base of its ring)
    is_recurrent: list[bool],
    *,
    block_size: int,
    ring: int = 1,
    logits_rows: list[list[int]] | None = None,
    sample_keys: list[int] | None = None,
    temperatures: list[float] | None = None,
    lora_slots: list[int] | None = None,
    mm: list | None = None,
    mrope_axes: list[int] | None = None,
    embed_shift: int = 0,
) -> HostBatch:
    """``logits_rows[i]``: rows of sequence i (offsets into its tokens) whose logits are needed;
    default its last row. ``sample_keys`` / ``temperatures`` (one per logits row, flat): the step
    also samples those rows on the device (greedy or plain temperature). ``ring`` > 1 (speculative decoding): a sequence owns ``ring``
    consecutive state slots; at past length L it reads slot ``L % ring`` and the state after its
    t-th new token goes to slot ``(L + t + 1) % ring``, so rejecting drafts is just a shorter
    length, never a copy. ``lora_slots``: per sequence, its adapter's slot (-1 none), given to
    each of its rows (an engine serving adapters passes it always, so the field is never absent).
    ``mm``: per sequence its MultimodalPrompt or None (runtime/multimodal.py);
    a step with one gets M-RoPE positions (read through ``mrope_axes``) and the vision embedding
    rows; ``embed_shift`` 1: row r takes the embedding of the token after position r (the MTP
    head's rows pair a position with the next token). A step whose image rows need no embedding
    and whose three axes agree on every row (decode, MTP verify and head rows past the prompt:
    ``p + delta`` on each axis, as transformers' incremental positions) is a text step at those
    positions: ``positions`` are then the shifted 1-D ones (the same rotary bits:
    ``kernels/mrope.py``), and the step takes the graphed path."""
    flat, positions, slots, token_states, rows = [], [], [], [], []
    offset = 0
    for i, (ids, past, blk, base) in enumerate(zip(token_ids, past_lens, blocks, state_slots)):
        flat += ids
        n = len(ids)
        end = past + n
        positions += range(past, end)
        pos = past  # the KV slots a page at a time (a prefill's 8,192 tokens: one range per page, not per token)
        while pos < end:
            page, off = divmod(pos, block_size)
            take = min(block_size - off, end - pos)
            first = blk[page] * block_size + off
            slots += range(first, first + take)
            pos += take
        # the state after the token at position p goes to slot (p + 1) % ring of the sequence's ring
        token_states += [base] * n if ring == 1 else [base * ring + (p + 1) % ring for p in range(past, end)]
        if logits_rows is None:
            rows.append(offset + n - 1)
        else:
            rows += [offset + r for r in logits_rows[i]]
        offset += n
    query_lens = [len(t) for t in token_ids]
    extra = {} if mm is None or all(m is None for m in mm) else _multimodal(token_ids, past_lens, mm, embed_shift)
    if "flat" in extra:  # every row's axes agree: the 1-D rotary at those positions
        positions = extra.pop("flat")
    elif extra:
        extra["mrope_axes"] = list(mrope_axes)
    return HostBatch(
        token_ids=flat, positions=positions, slot_mapping=slots, token_state_slots=token_states,
        query_lens=query_lens, context_lens=[p + q for p, q in zip(past_lens, query_lens)],
        state_slots=[base * ring + past % ring for base, past in zip(state_slots, past_lens)],
        blocks=[list(b) for b in blocks], is_recurrent=list(is_recurrent), logits_rows=rows,
        block_size=block_size, ring=ring, sample_keys=list(sample_keys or []), temperatures=list(temperatures or []),
        lora_slots=[s for s, n in zip(lora_slots, query_lens) for _ in range(n)] if lora_slots is not None else [],
        **extra)


def _multimodal(token_ids: list[list[int]], past_lens: list[int], mm: list, shift: int) -> dict:
    """A step's M-RoPE positions ``[3][T]`` and its vision embedding rows and values; or, where
    no row takes an embedding and the three axes agree on every row, ``flat``: those positions."""
    rope: list[list[int]] = [[], [], []]
    rows, embeds, offset = [], [], 0
    for ids, past, m in zip(token_ids, past_lens, mm):
        n = len(ids)
        if m is None:
            for axis in rope:
                axis += range(past, past + n)
        else:
            for axis, part in zip(rope, m.positions(past, past + n)):
                axis += part
            index = m.embed_index
            picked = [(offset + k, index[p]) for k, p in enumerate(range(past + shift, min(past + n + shift, len(index))))
                      if index[p] >= 0]
            if picked:
                assert m.embeds is not None, "vision embeddings are computed before a step that needs them"
                rows += [r for r, _ in picked]
                embeds.append(m.embeds[torch.tensor([i for _, i in picked], device=m.embeds.device)])
        offset += n
    if not rows and rope[0] == rope[1] == rope[2]:
        return {"flat": rope[0]}
    return {"rope_positions": rope, "embed_rows": rows, "embeds": embeds}


def float_bits(values: list[float]) -> list[int]:
    """float64 bit patterns as int64s, so floats travel in the same int64 transfer."""
    return torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """One host-to-device copy of an int64 list (pinned and asynchronous on CUDA)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def context_from(hb: HostBatch, *, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                 state_slots: torch.Tensor, logits_indices: torch.Tensor, token_state_slots: torch.Tensor,
                 recurrent_ids: torch.Tensor, graph: GraphShape | None = None, op_plans: dict | None = None,
                 logits_all_rows: bool = False,
                 sample_keys: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
                 valid_tokens: torch.Tensor | None = None, lora_slots: torch.Tensor | None = None) -> ForwardContext:
    """A ForwardContext over device tensors (fresh or static views) and the host lists of ``hb``."""
    return ForwardContext(
        positions=positions, cu_seqlens_q=cu_seqlens, context_lens=context_lens, block_tables=block_tables,
        slot_mapping=slot_mapping, state_slots=state_slots, logits_indices=logits_indices,
        query_lens_host=list(hb.query_lens), cu_seqlens_host=hb.cu_seqlens, context_lens_host=list(hb.context_lens),
        state_slots_host=list(hb.state_slots), token_state_slots=token_state_slots,
        token_state_slots_host=list(hb.token_state_slots), state_ring=hb.ring,
        is_recurrent_host=list(hb.is_recurrent), recurrent_ids=recurrent_ids,
        block_tables_host=hb.blocks, block_size=hb.block_size,
        logits_indices_host=list(hb.logits_rows), logits_all_rows=logits_all_rows, sample_keys=sample_keys,
        temperatures=temperatures, graph=graph, op_plans=op_plans if op_plans is not None else {},
        valid_tokens=valid_tokens, valid_tokens_host=list(hb.valid_tokens) if hb.valid_tokens is not None else None,
        lora_slots=lora_slots)


def aligned_fields(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of int64 fields of ``sizes`` laid end to end in one region, each start even
    (16-byte aligned: Triton compiles a kernel variant per pointer alignment). Eager steps
    (``upload``) and graphs' static buffers share it."""
    spans, at = [], 0
    for n in sizes:
        spans.append((at, at + n))
        at += n + n % 2
    return spans


def upload(hb: HostBatch, device: torch.device) -> tuple[torch.Tensor, ForwardContext]:
    """An eager step's inputs: every integer field in one transfer, then views. Triton compiles a
    kernel variant per pointer alignment (16 bytes or not) and per integer argument class (1,
    divisible by 16, other): so every view starts 16-byte aligned and the block table's row
    stride is a multiple of 16, whatever the step's lengths (otherwise eager steps compiled new
    variants mid-run: benchmarks/throughput_steps.py)."""
    max_blocks = -(-max(len(b) for b in hb.blocks) // 16) * 16
    table = [x for b in hb.blocks for x in b + [-1] * (max_blocks - len(b))]
    recurrent = [i for i, r in enumerate(hb.is_recurrent) if r]
    fields = [hb.token_ids, hb.positions, hb.cu_seqlens, hb.context_lens, table, hb.slot_mapping, hb.state_slots,
              hb.logits_rows, recurrent, hb.token_state_slots, hb.sample_keys, float_bits(hb.temperatures),
              hb.lora_slots]
    spans = aligned_fields([len(f) for f in fields])
    flat = [0] * spans[-1][1]
    for f, (a, b) in zip(fields, spans):
        flat[a:b] = f
    region = to_device(flat, device)
    parts = [region[a:b] for a, b in spans]
    ids, pos, cu, ctx_lens, table_t, slots, states, logits, rec, token_states, keys, temps, lora = parts
    sampling = {"sample_keys": keys, "temperatures": temps.view(torch.float64)} if hb.sample_keys else {}
    if hb.lora_slots:
        sampling["lora_slots"] = lora
    ctx = context_from(hb, positions=pos, cu_seqlens=cu, context_lens=ctx_lens,
                       block_tables=table_t.view(hb.num_seqs, max_blocks), slot_mapping=slots, state_slots=states,
                       logits_indices=logits, token_state_slots=token_states, recurrent_ids=rec, **sampling)
    if hb.is_multimodal:
        add_multimodal(ctx, hb, device)
    return ids, ctx


def add_multimodal(ctx: ForwardContext, hb: HostBatch, device: torch.device) -> None:
    """A step with images: each token's position per rotary frequency ``[T, rotary_dim / 2]``
    (its axis's position: ``mrope_axes``), and the vision embedding rows."""
    three = to_device([p for axis in hb.rope_positions for p in axis], device).view(3, -1)
    axes = torch.tensor(hb.mrope_axes, dtype=torch.int64, device=device)
    ctx.rope_positions = three.index_select(0, axes).t().contiguous()
    if hb.embed_rows:
        ctx.embed_rows = to_device(hb.embed_rows, device)
        ctx.embeds = torch.cat(hb.embeds).to(device)


MAX_RUNS = 4  # staged ids in at most this many runs are copied run by run (else gathered)


def staged_runs(host_ids: list[int]) -> list[list[int]]:
    """The staged ids (``-1 - i``) of packed token ids as runs ``[position, i, length]`` in which
    both the position and the source index go up by one (``gather_ids``)."""
    runs: list[list[int]] = []
    for p, t in enumerate(host_ids):
        if t < 0:
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[2] == p and last[1] + last[2] == -1 - t:
                last[2] += 1
            else:
                runs.append([p, -1 - t, 1])
    return runs


def gather_ids(input_ids: torch.Tensor, ids_from: torch.Tensor, host_ids: list[int] | None = None) -> None:
    """Input ids staged as ``-1 - i`` become token i of ``ids_from`` on the device; the others are
    token ids already. ``ids_from``: token ids [R], or a step's device samples [R, 2] float64
    (token, logprob). So a step can be launched before some of its tokens reach the host: the
    next decode step behind a running one (strategies/ar.py), a verify behind the draft chain
    that proposes its drafts (strategies/mtp.py). ``host_ids``: the ids as the host packed them,
    if known: staged ids in at most ``MAX_RUNS`` runs (the MTP head's catch-up and chain take
    every token in order, a B=1 verify its drafts in one run) are a copy per run instead of the
    gather's seven kernels, which the host launches on a B=1 step's critical path."""
    tokens = ids_from[:, 0] if ids_from.dim() == 2 else ids_from
    runs = staged_runs(host_ids) if host_ids is not None else None
    if runs is not None and len(runs) <= MAX_RUNS:
        for at, first, n in runs:
            input_ids[at:at + n].copy_(tokens[first:first + n])
        return
    staged = input_ids < 0
    picked = tokens.index_select(0, (-1 - input_ids).clamp_(min=0)).to(input_ids.dtype)
    input_ids.copy_(torch.where(staged, picked, input_ids))


def build_context(token_ids, past_lens, blocks, state_slots, is_recurrent, *, block_size: int, device: torch.device,
                  ring: int = 1, logits_rows: list[list[int]] | None = None) -> tuple[torch.Tensor, ForwardContext]:
    """``plan_batch`` + ``upload``: an eager step's inputs (tests, probes)."""
    return upload(plan_batch(token_ids, past_lens, blocks, state_slots, is_recurrent, block_size=block_size,
                             ring=ring, logits_rows=logits_rows), device)
