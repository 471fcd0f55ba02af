"""Overlapped decode (``graph.overlap``): the decode step after a running one is planned, staged
and launched before the running step's tokens reach the host, so the device never waits for the
host's planning and bookkeeping.

A step whose device samples are all its commit needs (a CUDA graph replay, every row sampled on
the device, requests that want nothing more: no filtering, top-N logprobs, n-sample fork or
logits hook) has them copied to pinned host memory behind it; meanwhile the scheduler plans the
next decode step (``Scheduler.plan_decode``: exactly what ``schedule`` would return after this
step, else None: requests waiting, pages short, ...), the strategy plans its model call with
each row's *source row* in the running step's samples in place of a token id
(``Strategy.plan_ahead``), and the runner launches it, gathering the tokens on the device
(``runtime.batch.gather_ids``). Only then does the engine wait for this step's samples and
commit it.

A strategy that cannot plan its next step before it knows this one's tokens launches its own
work behind the step instead (``Strategy.launch_behind``): MTP, whose next verify needs this
one's accepted drafts, runs the head's catch-up and draft chain from the verify's device outputs
(the accept count computed on the device) while the host commits, and launches the next verify
behind the chain (strategies/mtp.py); and so behind a lone prompt's last piece, from its sample.

What stays true: a sequence this step ends with a stop token still runs one wasted row in the
next; that row is dropped at its commit, and the pages and state slot it released are reused
only by work queued after it. Requests added between steps are admitted one step later. Every
row computes what it would alone, so outputs are the same bits with or without overlap
(tests/strategies/test_overlap.py)."""

from __future__ import annotations

import attrs

from bi_core.ops.sampling import device_sampled
from bi_core.runtime.runner import ModelRunner
from bi_core.runtime.scheduler import Scheduler
from bi_core.runtime.sequence import Status
from bi_core.runtime.step import Landing, StepOutput, StepPlan


@attrs.define
class _Ahead:
    """A step launched before the previous one was committed."""

    plan: StepPlan
    out: StepOutput


class Overlap:
    def __init__(self, scheduler: Scheduler, strategy, runner: ModelRunner, *, enabled: bool) -> None:
        self.scheduler, self.strategy, self.runner = scheduler, strategy, runner
        self.enabled = enabled and strategy.plans_ahead
        self.behind = enabled and strategy.launches_behind
        self.num_behind = 0  # steps whose strategy work was launched behind them so far
        self.num_ahead = 0  # steps launched ahead so far
        self._ahead: _Ahead | None = None

    @property
    def in_flight(self) -> list | None:
        return self._ahead.plan.scheduled if self._ahead is not None else None

    def take(self) -> tuple[StepPlan, StepOutput] | None:
        """The step launched ahead, to commit now; None if there is none or every row's request
        ended (stop token, abort) meanwhile (then the engine schedules afresh)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or not any(r.seq.status is Status.RUNNING for r in ahead.plan.forward.rows):
            return None
        return ahead.plan, ahead.out

    def launch_next(self, plan: StepPlan, out: StepOutput) -> Landing | None:
        """If ``plan``'s samples can fly: their copy to the host (wait on it to commit ``plan``),
        and the next decode step launched behind it when it can be planned now."""
        if not ((self.enabled or self.behind) and self._flies(plan, out)):
            return None
        landing = self.runner.land(out.samples)
        if self.behind:  # MTP: the head's catch-up and draft chain, fed from the verify on the device
            self.num_behind += self.strategy.launch_behind(plan, out)
            return landing
        continuing, ending = [], []
        for r in plan.forward.rows:
            if r.seq.status is Status.RUNNING:
                (ending if r.seq.at_length(1) else continuing).append(r.seq)
        scheduled = self.scheduler.plan_decode(continuing, ending)
        nxt = self.strategy.plan_ahead(scheduled, plan, out) if scheduled is not None else None
        if nxt is not None:
            self.runner.wait_inputs()  # the running step's staged inputs are on the device: host buffers are free
            self._ahead = _Ahead(nxt, self.runner.execute(nxt.forward))
            self.num_ahead += 1
        return landing

    def _flies(self, plan: StepPlan, out: StepOutput) -> bool:
        rows = plan.forward.rows
        # a uniform (decode) graph: plan_ahead moves every row one token on; a mixed graph's step
        # (decode rows plus a prompt's last chunk) flies only for work launched behind it, and
        # with the piece alone (bucket 0: MTP's head over a lone prompt)
        g = out.graph
        return (out.samples is not None and g is not None and (not g.chunk or (self.behind and g.bucket == 0))
                and self.runner.on_logits is None
                and all(r.sample for r in rows) and not any(r.seq.followers for r in rows)
                and device_sampled([r.seq for r in rows], masked=out.masked))
