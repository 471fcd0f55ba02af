"""A training batch laid out the way the engine computed its tokens.

The engine computes a completion's logprobs in two arithmetics: the prompt in prompt chunks on a
fixed grid (multiples of ``scheduler.prefill_chunk_size`` from position 0: GDN in the chunked form,
attention's prompt kernel), the completion in decode form (GDN recurrent, attention's decode
kernel in steps of at most ``decode_query_len`` tokens, the exact scoring steps). Every other op
computes a row from that row alone. So one forward over a whole batch gets every token's bits:

- rows in canonical order, per sequence its prompt, then its completion but the last token (the
  inputs whose logits give completion tokens 1..C-1; the prompt's last row gives token 0);
- one attention call over all rows: prompt chunks as prompt sequences, completions as
  decode-form pieces of ``decode_tokens`` rows, all sharing their sequence's pages (every key is
  written before any row attends, as in a verify step);
- GDN calls in order: prompt chunk 0 of every sequence, chunk 1 of those that have one, ..., then
  every completion as one recurrent sequence (the recurrent kernel walks a sequence's tokens in
  one program, with the arithmetic of one-token steps).

A prompt's one-token last chunk after the first runs in decode form, as the engine runs it (the
engine's rule, ``runtime.step.runs_recurrent``).

``plan_batch`` and ``upload`` (``runtime/batch.py``) turn each call's sequences into a
ForwardContext, as they do for the engine's steps."""

from __future__ import annotations

import attrs
import torch

from bi_core.errors import RequestError
from bi_core.ops.context import ForwardContext
from bi_core.runtime.batch import plan_batch, upload
from bi_core.runtime.step import runs_recurrent


@attrs.frozen
class GdnCall:
    """One GDN op call of the forward: ``rows`` of the canonical batch, in ``ctx``'s order."""

    rows: torch.Tensor  # [n] int64
    ctx: ForwardContext


@attrs.define(eq=False)
class TrainContext:
    """What a training forward's ops read (passed down as the model's ``ctx``)."""

    input_ids: torch.Tensor  # [T] canonical rows
    positions: torch.Tensor  # [T]
    spans: list[tuple[int, int]]  # canonical rows of each sequence
    attention: ForwardContext
    gdn: list[GdnCall]
    logits_indices: torch.Tensor  # [R] rows whose logits give the completion tokens, in order
    targets: torch.Tensor  # [R] the completion tokens
    completion_lens: list[int]
    num_blocks: int  # KV pages the batch needs (plus one scratch page)
    logits_all_rows: bool = False
    step_tensors: dict = attrs.field(factory=dict)
    lora_slots: torch.Tensor | None = None  # [T] (ForwardContext's): the adapter's slot per row (PolicyModel.plan)


def _check(prompts: list[list[int]], completions: list[list[int]], vocab_size: int, max_len: int) -> None:
    if len(prompts) != len(completions):
        raise RequestError(f"token_logprobs: {len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise RequestError("token_logprobs: the batch is empty")
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not p or not c:
            raise RequestError(f"token_logprobs: sequence {i} has an empty {'prompt' if not p else 'completion'}")
        if len(p) + len(c) > max_len:
            raise RequestError(f"token_logprobs: sequence {i} has {len(p)} + {len(c)} tokens, more than "
                               f"model.max_model_len={max_len}")
        bad = [t for t in (*p, *c) if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token_logprobs: sequence {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


def plan_train(prompts: list[list[int]], completions: list[list[int]], *, chunk_size: int, decode_tokens: int | None,
               block_size: int, vocab_size: int, max_len: int, device: torch.device) -> TrainContext:
    """The contexts of one training forward over (prompt, completion) pairs of token ids."""
    prompts, completions = [list(map(int, p)) for p in prompts], [list(map(int, c)) for c in completions]
    _check(prompts, completions, vocab_size, max_len)
    ids, positions, spans, logits_rows, blocks = [], [], [], [], []
    page = 0
    for p, c in zip(prompts, completions):
        start, n = len(ids), len(p) + len(c) - 1
        ids += p + c[:-1]
        positions += range(n)
        spans.append((start, start + n))
        logits_rows += range(start + len(p) - 1, start + n)
        pages = -(-n // block_size)
        blocks.append(list(range(page, page + pages)))
        page += pages
    lens = [(len(p), len(c) - 1) for p, c in zip(prompts, completions)]
    attention = _attention_context(prompts, completions, lens, blocks, chunk_size, decode_tokens, block_size, device)
    gdn = _gdn_calls(prompts, completions, lens, spans, blocks, chunk_size, block_size, device)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
    return TrainContext(as_tensor(ids), as_tensor(positions), spans, attention, gdn, as_tensor(logits_rows),
                        as_tensor([t for c in completions for t in c]), [len(c) for c in completions], page + 1)


def _recurrent_chunk(start: int, prompt_len: int, chunk_size: int) -> bool:
    """Whether the engine runs the prompt chunk at ``start`` in decode form (``Scheduled.recurrent``)."""
    return runs_recurrent(start, min(prompt_len, start + chunk_size) - start)


def _attention_context(prompts, completions, lens, blocks, chunk_size, decode_tokens, block_size,
                       device) -> ForwardContext:
    """Every sequence's prompt chunks as prompt sequences, then its completion rows as decode-form
    pieces, each at its positions over the sequence's pages (rows in canonical order)."""
    tokens, past, blk, slots, recurrent = [], [], [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rest = c[:-1]
        step = decode_tokens or max(1, len(rest))
        pieces = [(p[a:a + chunk_size], a, _recurrent_chunk(a, len(p), chunk_size)) for a in range(0, len(p), chunk_size)]
        pieces += [(rest[a:a + step], len(p) + a, True) for a in range(0, len(rest), step)]
        for ids, start, rec in pieces:
            tokens.append(ids)
            past.append(start)
            blk.append(blocks[i])
            slots.append(i)
            recurrent.append(rec)
    return upload(plan_batch(tokens, past, blk, slots, recurrent, block_size=block_size), device)[1]


def _gdn_calls(prompts, completions, lens, spans, blocks, chunk_size, block_size, device) -> list[GdnCall]:
    """Prompt chunk k of every sequence that has one (k = 0, 1, ...), then the completions."""
    calls = []
    for k in range(max(-(-len(p) // chunk_size) for p in prompts)):
        members = [i for i, p in enumerate(prompts) if len(p) > k * chunk_size]
        pieces = [(i, k * chunk_size, min(len(prompts[i]), (k + 1) * chunk_size)) for i in members]
        recurrent = [_recurrent_chunk(a, len(prompts[i]), chunk_size) for i, a, _ in pieces]
        calls.append(_gdn_call(pieces, prompts, completions, spans, blocks, recurrent, block_size, device))
    tails = [(i, lens[i][0], lens[i][0] + lens[i][1]) for i in range(len(prompts)) if lens[i][1]]
    if tails:
        calls.append(_gdn_call(tails, prompts, completions, spans, blocks, [True] * len(tails), block_size, device))
    return calls


def _gdn_call(pieces, prompts, completions, spans, blocks, recurrent, block_size, device) -> GdnCall:
    seq_ids = [(prompts[i] + completions[i][:-1])[a:b] for i, a, b in pieces]
    rows = [r for i, a, b in pieces for r in range(spans[i][0] + a, spans[i][0] + b)]
    hb = plan_batch(seq_ids, [a for _, a, _ in pieces], [blocks[i] for i, _, _ in pieces], [i for i, _, _ in pieces],
                    recurrent, block_size=block_size)
    return GdnCall(torch.tensor(rows, dtype=torch.int64, device=device), upload(hb, device)[1])
