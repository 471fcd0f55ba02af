"""The values a step passes between its parts: a strategy's plan, the runner's output, and the
commit that says what the step did to each sequence (applied by ``Scheduler.update`` alone)."""

from __future__ import annotations

import attrs
import numpy as np

from bi_core.runtime.runner import Forward, Sampled
from bi_core.runtime.sequence import Sequence


@attrs.frozen
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens of this sequence processed in this step

    @property
    def samples(self) -> bool:
        """True when this step processes the sequence's last known token (so a new one is sampled)."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens

    @property
    def recurrent(self) -> bool:
        """Whether GDN runs these tokens in the recurrent (decode) form: single tokens after the
        first (decode steps, a prompt's one-token last chunk), and the tokens past a sequence's
        ``decode_from`` (an exact scoring request's continuation, a rebuilt sequence's generated
        tokens); otherwise the chunked form. Depends on the request alone."""
        return runs_recurrent(self.seq.num_computed, self.num_tokens, self.seq.in_exact_continuation)


def runs_recurrent(num_computed: int, num_tokens: int, exact_continuation: bool = False) -> bool:
    """``Scheduled.recurrent`` from its facts (the trainer's layout of a batch follows it too)."""
    return num_computed > 0 and (num_tokens == 1 or exact_continuation)


@attrs.define
class StepPlan:
    """A strategy's plan of one step: the scheduled sequences and the model call that runs them.
    ``drafts[i]``: the drafts row i verifies (speculative strategies; empty otherwise).
    ``ahead``: launched before the previous step's tokens reached the host (its token ids are
    rows of that step's device samples)."""

    scheduled: list[Scheduled]
    forward: Forward
    drafts: list[list[int]] = attrs.field(factory=list)
    ahead: bool = False


@attrs.frozen
class SeqCommit:
    """What one step did to one sequence. ``computed``: tokens it put in the caches (from
    ``start``); ``tokens``: new tokens, appended in order until one ends the sequence; ``chunk``:
    a prompt chunk (counts as prompt work; may enter the prefix cache); ``drafts`` / ``accepted``:
    drafts verified and accepted (speculative steps)."""

    seq: Sequence
    start: int
    computed: int
    tokens: list[Sampled] = attrs.field(factory=list)
    chunk: bool = False
    recurrent: bool = False
    drafts: int = 0
    accepted: int = 0
    routed: np.ndarray | None = None  # [computed, moe layers, k] expert ids, when the request asked for them


@attrs.frozen
class Fork:
    """A leader's waiting samples, each with its first token (sampled from the leader's row)."""

    leader: Sequence
    first: list[tuple[Sequence, Sampled]]


@attrs.frozen
class StepCommit:
    seqs: list[SeqCommit]
    scores: list[tuple[Sequence, float, dict[int, float]]] = attrs.field(factory=list)  # scored known tokens
    forks: list[Fork] = attrs.field(factory=list)
