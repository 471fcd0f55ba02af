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
are single-row."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from bi_core.config import EngineConfig
from bi_core.errors import ConfigError
from bi_core.hookspecs import hookimpl
from bi_core.runtime.scheduler import Scheduled
from bi_core.runtime.sequence import Sequence, Status
from bi_core.strategies.base import Strategy

DraftHook = Callable[[Sequence, list[int]], list[int]]


def num_speculative(config: EngineConfig) -> int:
    return config.strategy.num_speculative_tokens or 1


@attrs.define
class _Plan:
    """One sequence's part of a step: a verify (pending token + drafts, padded to 1+N) or a prompt
    chunk; filled in as the step goes (flat offset, then what the MTP head catches up over)."""

    seq: Sequence
    tokens: list[int]
    drafts: list[int] = attrs.field(factory=list)
    verify: bool = False
    recurrent: bool = False
    sample_rows: list[int] = attrs.field(factory=list)  # rows of ``tokens`` whose next token is sampled
    offset: int = 0  # first row in the step's flat batch
    mtp_start: int = 0  # position of the head's first catch-up row
    mtp_tokens: list[int] = attrs.field(factory=list)  # the token after each row (the head's input)
    draft_row: int = 0  # the catch-up row whose output proposes the first draft


class MTPStrategy(Strategy):
    name = "mtp"
    is_speculative = True

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
    def check(cls, engine) -> None:
        if engine.model.mtp is None and getattr(engine, "checkpoint_has_mtp", False):
            raise ConfigError("strategy.name", "the checkpoint has MTP head tensors (mtp.*) but its config.json "
                              "does not declare them: add \"mtp_num_hidden_layers\": 1 (to text_config, or the top "
                              "level of a text-only config)")
        if engine.model.mtp is None:
            raise ConfigError("strategy.name", "mtp needs a checkpoint with an MTP head (mtp.* tensors); "
                              "this model has none")
        verify = cls.decode_tokens_for(engine.config)
        limit = engine.scheduler.exact_step_tokens
        if engine.policy.batch_invariant and limit is not None and verify > limit:
            raise ConfigError("strategy.num_speculative_tokens", f"at most {limit - 1} with this model in invariant "
                              f"mode: its attention gives verify rows the bits of one-token decode steps only up to "
                              f"{limit} tokens per sequence (AttentionImpl.decode_query_len), and a verify step "
                              f"runs {verify}")

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.num_spec = num_speculative(engine.config)
        self.drafts: dict[int, list[int]] = {}
        self.draft_hook: DraftHook | None = None  # tests force drafts through this
        self.runner = engine.factory.build("graph_runner", attrs.evolve(engine.runner_spec, name="mtp"))

    # ------------------------------------------------------------------ one engine step

    def step(self, scheduled: list[Scheduled]) -> None:
        eng = self.engine
        plans = [self._plan(s) for s in scheduled]
        sample_positions = [[p.seq.num_computed + j + 1 for j in p.sample_rows] for p in plans]
        input_ids, ctx = eng.make_batch([p.tokens for p in plans], [p.seq for p in plans],
                                        [p.recurrent for p in plans], [p.sample_rows for p in plans],
                                        sample_positions=sample_positions)
        out = eng.run_model(input_ids, ctx)
        eng.record_scores(scheduled, out.hidden, ctx.cu_seqlens_host)
        row_seqs, positions = [], []
        for p, offset, sp in zip(plans, ctx.cu_seqlens_host, sample_positions):
            p.offset = offset
            row_seqs += [p.seq] * len(sp)
            positions += sp
        sampled = eng.sample_rows(row_seqs, positions, out.logits, out.samples) if row_seqs else []
        cursor, forks = 0, []
        for p in plans:
            if p.seq.followers and p.sample_rows:  # a leader's last prompt chunk: its samples fork here
                forks.append((p, cursor))
            self._accept(p, sampled[cursor:cursor + len(p.sample_rows)])
            cursor += len(p.sample_rows)
        self._propose(plans, out.hidden)
        self._fork(forks, out)

    def _fork(self, forks: list[tuple[_Plan, int]], out) -> None:
        """Fork each leader's other samples (after the head caught up over the leader's chunk, so
        the copied page holds its MTP KV too); then the head runs each sample's row at the last
        prompt position with the sample's own first token: its MTP KV there and its first draft."""
        plans = []
        for p, row in forks:
            for f in self.engine.fork(p.seq, out.logits[row]):
                if f.status is not Status.FINISHED:
                    plans.append(_Plan(f, [], offset=p.offset + len(p.tokens) - 1, mtp_start=len(f.prompt_ids) - 1,
                                       mtp_tokens=[f.output_ids[0]]))
        if plans:
            self._propose(plans, out.hidden)

    def capture_graphs(self) -> int:
        eng = self.engine
        hidden = torch.empty((0, eng.args.hidden_size), dtype=eng.dtype, device=eng.device)
        return super().capture_graphs() + self.runner.capture_all(
            self._mtp_step, eng.cache.block_size, eng.model.prepare_step, extra=hidden)

    def forget(self, seq) -> None:
        self.drafts.pop(seq.request_id, None)

    def _plan(self, s: Scheduled) -> _Plan:
        seq = s.seq
        if seq.is_decoding:
            remaining = min(seq.params.max_new_tokens - len(seq.output_ids), seq.max_total_len - seq.num_tokens)
            drafts = self.drafts.get(seq.request_id, [])[: max(0, min(self.num_spec, remaining - 1))]
            padding = [0] * (self.num_spec - len(drafts))  # KV and ring slots exist for them (lookahead)
            return _Plan(seq, [seq.all_ids[-1]] + drafts + padding, drafts=drafts, verify=True, recurrent=True,
                         sample_rows=list(range(1 + len(drafts))))
        tokens = seq.all_ids[seq.num_computed : seq.num_computed + s.num_tokens]
        last_chunk = seq.num_computed + len(tokens) == seq.num_tokens
        return _Plan(seq, tokens, recurrent=s.recurrent, sample_rows=[len(tokens) - 1] if last_chunk else [])

    def _accept(self, p: _Plan, sampled: list) -> None:
        seq, drafts = p.seq, p.drafts
        p.mtp_start = seq.num_computed
        if not p.verify:
            seq.num_computed += len(p.tokens)
            if sampled:
                token, lp, top = sampled[0]
                seq.append(token, lp, top, self.engine.eos_ids)
            # row j pairs the main hidden at mtp_start + j with the token at mtp_start + j + 1 (a
            # scoring request never drafts: no head rows)
            if seq.score_from is None:
                p.mtp_tokens = seq.all_ids[p.mtp_start + 1 : p.mtp_start + 1 + len(p.tokens)]
            p.draft_row = len(p.tokens) - 1
            return
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled[accepted][0]:
            accepted += 1
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_draft_tokens += accepted
        seq.num_verify_steps += 1 if drafts else 0
        for token, lp, top in sampled[: accepted + 1]:
            seq.append(token, lp, top, self.engine.eos_ids)
            if seq.status is Status.FINISHED:
                break
        seq.num_computed += accepted + 1  # t_n and the accepted drafts are now in the caches
        # sampled[j] is the token at mtp_start + j + 1 for j <= accepted; later rows only fill the step
        p.mtp_tokens = [t for t, _, _ in sampled] + [0] * (len(p.tokens) - len(sampled))
        p.draft_row = accepted

    # ------------------------------------------------------------------ the MTP head

    def _propose(self, plans: list[_Plan], hidden: torch.Tensor) -> None:
        """Catch the MTP head up over this step's rows, then chain drafts for decoding sequences."""
        eng = self.engine
        for p in plans:
            if p.seq.status is Status.FINISHED:
                self.drafts.pop(p.seq.request_id, None)
        # a finished leader still gets its head rows: its samples fork from its pages
        live = [p for p in plans if (p.seq.status is not Status.FINISHED or p.seq.followers) and p.mtp_tokens]
        if not live:
            return
        rows = [p.offset + j for p in live for j in range(len(p.mtp_tokens))]
        drafting = [i for i, p in enumerate(live) if p.seq.is_decoding and p.seq.status is not Status.FINISHED]
        wanted = set(drafting)
        m, first = self._mtp([p.mtp_tokens for p in live], [p.mtp_start for p in live], [p.seq for p in live],
                             hidden[torch.tensor(rows, device=eng.device)],
                             [[p.draft_row] if i in wanted else [] for i, p in enumerate(live)])
        if not drafting:
            return
        starts = [0, *_cumsum(len(p.mtp_tokens) for p in live)]
        last = m[torch.tensor([starts[i] + live[i].draft_row for i in drafting], device=eng.device)]
        positions = [live[i].mtp_start + live[i].draft_row for i in drafting]
        seqs = [live[i].seq for i in drafting]
        proposed = [[t] for t in first.tolist()]
        for _ in range(self.num_spec - 1):
            positions = [q + 1 for q in positions]
            last, nxt = self._mtp([[d[-1]] for d in proposed], positions, seqs, last, [[0]] * len(seqs))
            for d, t in zip(proposed, nxt.tolist()):
                d.append(t)
        for seq, d in zip(seqs, proposed):
            self.drafts[seq.request_id] = self.draft_hook(seq, d) if self.draft_hook else d

    def _mtp(self, tokens: list[list[int]], starts: list[int], seqs: list[Sequence], hidden: torch.Tensor,
             logits_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over ``tokens[i]`` at positions ``starts[i]...`` (its own KV cache, same pages):
        its output rows and the greedy draft of each ``logits_rows`` row. The head has no GDN layer,
        so every row is marked recurrent: any uniform step can replay a graph."""
        eng = self.engine
        ids, ctx = eng.make_batch(tokens, seqs, [True] * len(seqs), logits_rows, past_lens=starts, runner=self.runner)
        return self.runner.run(self._mtp_step, ids, ctx, eng.model.prepare_step, extra=hidden)

    def _mtp_step(self, ids: torch.Tensor, ctx, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.model.mtp_forward(ids, hidden, ctx, self.engine.cache.mtp)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


@hookimpl
def bi_register_strategies(register) -> None:
    register(MTPStrategy)
