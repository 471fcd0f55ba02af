"""The values a step passes between its parts, in the order a step makes them: the scheduler's
rows (``Scheduled``), a strategy's plan and the model call in it (``StepPlan``, ``Forward`` of
``SeqRows``), the runner's output (``StepOutput``, samples on their way to the host: ``Landing``),
and the commit that says what the step did to each sequence (``StepCommit`` of ``SeqCommit``,
applied by ``Scheduler.update`` alone). Behaviour lives with the parts (``scheduler.py``,
``runner.py``, ``strategies/``); these are data."""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np
import torch

from bi_core.ops.context import GraphShape
from bi_core.runtime.sequence import Sequence

Sampled = tuple[int, float, "dict[int, float] | None"]  # (token, logprob, top-N dict) as Sequence.append takes


@attrs.frozen
class Scheduled:
    """One sequence's part of a step as the scheduler placed it."""

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


@attrs.frozen
class SeqRows:
    """One sequence's part of a forward: ``tokens`` at positions ``start...`` (GDN in the
    recurrent form when ``recurrent``); the logits of ``logits_rows`` (offsets into ``tokens``)
    are computed, and sampled on the device when ``sample`` (row r keyed by the sequence's seed
    and position ``start + r + 1``, the position of the token it samples)."""

    seq: Sequence
    tokens: list[int]
    start: int
    recurrent: bool
    logits_rows: tuple[int, ...] = ()
    sample: bool = False

    @property
    def sample_positions(self) -> list[int]:
        return [self.start + r + 1 for r in self.logits_rows]


@attrs.frozen
class Forward:
    """One model call: ``rows`` laid end to end. ``head="mtp"``: the MTP head, whose per-token
    input ``hidden`` pairs with the tokens. ``ids_from``: a token staged as ``-1 - i`` is token i
    of this device tensor (a previous step's samples, or drafts not yet on the host: a step
    launched before those tokens reach the host; ``runtime.batch.gather_ids``)."""

    rows: list[SeqRows]
    head: Literal["model", "mtp"] = "model"
    hidden: torch.Tensor | None = None
    ids_from: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@attrs.frozen
class StepOutput:
    """What a forward returns: every token's hidden state, the logits of the rows it was asked
    for, and (when rows were sampled on the device) their samples [R, 2] float64 (token,
    logprob). ``offsets[i]``: the first flat row of ``rows[i]``. ``graph``: the shape of the CUDA
    graph it replayed, or None (eager)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    samples: torch.Tensor | None
    offsets: list[int]
    graph: GraphShape | None = None
    routed: torch.Tensor | None = None  # [moe layers, tokens, k] expert ids, when a row asked for them
    input_ids: torch.Tensor | None = None  # the step's token ids on the device (staged ones gathered)
    # its constrained rows' device samples were drawn again with their grammar masks (ModelRunner.mask_samples)
    masked: bool = False


@attrs.define
class Landing:
    """A device tensor on its way to pinned host memory: a step's samples (overlapped decode),
    MTP drafts."""

    device: torch.Tensor  # the source (a step's samples [R, 2], a graph's static output; MTP draft ids)
    host: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


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
    """What one step did: each sequence's commit, the known tokens it scored, the forks it made."""

    seqs: list[SeqCommit]
    scores: list[tuple[Sequence, float, dict[int, float]]] = attrs.field(factory=list)  # scored known tokens
    forks: list[Fork] = attrs.field(factory=list)
