"""Autoregressive decoding: one forward over the scheduled tokens, one sample per finished row."""

from __future__ import annotations

import torch

from bi_core.hookspecs import hookimpl
from bi_core.runtime.batch import build_context
from bi_core.runtime.scheduler import Scheduled
from bi_core.strategies.base import Strategy


class ARStrategy(Strategy):
    name = "ar"

    def step(self, scheduled: list[Scheduled]) -> None:
        eng = self.engine
        seqs = [s.seq for s in scheduled]
        input_ids, ctx = build_context(
            [s.seq.all_ids[s.seq.num_computed : s.seq.num_computed + s.num_tokens] for s in scheduled],
            [s.num_computed for s in seqs],
            [s.blocks for s in seqs],
            [s.state_slot for s in seqs],
            [s.num_tokens == 1 and s.seq.num_computed > 0 for s in scheduled],  # decode rows: recurrent GDN
            block_size=eng.cache.block_size,
            device=eng.device,
            ring=eng.cache.state_ring,
        )
        hidden = eng.run_model(input_ids, ctx)
        sampling = [i for i, s in enumerate(scheduled) if s.samples]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if not sampling:
            return
        rows = ctx.logits_indices[torch.tensor(sampling, device=eng.device)]
        eng.sample_and_append([seqs[i] for i in sampling], eng.model.compute_logits(hidden[rows]))


@hookimpl
def bi_register_strategies(register) -> None:
    register(ARStrategy)
