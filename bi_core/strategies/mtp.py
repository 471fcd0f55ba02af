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
are single-row, and a prompt piece alone (its main step a lone prompt graph) replays a head
prompt graph of the same size (``runtime.runner.mtp_graph_spec``).

Nothing in the chain waits for the device: each chain step takes its token from the previous
step's draft on the device (``Forward.ids_from``), the drafts go to host memory behind the chain,
and the next verify is planned and launched with its drafts staged as indices into the chain's
device tensor (``runtime.batch.gather_ids``): the host plans each step while the device runs
the one before. Only the verify's samples are waited for (the accept rule runs on the host); by
then the drafts have landed too.

Where a verify's samples fly (``runtime/overlap.py``: a uniform graph, every request sampled on
the device), the head does not wait for the commit either (``launch_behind``): the accept count
is computed on the device (``accepted_on_device``, the host rule's twin), the catch-up takes the
verify's samples and hidden rows on the device and proposes from every row, the chain's first
step is packed at the row-0 position and moved by the accept count on the device, and the
engine queues the samples' copy to the host before all this, so the commit waits for the verify
alone. All of it is one head program (``ModelRunner.head_program``: one CUDA graph per verify
bucket, which also holds the eager kernels that ran between the head's graphs). The head then
runs while the host commits and plans the next verify. Its drafts are the ones the host path
proposes, bitwise, where both run the same sequences (tests/strategies/test_graph_steps.py; it
also runs those the commit then ends, which the host path skips).

A ``draft_hook`` (tests: it sees the proposals) waits for the drafts; a ``draft_override``
(benchmarks, audits: forced drafts that do not read the proposals) is written over them on the
device, so forced drafts take the path real ones take. Both are applied after the commit (they
read the sequence's output so far)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from bi_core.config import EngineConfig
from bi_core.errors import ConfigError
from bi_core.hookspecs import hookimpl
from bi_core.ops.context import GraphShape
from bi_core.runtime.batch import to_device
from bi_core.runtime.runner import HeadSteps, rows_of
from bi_core.runtime.sequence import Sequence, Status
from bi_core.runtime.step import (
    Fork,
    Forward,
    Scheduled,
    SeqCommit,
    SeqRows,
    StepCommit,
    StepOutput,
    StepPlan,
)
from bi_core.strategies.base import Strategy
from bi_core.strategies.drafts import DraftLimits, ForcedDrafts, Lease, OnDevice

DraftHook = Callable[[Sequence, list[int]], list[int]]
DraftOverride = Callable[[Sequence, int], "list[int] | None"]  # (sequence, N) -> forced drafts, or None


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


def accepted_on_device(drafts: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """``accepted_drafts`` for a batch on the device: per row, the length of the longest prefix
    of ``drafts`` [S, N] equal to ``sampled`` [S, N] (the tokens the verify drew at the drafts'
    positions), [S] int64. A row with fewer drafts (near its end, padded) is capped by the caller."""
    return torch.cumprod((drafts == sampled).to(torch.int64), dim=1).sum(dim=1)


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
    # the form of the main rows it pairs with: a prompt piece's head rows run as a prompt piece
    # (a lone one replays the head's prompt graphs), verify and fork rows as decode rows
    recurrent: bool = True


@attrs.define
class MTPPlan(StepPlan):
    head: list[_Head] = attrs.field(factory=list)  # filled by commit, run by after_update
    # per row: the drafts it verifies when they were still on the device at plan time (``drafts``
    # holds [] for that row until commit reads them from host memory), and how many
    on_device: list[tuple[OnDevice, int] | None] = attrs.field(factory=list)
    num_drafts: list[int] = attrs.field(factory=list)  # per row: drafts it verifies (fewer than N near the end)
    # the draft chain launched behind the verify (launch_behind): its [S, N] ids, row i sequence i,
    # and the lease of the head program's output they are
    chain: torch.Tensor | None = None
    lease: Lease | None = None


class MTPStrategy(Strategy):
    name = "mtp"
    is_speculative = True
    uses_mtp_head = True
    launches_behind = True

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
        self.drafts: dict[int, list[int] | OnDevice] = {}
        self.draft_hook: DraftHook | None = None  # tests force drafts through this (it waits for them)
        self.draft_override: DraftOverride | None = None  # benchmarks and audits force drafts without reading them
        self._forced = ForcedDrafts(self.num_spec, runner.spec.max_batch_size)  # draft_override's, on the device
        self._limits = DraftLimits()  # head programs' per-row draft counts (launch_behind)
        self._leases: dict[int, Lease] = {}  # per verify bucket: its head program's output, as last written

    def forget(self, seq) -> None:
        self.drafts.pop(seq.request_id, None)

    # ------------------------------------------------------------------ one engine step

    def plan(self, scheduled: list[Scheduled]) -> MTPPlan:
        rows, drafts, on_device, chains, num_drafts = [], [], [], {}, []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            if seq.is_decoding:  # verify: the pending token and its drafts, padded to 1+N
                n = max(0, min(self.num_spec, _remaining(seq) - 1))
                d = self.drafts.get(seq.request_id, [])
                if isinstance(d, OnDevice) and not d.on_device:
                    d = d.host()
                if isinstance(d, OnDevice):  # staged as -1 - (index into the chains' ids laid end to end)
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
                # every row is sampled (a graph computes them all anyway), so every verify's samples
                # are 1+N rows a sequence; the commit reads those of the n drafts and the one after
                rows.append(SeqRows(seq, [seq.all_ids[-1]] + staged + padding, start, True,
                                    tuple(range(1 + self.num_spec)), True))
                num_drafts.append(n)
            else:
                num_drafts.append(0)
                d, last = [], (s.num_tokens - 1,) if s.samples else ()
                rows.append(SeqRows(seq, seq.ids(start, start + s.num_tokens), start, s.recurrent, last, bool(last)))
                on_device.append(None)
            drafts.append(d)
        ids_from = None
        if chains:
            ids = [landing.device.reshape(-1) for landing, _ in chains.values()]
            ids_from = ids[0] if len(ids) == 1 else torch.cat(ids)
        return MTPPlan(scheduled, Forward(rows, ids_from=ids_from), drafts, on_device=on_device,
                       num_drafts=num_drafts)

    def commit(self, plan: MTPPlan, out: StepOutput, landed: torch.Tensor | None = None) -> StepCommit:
        rows = plan.forward.rows
        scores = self.runner.score(rows, out)
        for i, pending in enumerate(plan.on_device):
            if pending is not None:  # landed behind the chain, before this verify's samples
                plan.drafts[i] = pending[0].host()[: pending[1]]
        sampling = [r for r in rows if r.sample]
        flat_seqs = [r.seq for r in sampling for _ in r.logits_rows]
        if landed is not None:  # the samples flew (runtime/overlap.py): already in host memory
            sampled = rows_of(flat_seqs, landed)
        else:
            # a verify row j counts drafts 1..j before it (its sample is kept only if they are accepted)
            before = [list(d[:j]) for r, d in zip(rows, plan.drafts) if r.sample for j in range(len(r.logits_rows))]
            sampled = self.runner.sample(flat_seqs, [p for r in sampling for p in r.sample_positions], out.logits,
                                         out.samples, before) if flat_seqs else []
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
                plan.head.append(_Head(seq, r.start, head, offset, len(r.tokens) - 1, r.recurrent))
        return StepCommit(commits, scores, self.forks(leaders, out))

    def after_update(self, plan: MTPPlan, commit: StepCommit, out: StepOutput) -> None:
        if plan.chain is not None:  # the head ran behind the verify: its drafts, for those still running
            live = [(i, r.seq) for i, r in enumerate(plan.forward.rows) if r.seq.status is not Status.FINISHED]
            for r in plan.forward.rows:
                if r.seq.status is Status.FINISHED:
                    self.drafts.pop(r.seq.request_id, None)
            if live:
                rows = [i for i, _ in live]
                if len(rows) == plan.chain.shape[0]:
                    self._keep([seq for _, seq in live], plan.chain, plan.lease)
                else:  # a copy of the live rows: no lease
                    self._keep([seq for _, seq in live], plan.chain.index_select(0, to_device(rows, plan.chain.device)))
            return
        self._propose(plan.head, out.hidden)

    def launch_behind(self, plan: MTPPlan, out: StepOutput) -> bool:
        """The head's catch-up and draft chain, launched behind the verify before its commit
        (module docstring): every row a verify, in a uniform graph whose samples fly, as one
        head program (``_behind_verify``); or a lone prompt's last piece (``_behind_prompt``)."""
        rows, q = plan.forward.rows, 1 + self.num_spec
        if all(_remaining(r.seq) <= 1 for r in rows):  # no draft would be read (the head after the commit skips them)
            return False
        if out.graph is not None and out.graph.chunk:
            return self._behind_prompt(plan, out)
        if not (self.runner.runs_head_programs and out.input_ids is not None and out.graph is not None
                and out.graph.q_len == q and all(r.seq.is_decoding and len(r.logits_rows) == q for r in rows)):
            return False
        # the catch-up over every verify row and the chain's first step, packed at the row-0
        # position (the program moves it by the accept count); their tokens are written on the device
        catch_up = [SeqRows(r.seq, [0] * q, r.start, True, tuple(range(q))) for r in rows]
        chain = [SeqRows(r.seq, [0], r.start + 1, True, (0,)) for r in rows]
        limits = self._limits.of(plan.num_drafts, out.graph.bucket, out.input_ids.device)
        drafts, = self.runner.head_program("behind", [Forward(catch_up, head="mtp"), Forward(chain, head="mtp")],
                                           (*self.runner.whole(out.graph), limits), self._behind_verify)
        written = self._leases.get(out.graph.bucket)  # what the program's last replay wrote: gone now
        if written is not None:
            written.valid = False
        plan.chain, plan.lease = drafts[: len(rows)], Lease()
        self._leases[out.graph.bucket] = plan.lease
        return True

    def capture_graphs(self) -> int:
        """The head programs behind verifies, one per verify graph (at engine start, after the
        runner's graphs, whose outputs they read)."""
        if not self.runner.runs_head_programs:
            return 0
        q, n = 1 + self.num_spec, 0
        for shape in self.runner.captured_shapes(q):
            limits = self._limits.of([], shape.bucket, self.runner.device)
            n += self.runner.capture_head_program("behind", [shape, GraphShape(1, shape.bucket)],
                                                  (*self.runner.whole(shape), limits), self._behind_verify)
        return n

    def _behind_verify(self, head: HeadSteps, ctxs: list, ids: torch.Tensor, hidden: torch.Tensor,
                       _logits: torch.Tensor, samples: torch.Tensor, limits: torch.Tensor) -> tuple[torch.Tensor]:
        """The head behind a verify, device work only (one graph: ``ModelRunner.head_program``),
        over the verify graph's whole bucket (``ids``, ``hidden``, ``samples``: its rows, padding
        included; ``limits``: each sequence's draft count, 0 for padding):
        - the catch-up over every verify row: row j of a sequence pairs the verify's hidden row
          j with its sample j (the token at start + j + 1), as the host path's catch-up does;
        - the accept count (``accepted_on_device``, the host rule's twin), capped by the draft
          count (a row near its end verifies fewer, padded drafts);
        - the first draft, from the catch-up row of the last accepted token;
        - N - 1 one-token chain steps, the first moved by the accept count, each taking the
          previous step's draft.
        Returns ([bucket, N] drafts,)."""
        catch_up, chain = ctxs
        q, b = 1 + self.num_spec, limits.shape[0]
        sampled = samples[:, 0].to(torch.int64)
        up_ids, up_hidden = head.inputs(catch_up)
        up_ids.copy_(sampled)
        up_hidden.copy_(hidden)
        rows, proposed = head.run(catch_up)
        accepted = torch.minimum(accepted_on_device(ids.view(b, q)[:, 1:], sampled.view(b, q)[:, :-1]), limits)
        pick = torch.arange(0, b * q, q, device=ids.device) + accepted
        drafts = torch.empty((b, self.num_spec), dtype=torch.int64, device=ids.device)
        drafts[:, 0] = proposed.index_select(0, pick)
        last = rows.index_select(0, pick)
        step_ids, step_hidden = head.inputs(chain)
        ctx = head.shift(chain, accepted)
        for j in range(1, self.num_spec):  # each step's token: the previous step's draft
            if j > 1:
                ctx = head.advance(ctx)
            step_ids.copy_(drafts[:, j - 1])
            step_hidden.copy_(last)
            last, proposed = head.run(ctx)
            drafts[:, j] = proposed
        return (drafts,)

    def _behind_prompt(self, plan: MTPPlan, out: StepOutput) -> bool:
        """A lone prompt's last piece (a mixed graph alone, its sample flying): the head's catch-up
        over the piece, its last row's token the sample still on the device, and the draft chain
        from that row, launched before the commit as behind a verify. A first token that ends the
        request leaves drafts nobody reads (``after_update`` drops them)."""
        if len(plan.forward.rows) != 1:
            return False
        r = plan.forward.rows[0]
        seq, n = r.seq, len(r.tokens)
        if seq.is_decoding or seq.score_from is not None or r.logits_rows != (n - 1,):
            return False
        # row j pairs the hidden row of position start + j with the token at start + j + 1
        tokens = seq.ids(r.start + 1, r.start + n) + [-1]  # the last: sample 0, on the device
        head = self._mtp([SeqRows(seq, tokens, r.start, r.recurrent, (n - 1,))], out.hidden, ids_from=out.samples)
        plan.chain = self._chain([seq], [r.start + n - 1], head.logits, head.hidden.narrow(0, n - 1, 1))
        return True

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
        if len(live) == 1:  # one sequence (a lone prompt's piece): its rows are a span of the step's
            paired = hidden.narrow(0, live[0].offset, len(live[0].tokens))
        else:
            paired = hidden[to_device([h.offset + j for h in live for j in range(len(h.tokens))], device)]
        drafting = [i for i, h in enumerate(live) if h.seq.is_decoding and h.seq.status is not Status.FINISHED]
        wanted = set(drafting)
        out = self._mtp([SeqRows(h.seq, h.tokens, h.start, h.recurrent, (h.draft_row,) if i in wanted else ())
                         for i, h in enumerate(live)], paired)
        if not drafting:
            return
        starts = [0, *_cumsum(len(h.tokens) for h in live)]
        last = out.hidden[to_device([starts[i] + live[i].draft_row for i in drafting], device)]
        seqs = [live[i].seq for i in drafting]
        self._keep(seqs, self._chain(seqs, [live[i].start + live[i].draft_row for i in drafting], out.logits, last))

    def _chain(self, seqs: list[Sequence], positions: list[int], first: torch.Tensor, last: torch.Tensor
               ) -> torch.Tensor:
        """The draft chain: ``first`` [S] the first drafts, proposed from the head's rows ``last``
        [S, H] at ``positions``; N - 1 more one-token head steps, each taking the previous step's
        draft on the device. Returns the [S, N] drafts. (Behind a verify, the chain runs inside
        the head program instead: ``_behind_verify``.)"""
        ids = torch.empty((len(seqs), self.num_spec), dtype=torch.int64, device=last.device)
        ids[:, 0] = first
        for j in range(1, self.num_spec):  # each step's token: the previous step's draft, on the device
            positions = [q + 1 for q in positions]
            # steps after the first advance the last one's graph inputs on the device: packing a
            # step on the host took longer than the step (dev/benchmarks-history.md)
            out = self.runner.advance_mtp(ids[:, j - 1], last) if j > 1 else None
            if out is None:
                out = self._mtp([SeqRows(seq, [-1 - i], q, True, (0,)) for i, (seq, q) in enumerate(zip(seqs, positions))],
                                last, ids_from=ids[:, j - 1])
            last = out.hidden
            ids[:, j] = out.logits
        return ids

    def _keep(self, seqs: list[Sequence], ids: torch.Tensor, lease: Lease | None = None) -> None:
        """Keep the drafts ``ids`` [S, N] of ``seqs`` for their next verify: on the device, on their
        way to host memory (a hook's: waited for; an override's: written over them first).
        ``lease``: where ``ids`` is a head program's output."""
        if self.draft_override is not None:  # forced drafts take the real ones' place on the device
            self._force(seqs, ids)
        landing = self.runner.to_host(ids)
        for i, seq in enumerate(seqs):
            if self.draft_hook is not None:
                self.drafts[seq.request_id] = self.draft_hook(seq, landing.wait()[i].tolist())
            else:
                self.drafts[seq.request_id] = OnDevice(landing, i, lease)

    def _force(self, seqs: list[Sequence], ids: torch.Tensor) -> None:
        """Write ``draft_override``'s drafts over ``ids`` [S, N] on the device (``ForcedDrafts``)."""
        self._forced.write([self.draft_override(seq, self.num_spec) for seq in seqs], ids)

    def _mtp(self, rows: list[SeqRows], hidden: torch.Tensor, ids_from: torch.Tensor | None = None) -> StepOutput:
        """The MTP head over ``rows`` (its own KV cache, same pages), the main model's ``hidden``
        paired with their tokens: its output rows, and (as ``logits``) the greedy draft of each
        logits row. The head has no GDN layer; its rows take the form of the main rows they pair
        with (``_Head.recurrent``, which only picks the attention's decode or prompt form): a
        uniform step of recurrent rows replays a uniform graph, a prompt piece alone a head
        prompt graph (``runtime.runner.mtp_graph_spec``)."""
        return self.runner.execute(Forward(rows, head="mtp", hidden=hidden, ids_from=ids_from))


def _remaining(seq: Sequence) -> int:
    """How many more tokens ``seq`` may get (its length limits): at most 1, and the next token
    sampled is its last, so no draft would be verified."""
    return min(seq.params.max_new_tokens - len(seq.output_ids), seq.max_total_len - seq.num_tokens)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


@hookimpl
def bi_register_strategies(register) -> None:
    register(MTPStrategy)
