"""Example third-party strategy: autoregressive decoding in its plainest form (``example_ar``).

A strategy plans each engine step and says what it did; the engine owns the loop, the scheduler
owns the sequences. ``plan`` turns the scheduled sequences into one model call (a ``Forward`` of
``SeqRows``: each sequence's tokens from the position it has reached); ``commit`` turns the call's
output into a ``StepCommit`` (per sequence: the tokens it computed and the token it sampled), which
the scheduler applies. Neither writes sequence state. Unlike the built-in ``ar`` this one never
plans a step before the previous one's tokens reached the host (no ``plans_ahead``), so
``graph.overlap`` does nothing with it; its tokens and logprobs are ``ar``'s."""

from __future__ import annotations

import torch

from bi_core import hookimpl
from bi_core.runtime.step import Forward, Scheduled, SeqCommit, SeqRows, StepCommit, StepOutput, StepPlan
from bi_core.strategies.base import Strategy


class ExampleARStrategy(Strategy):
    """One forward over the scheduled tokens, one sample per sequence that reached its last token."""

    name = "example_ar"

    def plan(self, scheduled: list[Scheduled]) -> StepPlan:
        rows = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            # logits only for the last row, and only when it is the sequence's last known token
            last = (s.num_tokens - 1,) if s.samples else ()
            rows.append(SeqRows(seq, seq.ids(start, start + s.num_tokens), start, s.recurrent, last, bool(last)))
        return StepPlan(scheduled, Forward(rows))

    def commit(self, plan: StepPlan, out: StepOutput, landed: torch.Tensor | None = None) -> StepCommit:
        rows = plan.forward.rows
        sampling = [i for i, r in enumerate(rows) if r.sample]
        # one logits row per sampling sequence, in row order; keyed by (seed, position): batch-independent
        drawn = self.runner.sample([rows[i].seq for i in sampling], [rows[i].sample_positions[0] for i in sampling],
                                   out.logits, out.samples) if sampling else []
        sampled = dict(zip(sampling, drawn))
        routed = self.routing(out)  # the MoE expert ids, for requests that asked for them
        commits = [SeqCommit(r.seq, r.start, len(r.tokens), [sampled[i]] if i in sampled else [],
                             chunk=not r.seq.is_decoding, recurrent=r.recurrent, routed=routed(r, offset, len(r.tokens)))
                   for i, (r, offset) in enumerate(zip(rows, out.offsets))]
        # a request with n > 1 samples: the others fork from the first's prompt once it sampled
        leaders = [(rows[i].seq, k) for k, i in enumerate(sampling) if rows[i].seq.followers]
        return StepCommit(commits, self.runner.score(rows, out), self.forks(leaders, out))


@hookimpl
def bi_register_strategies(register) -> None:
    register(ExampleARStrategy)
