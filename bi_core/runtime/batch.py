"""Turns a list of scheduled sequences into model inputs and a ForwardContext."""

from __future__ import annotations

import torch

from bi_core.ops.context import ForwardContext


def build_context(
    token_ids: list[list[int]],  # per sequence, the tokens this step processes
    past_lens: list[int],  # per sequence, tokens already in the cache
    blocks: list[list[int]],
    state_slots: list[int],
    is_recurrent: list[bool],
    *,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, ForwardContext]:
    query_lens = [len(t) for t in token_ids]
    context_lens = [p + q for p, q in zip(past_lens, query_lens)]
    positions, slots, logits_rows, flat = [], [], [], []
    offset = 0
    for ids, past, blk in zip(token_ids, past_lens, blocks):
        flat += ids
        for pos in range(past, past + len(ids)):
            positions.append(pos)
            slots.append(blk[pos // block_size] * block_size + pos % block_size)
        offset += len(ids)
        logits_rows.append(offset - 1)
    max_blocks = max(len(b) for b in blocks)
    table = [b + [-1] * (max_blocks - len(b)) for b in blocks]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    ctx = ForwardContext(
        positions=t(positions, torch.int64),
        cu_seqlens_q=t(cu, torch.int32),
        context_lens=t(context_lens, torch.int32),
        block_tables=t(table, torch.int32),
        slot_mapping=t(slots, torch.int64),
        state_slots=t(state_slots, torch.int64),
        logits_indices=t(logits_rows, torch.int64),
        query_lens_host=query_lens,
        context_lens_host=context_lens,
        state_slots_host=list(state_slots),
        is_recurrent_host=list(is_recurrent),
        recurrent_ids=t([i for i, r in enumerate(is_recurrent) if r], torch.int32),
        block_tables_host=[list(b) for b in blocks],
        block_size=block_size,
    )
    return t(flat, torch.int64), ctx
