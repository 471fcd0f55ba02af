"""Continuous batching: admit, prefill in fixed chunks, decode, finish; preempt when pages run out.

Chunk boundaries of a prompt depend only on its own length and the chunk size (a chunk never
shrinks to fit leftover budget; it waits), so the arithmetic a request sees does not depend on
what else is queued. A step runs every decoding sequence's row first, then prompt chunks, the
oldest request first; a chunk that does not fit in what is left waits while shorter ones behind
it run. The chunk size leaves room for all ``max_num_seqs`` decode rows plus a whole chunk
(``resolve_chunk_size``), so the oldest prompt runs in every step: no request starves, and no
decode row waits for a prompt.

Preemption (pages run out): the sequence's cache is dropped and it is queued again, first. In
default mode it recomputes prompt and generated tokens as prompt chunks. In invariant mode
(``exact_rebuild``) its prompt runs in its own chunks and its generated tokens in decode
arithmetic (``Sequence.rebuild``, the exact-scoring path), so it resumes with the caches it had:
the same bits as the request run alone.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from bi_core.config import SchedulerConfig
from bi_core.errors import ConfigError
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.sequence import Sequence, Status
from bi_core.runtime.step import Fork, Scheduled, StepCommit

log = logging.getLogger(__name__)
PREEMPTION_LOG_INTERVAL_S = 10.0  # preemptions are reported as counts at most this often


def resolve_chunk_size(config: SchedulerConfig, decode_tokens: int, block_size: int) -> int:
    """The prefill chunk size: ``prefill_chunk_size`` if set, else half of what the decode rows of
    ``max_num_seqs`` sequences (``decode_tokens`` each) leave of ``max_num_batched_tokens``, in
    whole KV pages (so two prompts progress side by side and the chunk grid is the prefix cache's).
    Raises when a step could not hold every decode row and one whole chunk: a prompt would then
    wait until the decoding streams drain."""
    decode = config.max_num_seqs * decode_tokens
    room = config.max_num_batched_tokens - decode
    if room < 1:
        raise ConfigError("scheduler.max_num_batched_tokens", f"{config.max_num_batched_tokens} leaves no room for a "
                          f"prompt chunk beside the decode rows of scheduler.max_num_seqs={config.max_num_seqs} "
                          f"sequences ({decode_tokens} token(s) each); raise it above {decode} or lower max_num_seqs")
    if config.prefill_chunk_size is not None:
        if config.prefill_chunk_size > room:
            raise ConfigError("scheduler.prefill_chunk_size", f"{config.prefill_chunk_size} does not fit beside the "
                              f"decode rows of scheduler.max_num_seqs={config.max_num_seqs} sequences ({decode} "
                              f"tokens of max_num_batched_tokens={config.max_num_batched_tokens}): prompts would "
                              f"wait until decoding streams finish; use at most {room}, or raise "
                              "max_num_batched_tokens")
        return config.prefill_chunk_size
    half = room // 2
    return half - half % block_size if half >= block_size else max(1, half)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, *, chunk_size: int, exact_rebuild: bool = False,
                 lookahead: int = 0, decode_tokens: int = 1, exact_step_tokens: int | None = None,
                 eos_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.eos_ids = eos_ids  # end a sequence unless its params ignore them
        self.cache = cache
        self.chunk_size = chunk_size  # from resolve_chunk_size
        self.exact_rebuild = exact_rebuild  # invariant mode: preempted sequences rebuild in decode arithmetic
        self.lookahead = lookahead  # extra KV slots a step may write past the known tokens (drafts)
        self.decode_tokens = decode_tokens  # tokens a decoding sequence's step runs (1 + drafts verified)
        # continuation tokens per step of an exact scoring request: as many as the attention op
        # runs with decode arithmetic (AttentionImpl.decode_query_len); None = a prefill chunk
        self.exact_step_tokens = exact_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens the model ran (not cached, not shared by n samples)
        self._logged_preemptions, self._logged_at = 0, time.monotonic()

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the queue, which stays in request-id order (admission order): a new request goes
        last, a preempted or released one to its place."""
        if not self.waiting or self.waiting[-1].request_id < seq.request_id:
            self.waiting.append(seq)
        else:
            self.waiting.insert(bisect.bisect(self.waiting, seq.request_id, key=lambda s: s.request_id), seq)

    def hold(self, keep) -> list[Sequence]:
        """Take the queued requests for which ``keep(seq)`` is False out of the queue (RL pause
        mode ``wait``: what has not started waits); returns them for ``release``."""
        held = [s for s in self.waiting if not keep(s)]
        for s in held:
            self.waiting.remove(s)
        return held

    def release(self, held: list[Sequence]) -> None:
        """Queue requests ``hold`` took out again, each at its place in request-id order."""
        for seq in held:
            self._enqueue(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.cache.blocks_for(num_tokens + self.lookahead) - len(seq.blocks))

    def _chunk(self, seq: Sequence) -> int:
        """Tokens of the sequence the next step runs: chunks on a fixed grid (multiples of the
        chunk size from position 0) up to its end; a prompt that continues in decode arithmetic
        (``Sequence.decode_from``: exact scoring, a rebuild) ends a chunk there, as it did when
        those tokens were generated, and what follows runs in steps of at most
        ``exact_step_tokens`` (decode arithmetic), or chunks."""
        end, size, start = seq.compute_end, self.chunk_size, seq.decode_from
        if start is not None and seq.num_computed < start:
            end = start
        elif start is not None and self.exact_step_tokens:
            size = min(size, self.exact_step_tokens)
        return min(size, end - seq.num_computed)

    def schedule(self) -> list[Scheduled]:
        """The next step: every decoding sequence's row, then prompt chunks (``_prefill``). A step
        that preempted admits nothing from the queue (as vLLM's scheduler): its pages were short,
        and the preempted request would otherwise come straight back to recompute what it lost."""
        budget = self.config.max_num_batched_tokens
        preempted = self.num_preemptions
        out: list[Scheduled] = []
        for seq in list(self.running):  # a decode row counts decode_tokens (1 + drafts verified)
            if seq.status is Status.RUNNING and not seq.fork_pending and seq.is_decoding:
                n = self._chunk(seq)
                if self._ensure_pages(seq, seq.num_computed + n, out):
                    out.append(Scheduled(seq, n))
                    budget -= self.decode_tokens
        self._prefill(out, budget, preempted)
        return out

    def _prefill(self, out: list[Scheduled], budget: int, preempted: int) -> None:
        """Prompt chunks (and scoring continuations, rebuilds) in the budget the decode rows left:
        running and waiting requests in arrival order (request id; a preempted request keeps its
        own), each its next chunk if that fits in what is left, else it waits and the ones behind
        it go on (of the queue, up to max_num_seqs passed over in a step). A waiting request that
        cannot get its pages or a slot stops admissions for this step (first come, first served
        under memory pressure), as does a preemption in this step (``preempted``: the count before
        it); running ones still go on."""
        partial = sorted((s for s in self.running if s.status is Status.RUNNING and not s.fork_pending
                          and not s.is_decoding), key=lambda s: s.request_id)
        # the queue is in request-id order: merge it with the partial prompts, and stop reading it
        # once admissions stop or the budget is spent (a scan of the whole queue each step grew
        # with the queue until a deep one held up every step on the host)
        admitting, p, i, passed = True, 0, 0, 0
        while True:
            admitting = admitting and self.num_preemptions == preempted
            w = self.waiting[i] if admitting and budget > 0 and i < len(self.waiting) else None
            if p < len(partial) and (w is None or partial[p].request_id < w.request_id):
                seq, p = partial[p], p + 1
                n = self._chunk(seq)
                if seq.status is Status.RUNNING and n <= budget and self._ensure_pages(seq, seq.num_computed + n, out):
                    out.append(Scheduled(seq, n))
                    budget -= n
            elif w is None:
                return
            else:
                n = self._admit(w, budget)  # an admitted request leaves the queue: the next is at i
                if n is None:
                    admitting = False
                elif n:
                    out.append(Scheduled(w, n))
                    budget -= n
                else:  # its chunk does not fit what is left: the ones behind it go on, up to
                    # max_num_seqs of them a step (each is a prefix lookup: a step that tried every
                    # long prompt of a deep queue held up the device on the host)
                    i, passed = i + 1, passed + 1
                    admitting = passed < self.config.max_num_seqs

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Admit a waiting request (with its n-sample group) if its first chunk fits in ``budget``:
        the chunk's tokens; 0 if it must wait for budget; None if it must wait for a slot or pages."""
        if seq.grammar_ready is not None:  # its grammar still compiles: the ones behind it go on
            return 0
        if seq.mm is not None and seq.mm.embeds is None:  # its images are still encoded (runtime/vision_encode.py)
            return 0
        group = [seq, *seq.followers]
        if len(self.running) + len(group) > self.config.max_num_seqs or len(group) > self.cache.slots.num_free:
            return None
        hit = self._match(seq)
        n = self._chunk(seq)
        needs = [self._pages_needed(seq, seq.num_computed + n), *map(self._follower_pages, seq.followers)]
        fits = n <= budget
        if not fits or not self.cache.reclaim(sum(needs)):
            if hit is not None:
                self._unmatch(seq)
            return 0 if not fits else None
        self.waiting.remove(seq)
        for member, need in zip(group, needs):
            member.state_slot, member.status = self.cache.slots.allocate(), Status.RUNNING
            member.blocks += self.cache.blocks.allocate(need)
            self.running.append(member)
        if self.cache.prefix is not None:
            self.cache.prefix.record(hit)
        if hit is not None:  # the GDN state at the hit, into the sequence's slot
            self.cache.copy_states([hit.snapshot], [self.cache.state_at(seq.state_slot, seq.num_computed)])
        return n

    def plan_decode(self, continuing: list[Sequence], ending: list[Sequence]) -> list[Scheduled] | None:
        """The next step's schedule, made while the current decode step runs (not yet committed:
        each sequence's ``num_computed`` is one short and its token not appended; ``ending``: its
        sequences that token ends by length, ``continuing``: the others), when it is certain:
        nothing that waits can be admitted (nothing waits, or the batch is full and no sequence
        ends by length: RL's steady state, a queue behind a full batch), every running sequence
        is one of the two, and each continuing sequence decodes one token (pages taken now, never
        by preemption).
        What ``schedule`` would then return, in the same order; else None. A sequence that the
        token ends otherwise (a stop token, an abort) runs a wasted row in that step, and a
        request waiting for its slot is admitted a step later."""
        keep = {id(s) for s in continuing}
        full = len(self.running) >= self.config.max_num_seqs or not self.cache.slots.num_free
        if ((self.waiting and (ending or not full)) or not keep
                or keep | {id(s) for s in ending} != {id(s) for s in self.running}
                or len(continuing) * self.decode_tokens > self.config.max_num_batched_tokens):
            return None
        out = []
        for seq in self.running:
            if id(seq) not in keep:
                continue
            need = self._pages_needed(seq, seq.num_computed + 2)  # the running step's token, then this one
            if need > 0:
                if not self.cache.reclaim(need):
                    return None
                seq.blocks += self.cache.blocks.allocate(need)
            out.append(Scheduled(seq, 1))
        return out

    # ------------------------------------------------------------------ the one writer of sequence state

    def update(self, commit: StepCommit) -> None:
        """Apply what a step did: tokens computed, new tokens (until one ends the sequence), draft
        counts, scored logprobs, prompt progress, prefix-cache inserts (a chunk on the chunk grid,
        continuing what the sequence already cached, with the GDN state after it), and the end of
        a scoring request whose last scored row has run. Finished sequences keep their pages
        until ``finish`` (their samples may still fork from them)."""
        prefix = self.cache.prefix
        for c in commit.seqs:
            seq = c.seq
            if seq.status is not Status.RUNNING:  # aborted, or ended, while the step was in flight
                continue
            assert seq.num_computed == c.start, f"request {seq.request_id}: a commit from {c.start}, " \
                                                f"but {seq.num_computed} tokens are computed"
            seq.num_computed = end = c.start + c.computed
            if c.routed is not None:
                seq.record_routing(c.start, c.routed)
            seq.num_draft_tokens += c.drafts
            seq.num_accepted_draft_tokens += c.accepted
            seq.num_verify_steps += 1 if c.drafts else 0
            for token, lp, top in c.tokens:
                seq.append(token, lp, top, self.eos_ids)
                if seq.status is Status.FINISHED:
                    break
            if not c.chunk:
                continue
            self.num_prompt_tokens_computed += max(0, min(end, len(seq.prompt_ids)) - c.start)
            if (prefix is not None and not c.recurrent and seq.state_slot is not None and c.start == seq.prefix_end
                    and prefix.cacheable(c.start, end)):
                prefix.insert(seq, end, self.cache.state_at(seq.state_slot, end))
            if seq.score_from is not None and end >= seq.compute_end and seq.status is Status.RUNNING:
                seq.finish("length")
        for seq, lp, entry in commit.scores:
            seq.scored_logprobs.append(lp)
            seq.scored_top.append(entry)

    def fork(self, forks: list[Fork]) -> list[Sequence]:
        """Give each leader's waiting samples what a lone prefill of the prompt computes: the
        shared pages (wholly before the last prompt token) by reference, the page holding the
        last prompt token and the GDN states by copy, the leader's scored logprobs, and their
        own first token. Call once the leader's last prompt chunk (and, with MTP, the head over
        it) has run. Returns the forked samples."""
        forked = []
        for fork in forks:
            leader, fs = fork.leader, [f for f, _ in fork.first]
            leader.followers = []
            prompt_len = len(leader.prompt_ids)
            shared = self.shared_pages(prompt_len)
            self.cache.copy_pages([leader.blocks[shared]] * len(fs), [f.blocks[0] for f in fs])
            self.cache.copy_states([self.cache.state_at(leader.state_slot, prompt_len)] * len(fs),
                                   [self.cache.state_at(f.state_slot, prompt_len) for f in fs])
            for f, (token, lp, top) in fork.first:
                f.blocks = self.cache.blocks.share(leader.blocks[:shared]) + f.blocks
                f.leader, f.num_computed = None, prompt_len
                f.scored_logprobs, f.scored_top = list(leader.scored_logprobs), list(leader.scored_top)
                f.routed, f.num_routed = list(leader.routed), leader.num_routed  # the prompt ran once
                f.append(token, lp, top, self.eos_ids)
            forked += fs
        return forked

    # ------------------------------------------------------------------ prefix cache

    def _match(self, seq: Sequence):
        """Start a fresh sequence at its longest cached prefix: the prefix's pages, shared (pinned
        before anything is evicted for the sequence's own pages); the caller restores the state."""
        prefix = self.cache.prefix
        if prefix is None or seq.num_computed > 0:
            return None
        limit = seq.compute_end - 1  # at least one token is computed (its logits are wanted)
        if seq.scored is not None:  # rows from the first scored position's predecessor on are wanted
            limit = min(limit, seq.scored[0] - 1)
        if seq.decode_from is not None:  # past it the cache holds chunked-form states, not decode-form ones
            limit = min(limit, seq.decode_from)
        hit = prefix.match(seq, limit)
        if hit is None:
            return None
        seq.blocks = self.cache.blocks.share([node.page for node in hit.nodes])
        seq.num_computed = seq.num_cached_tokens = seq.prefix_end = hit.tokens
        seq.prefix_node = hit.nodes[-1]
        return hit

    def _unmatch(self, seq: Sequence) -> None:
        """Undo ``_match`` for a sequence that must wait after all."""
        self.cache.blocks.release(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        _forget_prefix(seq)

    def shared_pages(self, prompt_len: int) -> int:
        """Pages of a prompt its n samples share: those wholly before the last prompt token (the
        page holding it is copied, as the MTP head's KV at that position depends on the sample)."""
        return (prompt_len - 1) // self.cache.block_size

    def _follower_pages(self, f: Sequence) -> int:
        """Private pages a sample holds from admission: those up to its prompt's end past the shared ones."""
        return self.cache.blocks_for(len(f.prompt_ids) + self.lookahead) - self.shared_pages(len(f.prompt_ids))

    def _ensure_pages(self, seq: Sequence, num_tokens: int, scheduled: list[Scheduled]) -> bool:
        need = self._pages_needed(seq, num_tokens)
        if need <= 0:  # most decode rows: the pages are there
            return True
        while not self.cache.reclaim(need):
            victim = next((s for s in reversed(self.running) if s is not seq and not s.fork_pending and
                           all(x.seq is not s for x in scheduled)), None)
            if victim is None:
                return False
            self._preempt(victim)
        seq.blocks += self.cache.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Drop its cache and queue it again, first; it recomputes what it had (see the module doc)."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        now = time.monotonic()
        if now - self._logged_at >= PREEMPTION_LOG_INTERVAL_S or self._logged_preemptions == 0:
            log.warning("KV cache full: %d preemption(s) since the last report (%d in total); preempted "
                        "requests are recomputed. More cache.num_blocks or fewer scheduler.max_num_seqs avoid them",
                        self.num_preemptions - self._logged_preemptions, self.num_preemptions)
            self._logged_preemptions, self._logged_at = self.num_preemptions, now
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.rebuild = seq.rebuild or (self.exact_rebuild and bool(seq.output_ids))
        _forget_prefix(seq)
        for f in seq.followers:  # samples not yet forked wait with their leader
            self._release(f)
            f.status = Status.WAITING
        self._enqueue(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.blocks.release(seq.blocks)
        seq.blocks = []
        if seq.state_slot is not None:
            self.cache.slots.release(seq.state_slot)
            seq.state_slot = None

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self._release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is; its pages and state slot are free for the next step. A
        sample not yet forked leaves its leader's group."""
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
            seq.leader = None
        if seq in self.running:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_pages_used(self) -> int:
        return self.cache.num_pages_in_use


def _forget_prefix(seq: Sequence) -> None:
    """The sequence no longer starts from (or continues) a cached prefix."""
    seq.prefix_node, seq.prefix_end, seq.num_cached_tokens = None, 0, 0
