"""MTP speculative decoding, bitwise equal to autoregressive decoding on an invariant backend.

Per step, a decoding sequence with pending token t_n (position n) and drafts d_1..d_k runs one
main forward over [t_n, d_1..d_k] (GDN in its recurrent form, the same arithmetic as k+1 decode
steps). Every row is sampled exactly as AR would sample that position (greedy, or Gumbel-max
keyed by (seed, position)); the longest prefix of drafts equal to those samples is accepted and
the sample after it is emitted too, so the output is the AR output token for token, whatever the
drafts were. (Standard rejection sampling keeps only the distribution, not the tokens, so it
would break the MTP == AR guarantee.) Rejected drafts cost nothing to undo: KV is position
addressed, and each sequence owns a ring of 1+N GDN state slots, so a shorter length selects the
state after the last accepted token.

Every verify runs exactly 1+N tokens per sequence (missing drafts, near max_new_tokens, are
padded and never sampled), so verify steps are uniform and replay CUDA graphs like decode steps.

The MTP head then catches up over the step's rows (row q pairs the main hidden of position q
with the token sampled for q + 1; rows past the accepted ones only write MTP KV at positions
that the next step rewrites before anything reads them), takes its first draft from the row of
the last accepted token, and chains N-1 more single-row steps (greedy). The head runs through
its own graph runner: catch-up steps of verify sequences are uniform (1+N rows), chain steps
are single-row.

Nothing in the chain waits for the device: each chain step takes its token from the previous
step's draft on the device (``Forward.ids_from``), the drafts go to host memory behind the chain,
and the next verify is planned and launched with its drafts staged as indices into the chain's
device tensor (``runtime.batch.gather_ids``): the host plans each step while the device runs
the one before. Only the verify's samples are waited for (the accept rule runs on the host); by
then the drafts have landed too (the host's work per head step can still exceed the device's:
docs/benchmarks.md section 19). A ``draft_hook`` (tests: it sees the proposals) waits for them;
a ``draft_override`` (benchmarks, audits: forced drafts that do not read the proposals) is
written over them on the device, so forced drafts take the path real ones take."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from bi_core.config import EngineConfig
from bi_core.errors import ConfigError
from bi_core.hookspecs import hookimpl
from bi_core.runtime.batch import to_device
from bi_core.runtime.runner import Forward, Landing, SeqRows, StepOutput
from bi_core.runtime.sequence import Sequence, Status
from bi_core.runtime.step import Fork, Scheduled, SeqCommit, StepCommit, StepPlan
from bi_core.strategies.base import Strategy

DraftHook = Callable[[Sequence, list[int]], list[int]]
DraftOverride = Callable[[Sequence, int], "list[int] | None"]  # (sequence, N) -> forced drafts, or None


@attrs.frozen
class _OnDevice:
    """A sequence's drafts still on the device: row ``row`` of a draft chain's [S, N] ids, whose
    host copy is ``landing``."""

    landing: Landing
    row: int

    def host(self) -> list[int]:
        return self.landing.wait()[self.row].tolist()


def num_speculative(config: EngineConfig) -> int:
    return config.strategy.num_speculative_tokens or 1


def accepted_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are accepted: the longest prefix of ``drafts`` equal to the tokens sampled
    at the same positions (``sampled[j]`` is what the verify step drew where ``drafts[j]`` was
    proposed; ``sampled`` has one more row, the token after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


@attrs.frozen
class _Head:
    """The MTP head's rows for one sequence in a step: ``tokens[j]`` is the token at position
    ``start + j + 1``, paired with the main model's hidden row ``offset + j`` (position
    ``start + j``); ``draft_row``: the row whose output proposes the first draft."""

    seq: Sequence
    start: int
    tokens: list[int]
    offset: int
    draft_row: int


@attrs.define
class MTPPlan(StepPlan):
    head: list[_Head] = attrs.field(factory=list)  # filled by commit, run by after_update
    # per row: the drafts it verifies when they were still on the device at plan time (``drafts``
    # holds [] for that row until commit reads them from host memory), and how many
    on_device: list[tuple[_OnDevice, int] | None] = attrs.field(factory=list)


class MTPStrategy(Strategy):
    name = "mtp"
    is_speculative = True
    uses_mtp_head = True

    @classmethod
    def lookahead_for(cls, config: EngineConfig) -> int:
        # verify writes KV at n..n+N; after accepting a drafts the chain writes up to n+a+N-1 <= n+2N-1
        return 2 * num_speculative(config)

    @classmethod
    def state_ring_for(cls, config: EngineConfig) -> int:
        return num_speculative(config) + 1

    @classmethod
    def decode_tokens_for(cls, config: EngineConfig) -> int:
        return 1 + num_speculative(config)

    @classmethod
    def graph_query_lens(cls, config: EngineConfig) -> tuple[int, ...]:
        return (1, 1 + num_speculative(config))  # chain steps of the head; verify steps and catch-up

    @classmethod
    def check(cls, config: EngineConfig, model, *, batch_invariant: bool, exact_step_tokens: int | None,
              checkpoint_has_mtp: bool) -> None:
        if model.mtp is None and checkpoint_has_mtp:
            raise ConfigError("strategy.name", "the checkpoint has MTP head tensors (mtp.*) but its config.json "
                              "does not declare them: add \"mtp_num_hidden_layers\": 1 (to text_config, or the top "
                              "level of a text-only config)")
        if model.mtp is None:
            raise ConfigError("strategy.name", "mtp needs a checkpoint with an MTP head (mtp.* tensors); "
                              "this model has none")
        verify = cls.decode_tokens_for(config)
        limit = exact_step_tokens
        if batch_invariant and limit is not None and verify > limit:
            raise ConfigError("strategy.num_speculative_tokens", f"at most {limit - 1} with this model in invariant "
                              f"mode: its attention gives verify rows the bits of one-token decode steps only up to "
                              f"{limit} tokens per sequence (AttentionImpl.decode_query_len), and a verify step "
                              f"runs {verify}")

    def __init__(self, config: EngineConfig, runner) -> None:
        super().__init__(config, runner)
        self.num_spec = num_speculative(config)
        self.drafts: dict[int, list[int] | _OnDevice] = {}
        self.draft_hook: DraftHook | None = None  # tests force drafts through this (it waits for them)
        self.draft_override: DraftOverride | None = None  # benchmarks and audits force drafts without reading them

    def forget(self, seq) -> None:
        self.drafts.pop(seq.request_id, None)

    # ------------------------------------------------------------------ one engine step

    def plan(self, scheduled: list[Scheduled]) -> MTPPlan:
        rows, drafts, on_device, chains = [], [], [], {}
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            if seq.is_decoding:  # verify: the pending token and its drafts, padded to 1+N
                remaining = min(seq.params.max_new_tokens - len(seq.output_ids), seq.max_total_len - seq.num_tokens)
                n = max(0, min(self.num_spec, remaining - 1))
                d = self.drafts.get(seq.request_id, [])
                if isinstance(d, _OnDevice):  # staged as -1 - (index into the chains' ids laid end to end)
                    if id(d.landing) not in chains:
                        chains[id(d.landing)] = (d.landing, sum(c.device.numel() for c, _ in chains.values()))
                    base = chains[id(d.landing)][1]
                    staged = [-1 - (base + d.row * self.num_spec + j) for j in range(n)]
                    on_device.append((d, n))
                    d = []
                else:  # host drafts (a hook's may be fewer than N)
                    d = staged = d[:n]
                    n = len(d)
                    on_device.append(None)
                padding = [0] * (self.num_spec - n)  # KV and ring slots exist for them (lookahead)
                rows.append(SeqRows(seq, [seq.all_ids[-1]] + staged + padding, start, True, tuple(range(1 + n)),
                                    True))
            else:
                d, last = [], (s.num_tokens - 1,) if s.samples else ()
                rows.append(SeqRows(seq, seq.ids(start, start + s.num_tokens), start, s.recurrent, last, bool(last)))
                on_device.append(None)
            drafts.append(d)
        ids_from = None
        if chains:
            ids = [landing.device.reshape(-1) for landing, _ in chains.values()]
            ids_from = ids[0] if len(ids) == 1 else torch.cat(ids)
        return MTPPlan(scheduled, Forward(rows, ids_from=ids_from), drafts, on_device=on_device)

    def commit(self, plan: MTPPlan, out: StepOutput, landed: torch.Tensor | None = None) -> StepCommit:
        rows = plan.forward.rows
        scores = self.runner.score(rows, out)
        for i, pending in enumerate(plan.on_device):
            if pending is not None:  # landed behind the chain, before this verify's samples
                plan.drafts[i] = pending[0].host()[: pending[1]]
        sampling = [r for r in rows if r.sample]
        flat_seqs = [r.seq for r in sampling for _ in r.logits_rows]
        sampled = self.runner.sample(flat_seqs, [p for r in sampling for p in r.sample_positions], out.logits,
                                     out.samples) if flat_seqs else []
        commits, leaders, cursor, routed = [], [], 0, self.routing(out)
        for r, drafts, offset in zip(rows, plan.drafts, out.offsets):
            seq, got = r.seq, sampled[cursor:cursor + len(r.logits_rows)] if r.sample else []
            if seq.followers and got:  # a leader's last prompt chunk: its samples fork from this row
                leaders.append((seq, cursor))
            cursor += len(got)
            if seq.is_decoding:  # a verify row (no sequence state moved since the plan)
                accepted = accepted_drafts(drafts, [t for t, _, _ in got])
                commits.append(SeqCommit(seq, r.start, accepted + 1, got[: accepted + 1], drafts=len(drafts),
                                         accepted=accepted, routed=routed(r, offset, accepted + 1)))
                # got[j] is the token at start + j + 1 for j <= accepted; later rows only fill the step
                head = [t for t, _, _ in got] + [0] * (len(r.tokens) - len(got))
                plan.head.append(_Head(seq, r.start, head, offset, accepted))
                continue
            commits.append(SeqCommit(seq, r.start, len(r.tokens), got[:1], chunk=True, recurrent=r.recurrent,
                                     routed=routed(r, offset, len(r.tokens))))
            if seq.score_from is None:  # a scoring request never drafts: no head rows
                end = r.start + 1 + len(r.tokens)
                head = seq.ids(r.start + 1, min(end, seq.num_tokens)) + [t for t, _, _ in got[:1]]
                plan.head.append(_Head(seq, r.start, head, offset, len(r.tokens) - 1))
        return StepCommit(commits, scores, self.forks(leaders, out))

    def after_update(self, plan: MTPPlan, commit: StepCommit, out: StepOutput) -> None:
        self._propose(plan.head, out.hidden)

    def after_fork(self, forks: list[Fork], plan: MTPPlan, out: StepOutput) -> None:
        """The head runs each sample's row at the last prompt position with the sample's own first
        token: its MTP KV there (the copied page held the leader's) and its first draft."""
        rows = {id(r.seq): (r, offset) for r, offset in zip(plan.forward.rows, out.offsets)}
        heads = []
        for fork in forks:
            r, offset = rows[id(fork.leader)]
            for f, _ in fork.first:
                if f.status is not Status.FINISHED:
                    heads.append(_Head(f, len(f.prompt_ids) - 1, [f.output_ids[0]], offset + len(r.tokens) - 1, 0))
        if heads:
            self._propose(heads, out.hidden)

    # ------------------------------------------------------------------ the MTP head

    def _propose(self, heads: list[_Head], hidden: torch.Tensor) -> None:
        """Catch the MTP head up over this step's rows, then chain drafts for decoding sequences."""
        for h in heads:
            if h.seq.status is Status.FINISHED:
                self.drafts.pop(h.seq.request_id, None)
        # a finished leader still gets its head rows: its samples fork from its pages
        live = [h for h in heads if (h.seq.status is not Status.FINISHED or h.seq.followers) and h.tokens]
        if not live:
            return
        device = hidden.device
        rows = [h.offset + j for h in live for j in range(len(h.tokens))]
        drafting = [i for i, h in enumerate(live) if h.seq.is_decoding and h.seq.status is not Status.FINISHED]
        wanted = set(drafting)
        out = self._mtp([SeqRows(h.seq, h.tokens, h.start, True, (h.draft_row,) if i in wanted else ())
                         for i, h in enumerate(live)], hidden[to_device(rows, device)])
        if not drafting:
            return
        starts = [0, *_cumsum(len(h.tokens) for h in live)]
        last = out.hidden[to_device([starts[i] + live[i].draft_row for i in drafting], device)]
        positions = [live[i].start + live[i].draft_row for i in drafting]
        seqs = [live[i].seq for i in drafting]
        ids = torch.empty((len(seqs), self.num_spec), dtype=torch.int64, device=device)
        ids[:, 0] = out.logits
        for j in range(1, self.num_spec):  # each step's token: the previous step's draft, on the device
            positions = [q + 1 for q in positions]
            # steps after the first advance the last one's graph inputs on the device: packing a
            # step on the host took longer than the step (benchmarks sections 19 and 21)
            out = self.runner.advance_mtp(ids[:, j - 1], last) if j > 1 else None
            if out is None:
                out = self._mtp([SeqRows(seq, [-1 - i], q, True, (0,)) for i, (seq, q) in
                                 enumerate(zip(seqs, positions))], last, ids_from=ids[:, j - 1])
            last = out.hidden
            ids[:, j] = out.logits
        if self.draft_override is not None:  # forced drafts take the real ones' place on the device
            forced = {i: self.draft_override(seq, self.num_spec) for i, seq in enumerate(seqs)}
            forced = {i: (d + [0] * self.num_spec)[: self.num_spec] for i, d in forced.items() if d is not None}
            if forced:
                values = to_device([t for d in forced.values() for t in d], device).view(len(forced), self.num_spec)
                ids.index_copy_(0, to_device(list(forced), device), values)
        landing = self.runner.to_host(ids)
        for i, seq in enumerate(seqs):
            if self.draft_hook is not None:
                self.drafts[seq.request_id] = self.draft_hook(seq, landing.wait()[i].tolist())
            else:
                self.drafts[seq.request_id] = _OnDevice(landing, i)

    def _mtp(self, rows: list[SeqRows], hidden: torch.Tensor, ids_from: torch.Tensor | None = None) -> StepOutput:
        """The MTP head over ``rows`` (its own KV cache, same pages), the main model's ``hidden``
        paired with their tokens: its output rows, and (as ``logits``) the greedy draft of each
        logits row. The head has no GDN layer, so every row is marked recurrent: any uniform step
        can replay a graph."""
        return self.runner.execute(Forward(rows, head="mtp", hidden=hidden, ids_from=ids_from))


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


@hookimpl
def bi_register_strategies(register) -> None:
    register(MTPStrategy)
