"""A strategy plans each engine step and decides what it did (AR, MTP, ...).

It gets the model runner (``runtime/runner.py``), never the engine: ``plan`` turns the scheduled
sequences into a ``StepPlan`` (the runner's ``Forward``), ``commit`` turns the runner's output
into a ``StepCommit`` (tokens computed and appended per sequence, scores, forks), which only the
scheduler applies (``Scheduler.update``). Neither writes sequence state. A speculative strategy
also runs its draft model after the commit (``after_update``, ``after_fork``)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import torch

from bi_core.runtime.step import Fork, Scheduled, StepCommit, StepOutput, StepPlan

if TYPE_CHECKING:
    from bi_core.config import EngineConfig
    from bi_core.runtime.runner import ModelRunner


class Strategy(abc.ABC):
    name: ClassVar[str]
    is_speculative: ClassVar[bool] = False
    uses_mtp_head: ClassVar[bool] = False  # the runner builds a graph runner for the MTP head
    plans_ahead: ClassVar[bool] = False  # ``plan_ahead`` can plan a step before the last one's tokens are known
    launches_behind: ClassVar[bool] = False  # ``launch_behind`` runs its draft model before the step's commit
    # a step's constrained rows are drawn with their grammar masks on the device before its commit
    # (``ModelRunner.mask_samples``); otherwise they take the row-by-row sampler at the commit
    masks_device_samples: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config, self.runner = config, runner

    @classmethod
    def lookahead_for(cls, config: EngineConfig) -> int:
        """KV positions past a sequence's known tokens that a step may write (drafts)."""
        return 0

    @classmethod
    def state_ring_for(cls, config: EngineConfig) -> int:
        """GDN state slots per sequence (1 + drafts verified per step)."""
        return 1

    @classmethod
    def decode_tokens_for(cls, config: EngineConfig) -> int:
        """Tokens a decoding sequence's step runs (counted against the step's token budget)."""
        return 1

    @classmethod
    def graph_query_lens(cls, config: EngineConfig) -> tuple[int, ...]:
        """Tokens per sequence of the uniform steps the graph runner captures (1 = decode)."""
        return (1,)

    @classmethod
    def check(cls, config: EngineConfig, model, *, batch_invariant: bool, exact_step_tokens: int | None,
              checkpoint_has_mtp: bool) -> None:
        """Raise a clear error if this strategy cannot run with this model and config."""

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of the strategy's own programs now (at engine start, after the
        runner's); returns how many."""
        return 0

    def forget(self, seq) -> None:
        """The request finished or was aborted: drop anything kept for it."""

    @abc.abstractmethod
    def plan(self, scheduled: list[Scheduled]) -> StepPlan:
        """The model call over the scheduled tokens."""

    @abc.abstractmethod
    def commit(self, plan: StepPlan, out: StepOutput, landed: torch.Tensor | None = None) -> StepCommit:
        """What the step did, from its output. ``landed``: its device samples already copied to
        the host (a step whose samples flew, see ``plan_ahead``)."""

    def plan_ahead(self, scheduled: list[Scheduled], running: StepPlan, out: StepOutput) -> StepPlan | None:
        """The decode step after ``running`` (launched, not committed), its tokens taken from
        ``out.samples`` on the device; None if this strategy cannot plan before it knows them."""
        return None

    def launch_behind(self, plan: StepPlan, out: StepOutput) -> bool:
        """Launch work behind ``plan``'s model call, before its samples reach the host (a
        speculative strategy's draft model, fed from the step's device outputs; the engine has
        queued the samples' copy to the host first, so waiting for them never waits for this).
        False if it cannot for this step (then ``after_update`` runs it as usual)."""
        return False

    def after_update(self, plan: StepPlan, commit: StepCommit, out: StepOutput) -> None:
        """After ``Scheduler.update`` applied ``commit``: a speculative strategy drafts here."""

    def after_fork(self, forks: list[Fork], plan: StepPlan, out: StepOutput) -> None:
        """After ``Scheduler.fork`` gave ``forks``' samples their first tokens."""

    # ------------------------------------------------------------------ shared by the strategies

    @staticmethod
    def routing(out: StepOutput):
        """A function (row, offset, n) -> the expert ids of ``n`` tokens from flat row ``offset``,
        [n, layers, k] int16 on the host, or None when the row's request did not ask for them."""
        host = out.routed.to("cpu", torch.int16).permute(1, 0, 2).numpy() if out.routed is not None else None

        def of(row, offset: int, n: int):
            if host is None or not row.seq.params.return_routed_experts:
                return None
            return host[offset:offset + n].copy()
        return of

    def forks(self, leaders: list[tuple[object, int]], out: StepOutput) -> list[Fork]:
        """Each leader's waiting samples with their first tokens, sampled from the logits row its
        own first token came from (``row``), each with its own seed (the sampler is
        row-invariant: what the sample would draw sent alone)."""
        forks = []
        for leader, row in leaders:
            fs = list(leader.followers)
            prompt_len = len(leader.prompt_ids)
            first = self.runner.sample(fs, [prompt_len] * len(fs), out.logits[row].expand(len(fs), -1).contiguous())
            forks.append(Fork(leader, list(zip(fs, first))))
        return forks
