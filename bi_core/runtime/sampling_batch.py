"""The sampler's per-row inputs (``SamplingBatch``) from the sequences a step samples: each row's
parameters, its (seed, position) key, and what changes its logits (a structured output's grammar
mask, min_tokens' mask, penalties), from the request's own tokens before the position it samples
and nothing else."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from bi_core.ops.sampling import LogitsAdjust, SamplingBatch, mix_seed
from bi_core.runtime.sequence import Sequence


def sampling_batch(seqs: list[Sequence], positions: list[int], num_logprobs: int, eos_ids: tuple[int, ...],
                   vocab_size: int, before: Seq[Seq[int]] | None = None) -> SamplingBatch:
    """Row i samples the token of ``seqs[i]`` at ``positions[i]``; ``before[i]``: the tokens
    between the sequence's known ones and that position (an MTP verify row's drafts before it:
    the row's sample is kept only where they are all accepted, i.e. where they are the tokens
    AR would have had there)."""
    adjust = [row_adjust(s, p, before[i] if before is not None else (), eos_ids, vocab_size)
              for i, (s, p) in enumerate(zip(seqs, positions))]
    temps = [s.params.logprob_temperature for s in seqs]
    masked = [s.params.masked_logprobs and a is not None and a.allowed is not None for s, a in zip(seqs, adjust)]
    return SamplingBatch(temperatures=[s.params.temperature for s in seqs], top_ks=[s.params.top_k for s in seqs],
                         top_ps=[s.params.top_p for s in seqs], keys=[mix_seed(s.seed, p) for s, p in zip(seqs, positions)],
                         num_logprobs=num_logprobs, min_ps=[s.params.min_p for s in seqs],
                         adjust=adjust if any(a is not None for a in adjust) else None,
                         logprob_temperatures=temps if any(t != 1.0 for t in temps) else None,
                         masked_logprobs=masked if any(masked) else None)


def row_adjust(seq: Sequence, position: int, before: Seq[int], eos_ids: tuple[int, ...],
               vocab_size: int) -> LogitsAdjust | None:
    """What changes the logits of ``seq``'s token at ``position``, or None. A structured output's
    grammar allows what may follow the output tokens before ``position`` (``seq.grammar``). Before
    min_tokens generated tokens its stop ids and EOS are banned (vLLM masks EOS under ignore_eos
    too); the penalties count the output tokens before ``position`` (the repetition penalty the
    prompt's too)."""
    p = seq.params
    num_prompt = len(seq.prompt_ids)
    generated = position - num_prompt  # output tokens before this one
    drafts = list(before[:max(0, generated - len(seq.output_ids))])  # the ones past the known output
    allowed = None
    if seq.grammar is not None:
        known = seq.output_ids if generated >= len(seq.output_ids) else seq.output_ids[:generated]
        allowed = seq.grammar.mask(known, drafts)
    banned: tuple[int, ...] = ()
    if generated < p.min_tokens:
        banned = tuple(t for t in dict.fromkeys(p.stop_token_ids + tuple(eos_ids)) if 0 <= t < vocab_size)
    if not banned and not p.has_penalties and allowed is None:
        return None
    output: list[int] = []
    if p.has_penalties:
        output = seq.output_ids[:generated] + drafts
    seen = seq.prompt_ids + output if p.repetition_penalty != 1.0 else []
    return LogitsAdjust(banned=banned, seen_ids=seen, output_ids=output, repetition_penalty=p.repetition_penalty,
                        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty, allowed=allowed)
