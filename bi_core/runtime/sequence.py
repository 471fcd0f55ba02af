"""Requests as the user sees them (SamplingParams, RequestOutput) and as the engine tracks them."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import attrs
import numpy as np

from bi_core.runtime.detokenize import TextStream
from bi_core.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from bi_core.runtime.multimodal import MultimodalPrompt
    from bi_core.structured.grammars import GrammarState

__all__ = ["RequestOutput", "SamplingParams", "ScoreOutput", "Sequence", "Status", "request_output"]


@attrs.frozen(kw_only=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    # log p of each generated token under the model's raw distribution: before penalties, min_tokens'
    # mask, temperature and filters (vLLM's default logprobs_mode, raw_logprobs); top-N likewise
    token_logprobs: list[float]
    logprobs: list[dict[int, float]] | None  # per step: top-N and the sampled token
    finish_reason: str | None  # stop | length | abort | error
    error: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_preemptions: int = 0  # times its cache was dropped for space and recomputed (default mode)
    num_accepted_draft_tokens: int = 0
    num_draft_tokens: int = 0
    num_verify_steps: int = 0  # speculative steps that verified at least one draft
    weight_version: int = 0  # the engine's weights that made it (engine.update_weights calls before it)
    # with SamplingParams.prompt_logprobs: [None, then per prompt token {token: logprob, top-N...}]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    sample_index: int = 0  # which of the prompt's n samples this is
    num_cached_tokens: int = 0  # prompt tokens whose KV and state came from the prefix cache
    samples: list[RequestOutput] | None = None  # with n > 1: all n samples of the prompt, in order
    # with SamplingParams.return_routed_experts: int16 [positions, moe layers, top_k], one row per
    # position that ran through the model (the prompt, then every generated token but the last)
    routed_experts: np.ndarray | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """The prompt's samples: ``samples`` when n > 1, else this result alone."""
        return self.samples if self.samples is not None else [self]

    @property
    def draft_acceptance(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_verify_steps if self.num_verify_steps else None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_total_len: int  # prompt + generated tokens never exceed this
    output_ids: list[int] = attrs.field(factory=list)
    token_logprobs: list[float] = attrs.field(factory=list)
    top_logprobs: list[dict[int, float]] = attrs.field(factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV / GDN state is in the cache
    blocks: list[int] = attrs.field(factory=list)
    state_slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0
    num_preemptions: int = 0
    text: TextStream | None = None  # incremental text, when the caller asked for it or for stop strings
    stop_reason: str | int | None = None
    weight_version: int = 0
    # scoring (engine.score): prompt_ids holds prompt + continuation; the logprobs of the tokens
    # from ``score_from`` on are wanted, in decode arithmetic when ``exact``
    score_from: int | None = None
    exact: bool = False
    score_top: int = 0  # top-N logprobs per scored token
    # invariant mode: a sequence preempted after it generated tokens recomputes them in decode
    # arithmetic (as exact scoring does), so it resumes with the caches it had
    rebuild: bool = False
    scored_logprobs: list[float] = attrs.field(factory=list)  # per scored position, in order
    scored_top: list[dict[int, float]] = attrs.field(factory=list)
    # n samples: the first (the leader) prefills; the others wait attached to it (``leader`` set,
    # holding their state slot and private pages) and are forked from it when it samples its first
    # token; ``group`` (on the leader) lists all n in sample order
    sample_index: int = 0
    leader: Sequence | None = None
    followers: list[Sequence] = attrs.field(factory=list)
    group: list[Sequence] = attrs.field(factory=list)
    # prefix caching: its pages in the cache's trie run up to ``prefix_end`` tokens (node ``prefix_node``)
    prefix_node: object = None
    prefix_end: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    routed: list[np.ndarray] = attrs.field(factory=list)  # routing replay: [n, layers, k] blocks, in position order
    num_routed: int = 0  # positions they cover, from 0
    # structured outputs: its own grammar matcher, derived from its output tokens (never shared)
    grammar: GrammarState | None = None
    # LoRA: the adapter version pinned at admission (its slot and engine-unique id; -1 / 0: none)
    lora_slot: int = -1
    lora_uid: int = 0
    # its grammar's compile while it runs (the request waits in the queue, never admitted before)
    grammar_ready: Future | None = None
    # images and videos (runtime/multimodal.py's MultimodalPrompt): positions, embeddings, cache keys
    mm: MultimodalPrompt | None = None

    def record_routing(self, start: int, rows: np.ndarray) -> None:
        """The expert ids of positions ``start...`` (a recompute after preemption replaces what
        it had from ``start`` on: the same ids on an invariant backend)."""
        if start < self.num_routed:
            self.routed = [np.concatenate(self.routed)[:start]] if start else []
            self.num_routed = start
        assert start == self.num_routed, f"routing of position {start} recorded after {self.num_routed} positions"
        self.routed.append(rows)
        self.num_routed += len(rows)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list:
        """``all_ids`` as the prefix cache keys them: a vision token as its image's content hash
        and place (placeholder ids alone would match any image of that size)."""
        return self.all_ids if self.mm is None else self.mm.key_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a decode step reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scored(self) -> tuple[int, int] | None:
        """Positions ``[lo, hi)`` whose token's logprob is wanted (scoring, or prompt logprobs)."""
        if self.score_from is not None:
            return self.score_from, len(self.prompt_ids)
        if self.params.prompt_logprobs is not None:
            return 1, len(self.prompt_ids)
        return None

    @property
    def fork_pending(self) -> bool:
        """A sample waiting for its leader's prefill; it runs no step of its own until forked."""
        return self.leader is not None

    @property
    def compute_end(self) -> int:
        """Tokens whose KV / state a step computes: all known ones, but a scoring request's last
        token (nothing comes after it)."""
        return self.num_tokens - 1 if self.score_from is not None else self.num_tokens

    @property
    def decode_from(self) -> int | None:
        """The position from which its known tokens run in decode arithmetic (recurrent GDN,
        decode-form attention) rather than as prompt chunks: an exact scoring request's
        continuation, a rebuilt sequence's generated tokens; None for any other."""
        if self.exact and self.score_from is not None:
            return self.score_from
        return len(self.prompt_ids) if self.rebuild else None

    @property
    def in_exact_continuation(self) -> bool:
        """Past ``decode_from``: its steps run in the decode (recurrent) form."""
        start = self.decode_from
        return start is not None and self.num_computed >= start

    @property
    def is_decoding(self) -> bool:
        """Past its prompt with everything but the last sampled token in the caches."""
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1

    def at_length(self, more: int = 0) -> bool:
        """Whether it has (with ``more`` tokens appended: will have) reached its length limit;
        known before those tokens are (overlapped decode plans the step after the next token)."""
        return len(self.output_ids) + more >= self.params.max_new_tokens or self.num_tokens + more >= self.max_total_len

    def append(self, token: int, logprob: float, top: dict[int, float] | None, eos_ids: tuple[int, ...]) -> None:
        self.output_ids.append(token)
        self.token_logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        stops = self.params.stop_token_ids + (() if self.params.ignore_eos else eos_ids)
        # min_tokens: nothing stops it before that many tokens came (the sampler banned the stop ids
        # and EOS until then; a stop string is matched only in text that a later token completes)
        may_stop = len(self.output_ids) > self.params.min_tokens
        # a grammar ends at a stop token or EOS where it may end, and the request with it (ignore_eos too)
        by_grammar = self.grammar is not None and self.grammar.ended_by(self.output_ids)
        by_token = may_stop and (token in stops or by_grammar)
        if self.grammar is not None and self.grammar.rejected is not None:
            self.finish("error", f"structured outputs: token {self.grammar.rejected} is not allowed by the request's "
                                 "grammar (an engine bug: the sampler masks what the grammar forbids)")
            return
        if self.text is not None and (self.params.include_stop_str_in_output or not by_token):
            self.text.feed(token, match=may_stop)  # a stop token's text is dropped, as vLLM does
        if by_token:
            self.stop_reason = token
            self.finish("stop")
        elif self.text is not None and self.text.stop_reason is not None:
            self.stop_reason = self.text.stop_reason
            self.finish("stop")
        elif self.at_length():
            self.finish("length")

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        if self.text is not None:
            self.text.flush()


@attrs.frozen(kw_only=True)
class ScoreOutput:
    """The logprobs of a continuation after a prompt (``LLMEngine.score``)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # the continuation
    token_logprobs: list[float]  # log p of each continuation token given everything before it
    logprobs: list[dict[int, float]] | None  # per token: top-N and the token itself (when asked for)
    exact: bool
    weight_version: int = 0
    error: str | None = None

    @classmethod
    def of(cls, s: Sequence | str, exact: bool) -> ScoreOutput:
        if not isinstance(s, Sequence):
            return cls(request_id=-1, prompt_token_ids=[], token_ids=[], token_logprobs=[], logprobs=None,
                       exact=exact, error=s)
        cut = s.score_from
        return cls(request_id=s.request_id, prompt_token_ids=s.prompt_ids[:cut], token_ids=s.prompt_ids[cut:],
                   token_logprobs=list(s.scored_logprobs), logprobs=list(s.scored_top) if s.score_top else None,
                   exact=s.exact, weight_version=s.weight_version, error=s.error)


def output_text(s: Sequence, tokenizer) -> str:
    """A sequence's text decoded at once, as its ``TextStream`` would give it: without the stop
    token that ended it (unless ``include_stop_str_in_output``), with its decode options."""
    ids = s.output_ids
    if s.finish_reason == "stop" and isinstance(s.stop_reason, int) and not s.params.include_stop_str_in_output:
        ids = ids[:-1]
    return tokenizer.decode(ids, **s.params.decode_options)


def request_output(s: Sequence, tokenizer) -> RequestOutput:
    """A sequence's result as the user sees it (also while it runs)."""
    text = s.text.text if s.text is not None else output_text(s, tokenizer) if tokenizer else None
    return RequestOutput(
        request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=list(s.output_ids), text=text,
        token_logprobs=list(s.token_logprobs), logprobs=list(s.top_logprobs) if s.params.logprobs is not None else None,
        finish_reason=s.finish_reason, error=s.error, stop_reason=s.stop_reason, num_preemptions=s.num_preemptions,
        num_accepted_draft_tokens=s.num_accepted_draft_tokens, num_draft_tokens=s.num_draft_tokens,
        num_verify_steps=s.num_verify_steps, weight_version=s.weight_version,
        prompt_logprobs=[None, *s.scored_top] if s.params.prompt_logprobs is not None else None,
        sample_index=s.sample_index, num_cached_tokens=s.num_cached_tokens,
        routed_experts=np.concatenate(s.routed) if s.params.return_routed_experts and s.routed else None)
