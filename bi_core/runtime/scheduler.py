"""Continuous batching: admit, prefill in fixed chunks, decode, finish; preempt when pages run out.

Chunk boundaries of a prompt depend only on its own length and ``prefill_chunk_size`` (a chunk
never shrinks to fit leftover budget; it waits), so the arithmetic a request sees does not
depend on what else is queued. In invariant mode a request reserves its worst-case pages on
admission, so it is never preempted (recompute would re-run its decode tokens as a prefill).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import attrs

from bi_core.config import SchedulerConfig
from bi_core.runtime.cache import CacheManager
from bi_core.runtime.sequence import Sequence, Status

log = logging.getLogger(__name__)
PREEMPTION_LOG_INTERVAL_S = 10.0  # preemptions are reported as counts at most this often


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
        first (decode steps, a prompt's one-token last chunk), and an exact scoring request's
        continuation; otherwise the chunked form. Depends on the request alone."""
        seq = self.seq
        return seq.num_computed > 0 and (self.num_tokens == 1 or seq.in_exact_continuation)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, *, reserve_full: bool,
                 lookahead: int = 0, decode_tokens: int = 1, exact_step_tokens: int | None = None) -> None:
        self.config = config
        self.cache = cache
        self.reserve_full = reserve_full
        self.lookahead = lookahead  # extra KV slots a step may write past the known tokens (drafts)
        self.decode_tokens = decode_tokens  # tokens a decoding sequence's step runs (1 + drafts verified)
        # continuation tokens per step of an exact scoring request: as many as the attention op
        # runs with decode arithmetic (AttentionImpl.decode_query_len); None = a prefill chunk
        self.exact_step_tokens = exact_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._logged_preemptions, self._logged_at = 0, time.monotonic()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        if self.reserve_full:
            return self.cache.blocks_for(seq.max_total_len + self.lookahead) - len(seq.blocks)
        return max(0, self.cache.blocks_for(num_tokens + self.lookahead) - len(seq.blocks))

    def _chunk(self, seq: Sequence) -> int:
        """Tokens of the sequence the next step runs: chunks on a fixed grid (multiples of the
        chunk size from position 0) up to its end; an exact scoring request's prompt ends a chunk,
        as it did when the continuation was generated, and the continuation follows in steps of at
        most ``exact_step_tokens`` (decode arithmetic), or chunks."""
        end, size = seq.compute_end, self.config.chunk_size
        if seq.exact and seq.score_from is not None and seq.num_computed < seq.score_from:
            end = seq.score_from
        elif seq.in_exact_continuation and self.exact_step_tokens:
            size = min(size, self.exact_step_tokens)
        return min(size, end - seq.num_computed)

    def _cost(self, seq: Sequence, n: int) -> int:
        """Tokens this step runs for the sequence, counted against ``max_num_batched_tokens``."""
        return self.decode_tokens if seq.is_decoding else n

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        out: list[Scheduled] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.fork_pending:
                continue
            n = self._chunk(seq)
            cost = self._cost(seq, n)
            if cost > budget or not self._ensure_pages(seq, seq.num_computed + n, out):
                continue
            out.append(Scheduled(seq, n))
            budget -= cost
        while self.waiting:
            seq = self.waiting[0]
            group = [seq, *seq.followers]
            if len(self.running) + len(group) > self.config.max_num_seqs or len(group) > self.cache.slots.num_free:
                break
            hit = self._match(seq)
            n = self._chunk(seq)
            cost = self._cost(seq, n)
            needs = [self._pages_needed(seq, seq.num_computed + n), *map(self._follower_pages, seq.followers)]
            if cost > budget or not self.cache.reclaim(sum(needs)):
                if hit is not None:
                    self._unmatch(seq)
                break
            self.waiting.popleft()
            for member, need in zip(group, needs):
                member.state_slot, member.status = self.cache.slots.allocate(), Status.RUNNING
                member.blocks += self.cache.blocks.allocate(need)
                self.running.append(member)
            if self.cache.prefix is not None:
                self.cache.prefix.record(hit)
            if hit is not None:  # the GDN state at the hit, into the sequence's slot
                self.cache.copy_states([hit.snapshot], [self.cache.state_at(seq.state_slot, seq.num_computed)])
            out.append(Scheduled(seq, n))
            budget -= cost
        return out

    def plan_decode(self, continuing: list[Sequence], ending: list[Sequence]) -> list[Scheduled] | None:
        """The next step's schedule, made while the current decode step runs (its tokens not yet
        appended; ``ending``: its sequences that token ends by length, ``continuing``: the
        others), when it is certain: nothing waits, every running sequence is one of the two, and
        each continuing sequence decodes one token (pages taken now, never by preemption).
        What ``schedule`` would then return, in the same order; else None. A sequence that the
        token ends otherwise (a stop token) runs a wasted row in that step."""
        keep = {id(s) for s in continuing}
        if (self.waiting or not keep or keep | {id(s) for s in ending} != {id(s) for s in self.running}
                or len(continuing) * self.decode_tokens > self.config.max_num_batched_tokens):
            return None
        out = []
        for seq in self.running:
            if id(seq) not in keep:
                continue
            need = self._pages_needed(seq, seq.num_computed + 1)
            if need > 0:
                if not self.cache.reclaim(need):
                    return None
                seq.blocks += self.cache.blocks.allocate(need)
            out.append(Scheduled(seq, 1))
        return out

    def _match(self, seq: Sequence):
        """Start a fresh sequence at its longest cached prefix: the prefix's pages, shared (pinned
        before anything is evicted for the sequence's own pages); the caller restores the state."""
        prefix = self.cache.prefix
        if prefix is None or seq.num_computed > 0:
            return None
        limit = seq.compute_end - 1  # at least one token is computed (its logits are wanted)
        if seq.scored is not None:  # rows from the first scored position's predecessor on are wanted
            limit = min(limit, seq.scored[0] - 1)
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
        """Private pages a sample holds from admission: all it will need past the shared ones in
        invariant mode, else those up to its prompt's end."""
        tokens = f.max_total_len if self.reserve_full else len(f.prompt_ids)
        return self.cache.blocks_for(tokens + self.lookahead) - self.shared_pages(len(f.prompt_ids))

    def _ensure_pages(self, seq: Sequence, num_tokens: int, scheduled: list[Scheduled]) -> bool:
        need = self._pages_needed(seq, num_tokens)
        if need <= 0:  # most decode rows: the pages are there (in invariant mode, since admission)
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
        """Recompute-style preemption (default mode only): drop its cache, re-queue it first."""
        assert not self.reserve_full
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
        _forget_prefix(seq)
        for f in seq.followers:  # samples not yet forked wait with their leader
            self._release(f)
            f.status = Status.WAITING
        self.waiting.appendleft(seq)

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
