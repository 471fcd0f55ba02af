"""plan_batch fills a step's host lists a page at a time (a prefill's thousands of tokens: one
range per page, not a Python step per token; benchmarks section 41). It must give every token the
slot, position and state slot of the per-token rule it replaced, checked here against that rule."""

from __future__ import annotations

import random

import pytest

from bi_core.runtime.batch import plan_batch


def per_token(token_ids, past_lens, blocks, state_slots, block_size, ring):
    """The rule, one token at a time: position p, KV slot blocks[p // bs] * bs + p % bs, and the
    state after the token in slot (p + 1) % ring of the sequence's ring."""
    positions, slots, states = [], [], []
    for ids, past, blk, base in zip(token_ids, past_lens, blocks, state_slots):
        for p in range(past, past + len(ids)):
            positions.append(p)
            slots.append(blk[p // block_size] * block_size + p % block_size)
            states.append(base * ring + (p + 1) % ring)
    return positions, slots, states


@pytest.mark.parametrize("ring", [1, 3])
def test_plan_batch_matches_the_per_token_rule(ring):
    rng = random.Random(ring)
    for _ in range(200):
        block_size = rng.choice([1, 4, 16])
        n = rng.randint(1, 5)
        past = [rng.randint(0, 70) for _ in range(n)]
        lens = [rng.randint(1, 60) for _ in range(n)]  # decode rows, chunks crossing pages, pages' edges
        pages = [rng.sample(range(500), (p + q + block_size - 1) // block_size) for p, q in zip(past, lens)]
        ids = [[rng.randrange(1000) for _ in range(q)] for q in lens]
        bases = rng.sample(range(50), n)
        hb = plan_batch(ids, past, pages, bases, [True] * n, block_size=block_size, ring=ring)
        assert (hb.positions, hb.slot_mapping, hb.token_state_slots) == per_token(ids, past, pages, bases,
                                                                                 block_size, ring)
        assert hb.token_ids == [t for row in ids for t in row] and hb.query_lens == lens
