"""The scheduler on hand-built sequences, no model: fixed chunks, room for every decode row and a
chunk, no starvation (a long prompt among decoding streams, many long prompts, a steady arrival of
short ones, n samples), preemption and the invariant rebuild's step shapes."""

from __future__ import annotations

import pytest
import torch

from bi_core.config import CacheConfig, SchedulerConfig
from bi_core.errors import ConfigError
from bi_core.models.presets import preset_args
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.scheduler import Scheduler, resolve_chunk_size
from bi_core.runtime.sequence import SamplingParams, Sequence, Status
from bi_core.runtime.step import Fork, SeqCommit, StepCommit

BLOCK = 16


def scheduler(*, seqs=8, budget=64, chunk=None, blocks=256, decode_tokens=1, exact_rebuild=False,
              exact_step_tokens=None, snapshots=0) -> Scheduler:
    cache = CacheManager(preset_args("tiny-dense"), CacheConfig(block_size=BLOCK, num_blocks=blocks), num_slots=seqs,
                         max_model_len=4096, dtype=torch.float32, device=torch.device("cpu"), with_mtp=False,
                         num_snapshots=snapshots)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, prefill_chunk_size=chunk)
    return Scheduler(cfg, cache, chunk_size=resolve_chunk_size(cfg, decode_tokens, BLOCK), decode_tokens=decode_tokens,
                     exact_rebuild=exact_rebuild, exact_step_tokens=exact_step_tokens)


class Sim:
    """Drives a scheduler as the engine does, through its one writer of sequence state: each
    scheduled sequence computes its tokens, one that reached its last known token samples one
    more (token 7; a leader's samples fork from it), finished ones leave."""

    def __init__(self, s: Scheduler) -> None:
        self.s, self.steps, self.next_id = s, 0, 0
        self.first_token_step: dict[int, int] = {}
        self.finish_step: dict[int, int] = {}
        self.log: list[list[tuple[int, int, int, bool]]] = []  # per step: (request id, from, tokens, recurrent)

    def add(self, prompt_len: int, max_new: int = 4, n: int = 1) -> Sequence:
        params = SamplingParams(max_new_tokens=max_new, n=n)
        seq = self._seq(prompt_len, params)
        seq.group = [seq]
        for _ in range(1, n):
            f = self._seq(prompt_len, params)
            f.leader = seq
            seq.followers.append(f)
            seq.group.append(f)
        self.s.add(seq)
        return seq

    def _seq(self, prompt_len: int, params: SamplingParams) -> Sequence:
        seq = Sequence(request_id=self.next_id, prompt_ids=list(range(prompt_len)), params=params, seed=0,
                       max_total_len=prompt_len + params.max_new_tokens)
        self.next_id += 1
        return seq

    def step(self) -> list:
        out = self.s.schedule()
        self.steps += 1
        self.log.append([(x.seq.request_id, x.seq.num_computed, x.num_tokens, x.recurrent) for x in out])
        assert sum(self.s.decode_tokens if x.seq.is_decoding else x.num_tokens for x in out) \
            <= self.s.config.max_num_batched_tokens
        commits, forks = [], []
        for x in out:
            seq = x.seq
            tokens = [(7, 0.0, None)] if x.samples else []
            commits.append(SeqCommit(seq, seq.num_computed, x.num_tokens, tokens, chunk=not seq.is_decoding,
                                     recurrent=x.recurrent))
            if tokens:
                self.first_token_step.setdefault(seq.request_id, self.steps)
                if seq.followers:
                    forks.append(Fork(seq, [(f, (7, 0.0, None)) for f in seq.followers]))
        self.s.update(StepCommit(commits))
        for f in self.s.fork(forks):
            self.first_token_step.setdefault(f.request_id, self.steps)
        for seq in list(self.s.running):
            if seq.status is Status.FINISHED:
                self.finish_step[seq.request_id] = self.steps
                self.s.finish(seq)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        while self.s.has_work():
            self.step()
            assert self.steps < max_steps, "the scheduler stopped making progress"


def decoding(sim: Sim, count: int, max_new: int) -> list[Sequence]:
    """``count`` short requests that have prefilled and are decoding."""
    seqs = [sim.add(8, max_new=max_new) for _ in range(count)]
    while not all(s.is_decoding for s in seqs):
        sim.step()
    return seqs


def test_default_chunk_leaves_room_for_every_decode_row_and_two_chunks():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    assert resolve_chunk_size(cfg, 1, BLOCK) == 16  # (64 - 4) / 2 = 30, in whole pages
    assert resolve_chunk_size(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192), 1, BLOCK) == 3968
    assert resolve_chunk_size(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192), 4, BLOCK) == 3584  # mtp
    assert resolve_chunk_size(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), 1, BLOCK) == 3
    assert resolve_chunk_size(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=60),
                              1, BLOCK) == 60


@pytest.mark.parametrize(("cfg", "decode_tokens", "message"), [
    (SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=61), 1,
     "scheduler.prefill_chunk_size: 61 does not fit beside the decode rows of scheduler.max_num_seqs=4 sequences "
     r"\(4 tokens of max_num_batched_tokens=64\): .* use at most 60"),
    (SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64), 1,
     "scheduler.max_num_batched_tokens: 64 leaves no room for a prompt chunk beside the decode rows of "
     r"scheduler.max_num_seqs=64 sequences \(1 token\(s\) each\); raise it above 64 or lower max_num_seqs"),
    (SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64), 4, "raise it above 64"),
])
def test_a_config_without_room_for_decode_rows_and_a_chunk_is_an_error(cfg, decode_tokens, message):
    with pytest.raises(ConfigError, match=message):
        resolve_chunk_size(cfg, decode_tokens, BLOCK)


def test_prefill_chunks_are_fixed_not_cut_to_fit_the_budget():
    sim = Sim(scheduler(seqs=4, budget=40, chunk=32))
    sim.add(70)
    sim.add(50)
    for _ in range(3):
        sim.step()
    # a's chunks 32, 32, 6 and b's 32 waits until it fits (8 tokens are left while a runs whole chunks)
    assert [[(r, n) for r, _, n, _ in step] for step in sim.log] == [[(0, 32)], [(0, 32)], [(0, 6), (1, 32)]]


def test_a_long_prompt_runs_while_streams_decode():
    """The issue's reproduction (tiny-moe, budget 64): four requests decoding 120 tokens, then a
    200-token prompt. Before, its chunk (the whole budget) never fitted beside the decode rows: its
    first token came after 121 steps, when all four had finished."""
    sim = Sim(scheduler(budget=64))
    streams = decoding(sim, 4, max_new=120)
    long = sim.add(200)
    start = sim.steps
    while long.request_id not in sim.first_token_step:
        sim.step()
    chunks = -(-200 // sim.s.chunk_size)
    assert sim.first_token_step[long.request_id] - start == chunks  # one chunk a step, every step
    assert all(s.status is Status.RUNNING for s in streams)  # the streams decoded all along
    assert all(len(s.output_ids) == 1 + chunks for s in streams)


def test_many_long_prompts_progress_side_by_side():
    sim = Sim(scheduler(budget=64))  # chunk 16: three fit beside four decode rows
    decoding(sim, 4, max_new=200)
    longs = [sim.add(160) for _ in range(3)]
    start = sim.steps
    sim.run()
    ttft = [sim.first_token_step[s.request_id] - start for s in longs]
    assert ttft == [10, 10, 10]  # 160 / 16 chunks each, all three in every step


def test_a_long_prompt_among_a_steady_arrival_of_short_ones():
    """A short request arrives every step. The long prompt, oldest, runs a chunk every step (they
    never starve it); the short ones run in the rest of each step (it never blocks them)."""
    sim = Sim(scheduler(seqs=16, budget=128))  # chunk 48
    decoding(sim, 4, max_new=300)
    long = sim.add(1000)
    start, shorts = sim.steps, []
    for _ in range(40):
        shorts.append((sim.add(12, max_new=5), sim.steps))
        sim.step()
    assert sim.first_token_step[long.request_id] - start == -(-1000 // sim.s.chunk_size)
    waits = [sim.first_token_step[s.request_id] - t for s, t in shorts if s.request_id in sim.first_token_step]
    assert len(waits) == 40 and max(waits) == 1  # each one's single chunk runs in the step it arrives


def test_a_long_prompt_behind_a_full_batch_waits_only_for_a_slot():
    sim = Sim(scheduler(seqs=4, budget=64))
    streams = decoding(sim, 4, max_new=10)
    long = sim.add(100)
    sim.run()
    freed = max(sim.finish_step[s.request_id] for s in streams)  # no slot until then (max_num_seqs=4)
    assert sim.first_token_step[long.request_id] == freed + 7  # then 100 / 16 chunks, one a step


def test_n_samples_of_a_long_prompt_start_together_beside_decoding_streams():
    sim = Sim(scheduler(budget=64))
    decoding(sim, 2, max_new=100)
    group = sim.add(96, n=4).group
    start = sim.steps
    sim.run()
    assert {sim.first_token_step[s.request_id] - start for s in group} == {96 // 16}


def test_mtp_verify_rows_and_a_chunk_share_every_step():
    sim = Sim(scheduler(budget=64, decode_tokens=4))  # 8 rows x 4 tokens leave 32: chunk 16
    decoding(sim, 6, max_new=80)
    long = sim.add(160)
    start = sim.steps
    sim.run()
    assert sim.s.chunk_size == 16 and sim.first_token_step[long.request_id] - start == 10


def test_invariant_preemption_rebuilds_generated_tokens_in_decode_arithmetic():
    """Pages run out: the youngest running sequence is preempted. With ``exact_rebuild`` (invariant
    mode) it recomputes its prompt in its own chunks and its generated tokens recurrent, at most
    ``exact_step_tokens`` a step; without (the negative control), as prompt chunks."""
    for exact in (True, False):
        sim = Sim(scheduler(seqs=4, budget=64, blocks=9, exact_rebuild=exact, exact_step_tokens=4))
        a, b = sim.add(40, max_new=60), sim.add(40, max_new=60)  # 100 tokens, 7 pages each: 9 do not hold both
        sim.run()
        assert sim.s.num_preemptions >= 1 and a.finish_reason == b.finish_reason == "length"
        victim = b if b.num_preemptions else a
        starts = [i for i, step in enumerate(sim.log) for r, start, _, _ in step if r == victim.request_id and start == 0]
        ran = [(n, rec) for step in sim.log[starts[-1]:] for r, _, n, rec in step if r == victim.request_id]
        if exact:  # the prompt's chunks (16, 16, 8), then the generated tokens 4 at a time, recurrent
            assert ran[:3] == [(16, False), (16, False), (8, False)] and (4, True) in ran
            assert all(rec for _, rec in ran[3:])
        else:  # generated tokens recomputed as chunks
            assert ran[:3] == [(16, False), (16, False), (16, False)]


def test_a_step_that_preempts_admits_nothing_from_the_queue():
    """Pages run out while a decode row grows: the youngest running request is preempted, and that
    step admits nothing from the queue, neither the victim (it would recompute at once what it
    just lost) nor a request behind it; the next step may. Before this rule the victim came back
    in the very step that preempted it."""
    sim = Sim(scheduler(seqs=4, budget=64, blocks=9))
    a, b = sim.add(40, max_new=60), sim.add(40, max_new=60)  # 100 tokens, 7 pages each: 9 do not hold both
    while sim.s.num_preemptions == 0:
        sim.step()
    victim = b if b.num_preemptions else a
    assert [r for r, *_ in sim.log[-1]] == [(a if victim is b else b).request_id]  # the decode row alone
    assert victim in sim.s.waiting
    sim.run()
    assert a.finish_reason == b.finish_reason == "length"
    steps = [i for i, step in enumerate(sim.log) if any(r == victim.request_id and start == 0 for r, start, _, _ in step)]
    assert len(steps) >= 2 and steps[1] > steps[0]  # re-admitted from 0, in a later step


# ---------------------------------------------------------------- the one writer of sequence state


def running(s: Scheduler, prompt_len: int, max_new: int = 8, **params) -> Sequence:
    """A request admitted and scheduled for its first chunk."""
    seq = Sequence(request_id=len(s.running) + len(s.waiting), prompt_ids=list(range(prompt_len)),
                   params=SamplingParams(max_new_tokens=max_new, **params), seed=0,
                   max_total_len=prompt_len + max_new)
    s.add(seq)
    assert any(x.seq is seq for x in s.schedule())
    return seq


def test_update_applies_tokens_until_one_ends_the_sequence():
    s = scheduler()
    seq = running(s, 8, stop_token_ids=(9,))
    s.update(StepCommit([SeqCommit(seq, 0, 8, [(5, -0.5, None)], chunk=True)]))
    assert (seq.num_computed, seq.output_ids, seq.token_logprobs) == (8, [5], [-0.5])
    assert s.num_prompt_tokens_computed == 8
    # a verify step: 3 drafts, 2 accepted, the stop token among the 3 new tokens ends it there
    s.update(StepCommit([SeqCommit(seq, 8, 3, [(6, -0.1, None), (9, -0.2, None), (4, -0.3, None)], drafts=3,
                                   accepted=2)]))
    assert seq.output_ids == [5, 6, 9] and seq.status is Status.FINISHED and seq.finish_reason == "stop"
    assert (seq.num_computed, seq.num_draft_tokens, seq.num_accepted_draft_tokens, seq.num_verify_steps) == (11, 3, 2, 1)
    assert s.num_prompt_tokens_computed == 8  # decode rows are not prompt work
    assert seq in s.running  # a finished sequence keeps its pages until finish()
    s.finish(seq)
    assert seq not in s.running and s.cache.num_pages_in_use == 0


def test_update_refuses_a_commit_from_the_wrong_position_and_skips_ended_sequences():
    s = scheduler()
    seq = running(s, 8)
    with pytest.raises(AssertionError, match="tokens are computed"):
        s.update(StepCommit([SeqCommit(seq, 4, 4, [], chunk=True)]))
    s.abort(seq)
    seq.finish("abort")
    s.update(StepCommit([SeqCommit(seq, 0, 8, [(1, 0.0, None)], chunk=True)]))  # a row that flew past its abort
    assert seq.num_computed == 0 and seq.output_ids == []


def test_update_records_scores_and_ends_a_scoring_request_after_its_last_row():
    s = scheduler()
    seq = Sequence(request_id=0, prompt_ids=list(range(10)), params=SamplingParams(max_new_tokens=1), seed=0,
                   max_total_len=10, score_from=6)
    s.add(seq)
    (x,) = s.schedule()
    assert x.num_tokens == 9  # everything but the last token (nothing comes after it)
    s.update(StepCommit([SeqCommit(seq, 0, 9, chunk=True)], scores=[(seq, -1.0, {6: -1.0}), (seq, -2.0, {7: -2.0})]))
    assert seq.scored_logprobs == [-1.0, -2.0] and seq.scored_top == [{6: -1.0}, {7: -2.0}]
    assert seq.status is Status.FINISHED and seq.finish_reason == "length"


def test_fork_shares_whole_pages_and_copies_the_last_prompt_page():
    s = scheduler()
    sim = Sim(s)
    leader = sim.add(40, max_new=4, n=3)
    while leader.num_computed < 40:
        sim.step()
    fs = leader.group[1:]
    shared = s.shared_pages(40)  # pages wholly before the last prompt token
    assert shared == 2 and all(f.leader is None and f.num_computed == 40 and f.output_ids == [7] for f in fs)
    assert all(f.blocks[:shared] == leader.blocks[:shared] for f in fs)  # by reference
    assert len({f.blocks[shared] for f in fs} | {leader.blocks[shared]}) == 3  # the last prompt page copied
    sim.run()
    assert s.cache.num_pages_in_use == 0 and s.cache.slots.num_free == 8


# ---------------------------------------------------------------- the prefix cache, through the scheduler


def test_a_cached_prefix_is_found_again_on_the_chunk_grid():
    """Whole chunks on the grid enter the cache with a GDN snapshot at their end; a later request
    with the same prompt starts at the longest such prefix, on the shared pages, with the
    snapshot's state, and runs the chunks a cold prefill runs from there."""
    from bi_core.runtime.prefix_cache import PrefixCache

    s = scheduler(chunk=16, snapshots=4)
    cache = s.cache
    cache.prefix = PrefixCache(cache, grid=16, snapshot_slots=cache.snapshot_slots)
    sim = Sim(s)
    a = sim.add(40, max_new=2)
    sim.run()
    assert a.finish_reason == "length" and len(cache.prefix.nodes) == 2  # two whole chunks; the 8-token tail is not
    cache.main.recurrent[0][cache.snapshot_slots] = 3.0  # the snapshots' states, to see them restored
    b = sim.add(40, max_new=2)
    sim.step()  # admission
    assert b.num_cached_tokens == 32 and sim.log[-1] == [(b.request_id, 32, 8, False)]
    assert b.blocks[:2] == [n.page for n in cache.prefix.match(a, 39).nodes]
    assert bool((cache.main.recurrent[0][cache.state_at(b.state_slot, 32)] == 3.0).all())
    c = sim.add(40 - 1, max_new=2)  # a different prompt length: the same first 32 tokens, a hit too
    sim.step()
    assert c.num_cached_tokens == 32
    sim.run()
    assert cache.num_pages_in_use == 0 and cache.prefix.hits == 2


class CountingQueue(__import__("collections").deque):
    """The scheduler's queue, counting the requests a step reads from it."""

    reads = 0

    def __iter__(self):
        for seq in super().__iter__():
            CountingQueue.reads += 1
            yield seq

    def __getitem__(self, i):
        CountingQueue.reads += 1
        return super().__getitem__(i)


def test_a_step_reads_the_queue_only_as_far_as_it_admits():
    """RL rollouts queue thousands of requests: a step that scanned and sorted the whole queue took
    18 ms of host time at 20,000 queued (CPU engine) and ran the decode steps host-bound."""
    sim = Sim(scheduler(seqs=4, budget=64, blocks=4096))
    streams = decoding(sim, 4, max_new=50)  # a full batch
    sim.s.waiting = CountingQueue(sim.s.waiting)
    queued = [sim.add(8) for _ in range(3000)]
    CountingQueue.reads = 0
    for _ in range(5):
        sim.step()
    assert CountingQueue.reads <= 5 * 3  # the first request finds no slot: admissions stop
    assert all(s.status is Status.RUNNING for s in streams) and queued[0].status is Status.WAITING


def test_the_queue_keeps_request_order_whatever_joins_it():
    s = scheduler()
    seqs = [Sequence(request_id=i, prompt_ids=[1] * 8, params=SamplingParams(max_new_tokens=2), seed=0,
                     max_total_len=10) for i in range(6)]
    for i in (1, 3, 5):
        s.add(seqs[i])
    held = s.hold(lambda q: q.request_id != 3)  # RL pause: 3 waits outside the queue
    s.add(seqs[0])  # an older id (as a preempted request re-enters the queue)
    s.add(seqs[4])
    s.release(held)
    assert [q.request_id for q in s.waiting] == [0, 1, 3, 4, 5]


def test_a_step_passes_over_at_most_max_num_seqs_queued_prompts_that_do_not_fit():
    """Slots are free but the budget is not: each queued prompt whose chunk does not fit what is
    left costs a prefix lookup, and a step that tried all of a 5,000-deep queue of long prompts
    spent 31 ms on the host (CPU engine). It passes over max_num_seqs of them, then admits no more
    this step."""
    sim = Sim(scheduler(seqs=16, budget=64, blocks=4096))
    decoding(sim, 3, max_new=50)  # 3 decode rows: 61 tokens left, three 16-token chunks, 13 over
    sim.s.waiting = CountingQueue(sim.s.waiting)
    queued = [sim.add(600) for _ in range(500)]
    CountingQueue.reads = 0
    out = sim.step()
    assert sim.s.chunk_size == 16 and [x.seq for x in out if not x.seq.is_decoding] == queued[:3]
    assert CountingQueue.reads <= 3 + 16 + 1
