"""Autoregressive decoding: one forward over the scheduled tokens, one sample per finished row.

A step whose samples fly (a CUDA graph replay, every row sampled on the device) can have the
next decode step planned and launched before its tokens reach the host: ``plan_ahead`` stages
each row's *source row* in the running step's samples (as ``-1 - row``) instead of a token id,
and the graph runner gathers the tokens on the device (``runtime.batch.gather_ids``). The engine loop decides
when (``runtime/overlap.py``, whose docstring says what stays true)."""

from __future__ import annotations

import torch

from bi_core.hookspecs import hookimpl
from bi_core.runtime.runner import rows_of
from bi_core.runtime.sequence import Status
from bi_core.runtime.step import Forward, Scheduled, SeqCommit, SeqRows, StepCommit, StepOutput, StepPlan
from bi_core.strategies.base import Strategy


class ARStrategy(Strategy):
    name = "ar"
    plans_ahead = True
    masks_device_samples = True

    def plan(self, scheduled: list[Scheduled]) -> StepPlan:
        rows = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            last = (s.num_tokens - 1,) if s.samples else ()
            rows.append(SeqRows(seq, seq.ids(start, start + s.num_tokens), start, s.recurrent, last, bool(last)))
        return StepPlan(scheduled, Forward(rows))

    def plan_ahead(self, scheduled: list[Scheduled], running: StepPlan, out: StepOutput) -> StepPlan:
        # each row's token is the one it samples in the running step (staged as -1 - its sample row),
        # at position num_computed + 1
        source = {id(r.seq): i for i, r in enumerate(running.forward.rows)}
        rows = [SeqRows(s.seq, [-1 - source[id(s.seq)]], s.seq.num_computed + 1, True, (0,), True) for s in scheduled]
        return StepPlan(scheduled, Forward(rows, ids_from=out.samples), ahead=True)

    def commit(self, plan: StepPlan, out: StepOutput, landed: torch.Tensor | None = None) -> StepCommit:
        rows = plan.forward.rows
        scores = self.runner.score(rows, out)
        sampling = [i for i, r in enumerate(rows) if r.sample]
        if landed is not None:
            live = [i for i in sampling if rows[i].seq.status is Status.RUNNING]
            sampled = dict(zip(live, rows_of([rows[i].seq for i in live], landed[live])))
        elif sampling:
            seqs = [rows[i].seq for i in sampling]
            drawn = self.runner.sample(seqs, [r.sample_positions[0] for r in (rows[i] for i in sampling)],
                                       out.logits, out.samples, masked=out.masked)
            sampled = dict(zip(sampling, drawn))
        else:
            sampled = {}
        commits, routed = [], self.routing(out)
        for i, (r, offset) in enumerate(zip(rows, out.offsets)):
            if r.sample and i not in sampled:
                continue  # ended while the step flew: its row was wasted
            tokens = [sampled[i]] if i in sampled else []
            chunk = not plan.ahead and not r.seq.is_decoding  # (no sequence state moved since the plan)
            commits.append(SeqCommit(r.seq, r.start, len(r.tokens), tokens, chunk=chunk, recurrent=r.recurrent,
                                     routed=routed(r, offset, len(r.tokens))))
        leaders = [(rows[i].seq, k) for k, i in enumerate(sampling) if rows[i].seq.followers]
        return StepCommit(commits, scores, self.forks(leaders, out))


@hookimpl
def bi_register_strategies(register) -> None:
    register(ARStrategy)
