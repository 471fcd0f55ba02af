"""Autoregressive decoding: one forward over the scheduled tokens, one sample per finished row."""

from __future__ import annotations

from bi_core.hookspecs import hookimpl
from bi_core.runtime.scheduler import Scheduled
from bi_core.strategies.base import Strategy


class ARStrategy(Strategy):
    name = "ar"

    def step(self, scheduled: list[Scheduled]) -> None:
        eng = self.engine
        seqs = [s.seq for s in scheduled]
        samples = [s.samples for s in scheduled]
        input_ids, ctx = eng.make_batch(
            [seq.ids(seq.num_computed, seq.num_computed + s.num_tokens) for seq, s in zip(seqs, scheduled)],
            seqs,
            [s.recurrent for s in scheduled],
            [[s.num_tokens - 1] if sample else [] for s, sample in zip(scheduled, samples)],
            sample_positions=[[seq.num_tokens] if sample else [] for seq, sample in zip(seqs, samples)])
        out = eng.run_model(input_ids, ctx)
        eng.record_scores(scheduled, out.hidden, ctx.cu_seqlens_host)
        sampling = [seq for seq, sample in zip(seqs, samples) if sample]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if sampling:
            eng.sample_and_append(sampling, out)


@hookimpl
def bi_register_strategies(register) -> None:
    register(ARStrategy)
