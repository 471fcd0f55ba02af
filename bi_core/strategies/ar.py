"""Autoregressive decoding: one forward over the scheduled tokens, one sample per finished row."""

from __future__ import annotations

from bi_core.hookspecs import hookimpl
from bi_core.runtime.scheduler import Scheduled
from bi_core.strategies.base import Strategy


class ARStrategy(Strategy):
    name = "ar"

    def step(self, scheduled: list[Scheduled]) -> None:
        eng = self.engine
        input_ids, ctx = eng.make_batch(
            [s.seq.all_ids[s.seq.num_computed : s.seq.num_computed + s.num_tokens] for s in scheduled],
            [s.seq for s in scheduled],
            [s.recurrent for s in scheduled],
            [[s.num_tokens - 1] if s.samples else [] for s in scheduled],
            sample_positions=[[s.seq.num_tokens] if s.samples else [] for s in scheduled])
        out = eng.run_model(input_ids, ctx)
        eng.record_scores(scheduled, out.hidden, ctx.cu_seqlens_host)
        sampling = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed += s.num_tokens
        if sampling:
            eng.sample_and_append(sampling, out)


@hookimpl
def bi_register_strategies(register) -> None:
    register(ARStrategy)
