"""Turns a list of scheduled sequences into model inputs and a ForwardContext."""

from __future__ import annotations

import torch

from bi_core.ops.context import ForwardContext


def build_context(
    token_ids: list[list[int]],  # per sequence, the tokens this step processes
    past_lens: list[int],  # per sequence, tokens already in the cache
    blocks: list[list[int]],
    state_slots: list[int],  # per sequence, its GDN state slot (the base of its ring)
    is_recurrent: list[bool],
    *,
    block_size: int,
    device: torch.device,
    ring: int = 1,
) -> tuple[torch.Tensor, ForwardContext]:
    """``ring`` > 1 (speculative decoding): a sequence owns ``ring`` consecutive state slots; at
    past length L it reads slot ``L % ring`` and the state after its t-th new token goes to slot
    ``(L + t + 1) % ring``, so rejecting drafts is just a shorter length, never a copy."""
    query_lens = [len(t) for t in token_ids]
    context_lens = [p + q for p, q in zip(past_lens, query_lens)]
    positions, slots, logits_rows, flat, token_states = [], [], [], [], []
    read_states = [base * ring + past % ring for base, past in zip(state_slots, past_lens)]
    offset = 0
    for ids, past, blk, base in zip(token_ids, past_lens, blocks, state_slots):
        flat += ids
        for t, pos in enumerate(range(past, past + len(ids))):
            positions.append(pos)
            slots.append(blk[pos // block_size] * block_size + pos % block_size)
            token_states.append(base * ring + (past + t + 1) % ring)
        offset += len(ids)
        logits_rows.append(offset - 1)
    max_blocks = max(len(b) for b in blocks)
    table = [b + [-1] * (max_blocks - len(b)) for b in blocks]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)

    recurrent = [i for i, r in enumerate(is_recurrent) if r]
    # One host-to-device copy for every integer field, then typed views.
    fields = [flat, positions, cu, context_lens, [x for row in table for x in row], slots, read_states,
              logits_rows, recurrent, token_states]
    packed = torch.tensor([x for f in fields for x in f], dtype=torch.int64, device="cpu")
    packed = packed.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else packed.to(device)
    parts = list(torch.split(packed, [len(f) for f in fields]))
    ids, pos, cu_t, ctx_t, table_t, slots_t, state_t, logits_t, rec_t, token_state_t = parts

    ctx = ForwardContext(
        positions=pos,
        cu_seqlens_q=cu_t.to(torch.int32),
        context_lens=ctx_t.to(torch.int32),
        block_tables=table_t.to(torch.int32).view(len(blocks), max_blocks),
        slot_mapping=slots_t,
        state_slots=state_t,
        logits_indices=logits_t,
        query_lens_host=query_lens,
        cu_seqlens_host=cu,
        context_lens_host=context_lens,
        state_slots_host=read_states,
        token_state_slots=token_state_t,
        token_state_slots_host=token_states,
        state_ring=ring,
        is_recurrent_host=list(is_recurrent),
        recurrent_ids=rec_t.to(torch.int32),
        block_tables_host=[list(b) for b in blocks],
        block_size=block_size,
    )
    return ids, ctx
