"""Sampling: greedy, temperature, min-p, top-k, top-p, repetition / frequency / presence
penalties, min_tokens and a structured output's grammar mask, with per-request (seed, position)
randomness, plus the log-probabilities of the model's raw distribution (vLLM's default
``raw_logprobs``: penalties, masks and filters choose the token, never change the logprobs
reported), or where a request asks, of its distribution at its temperature and/or after its
grammar's mask.

A row's arithmetic is its own (G1): the adjustments are elementwise over the row's logits, from
the row's own tokens and parameters; the filters run row by row."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class SamplingSpec(OpSpec):
    vocab_size: int


@attrs.define(eq=False)
class LogitsAdjust:
    """What changes one row's raw logits before it is sampled (greedy too), in vLLM's order:
    the tokens its grammar forbids to -inf (``allowed``, a structured output's bitmask),
    ``banned`` ids to -inf (min_tokens: the stop ids and EOS), the repetition penalty on every
    token in ``seen_ids`` (prompt and output: a positive logit divided by it, i.e. multiplied by
    its float32 reciprocal, any other multiplied), then ``frequency_penalty`` times each token's
    count in ``output_ids`` and ``presence_penalty`` once per distinct one subtracted (OpenAI's
    definition)."""

    banned: tuple[int, ...] = ()
    seen_ids: list[int] = attrs.Factory(list)  # read only with a repetition penalty
    output_ids: list[int] = attrs.Factory(list)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # int32 [ceil(V / 32)] on the host, bit t % 32 of word t // 32 set where token t is allowed; None: all
    allowed: torch.Tensor | None = None

    @property
    def only_masks(self) -> bool:
        """Whether the grammar's mask is all it changes (no ban, no penalty)."""
        return (not self.banned and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0)


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """A grammar's bitmask (``LogitsAdjust.allowed``) as ``[vocab]`` booleans on ``device``."""
    bits = torch.arange(32, dtype=torch.int32, device=device)
    return ((bitmask.to(device)[:, None] >> bits) & 1).reshape(-1)[:vocab].bool()


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """One row's logits with the tokens its grammar forbids at -inf (elementwise: the row's own)."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1], logits.device), float("-inf"))


@attrs.define
class SamplingBatch:
    """Per-row parameters (host lists); row i's randomness comes only from ``keys[i]``, which is
    ``mix_seed(request seed, position of the token being sampled)``."""

    temperatures: list[float]  # 0 = greedy
    top_ks: list[int]  # 0 = off
    top_ps: list[float]  # 1 = off
    keys: list[int]
    num_logprobs: int  # top-N logprobs to return (0 = only the sampled token's)
    min_ps: list[float] | None = None  # 0 = off; None: off for every row
    adjust: list[LogitsAdjust | None] | None = None  # None: no row's logits are adjusted
    # per row, the temperature its reported logprobs are at (SamplingParams.logprob_temperature);
    # None: every row's are the raw distribution's
    logprob_temperatures: list[float] | None = None
    # per row, whether its reported logprobs are of the distribution after its grammar's mask
    # (SamplingParams.masked_logprobs, on a row with a mask); None: no row's are
    masked_logprobs: list[bool] | None = None

    def reports_raw(self, i: int) -> bool:
        """Whether row i's reported logprobs are the raw distribution's."""
        return ((self.logprob_temperatures is None or self.logprob_temperatures[i] == 1.0)
                and (self.masked_logprobs is None or not self.masked_logprobs[i]))

    def needs_filter(self, i: int) -> bool:
        return needs_filter(self.temperatures[i], self.top_ks[i], self.top_ps[i], self.min_p(i))

    def min_p(self, i: int) -> float:
        return self.min_ps[i] if self.min_ps is not None else 0.0

    def adjust_of(self, i: int) -> LogitsAdjust | None:
        return self.adjust[i] if self.adjust is not None else None

    def is_plain(self, i: int) -> bool:
        """Whether row i is sampled by the step's own arithmetic (no filter, no adjustment)."""
        return not self.needs_filter(i) and self.adjust_of(i) is None

    def mask_only(self, i: int) -> bool:
        """Whether row i's only change is its grammar's mask (no filter, penalty or ban): the
        batched sampler draws it with the mask (``grammar_masks``), as a step's device samples do."""
        a = self.adjust_of(i)
        return a is not None and a.allowed is not None and a.only_masks and not self.needs_filter(i)

    def grammar_masks(self, rows: list[int]) -> torch.Tensor:
        """The masks of ``rows`` (mask-only rows) stacked, int32 ``[len(rows), ceil(V / 32)]`` on the host."""
        return torch.stack([self.adjust_of(i).allowed for i in rows])


def needs_filter(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> bool:
    """Whether a row's sample needs min-p / top-k / top-p filtering (the row-by-row sampler, not
    the step's); greedy rows never do (each filter keeps the top token)."""
    return temperature > 0 and (top_k > 0 or top_p < 1.0 or min_p > 0.0)


def adjusts_logits(seq) -> bool:
    """Whether a sequence's next samples change its logits (penalties, a grammar, or min_tokens
    not reached: its tokens up to now are the ones before the first row a step samples for it)."""
    p = seq.params
    return p.has_penalties or p.structured is not None or len(seq.output_ids) < p.min_tokens


def masks_only(seq) -> bool:
    """Whether a sequence's next samples change its logits by its grammar's mask alone (no
    penalty, no min_tokens ban) and report the raw distribution's logprobs: its device sample can
    be drawn with the mask (``ModelRunner.mask_samples``)."""
    p = seq.params
    return (p.structured is not None and not p.has_penalties and len(seq.output_ids) >= p.min_tokens
            and not p.masked_logprobs)


def device_sampled(seqs, masked: bool = False) -> bool:
    """Whether a step's own device samples (greedy or plain temperature, token and its raw logprob)
    serve these requests: none wants filtering, adjusted logits, top-N logprobs or logprobs at its
    temperature. ``masked``: the samples of the rows whose only change is a grammar's mask were
    drawn with it (``ModelRunner.mask_samples``), so those rows are served too."""
    return not any(s.params.logprobs or (adjusts_logits(s) and not (masked and masks_only(s)))
                   or s.params.logprob_temperature != 1.0
                   or needs_filter(s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p)
                   for s in seqs)


def at_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``float32(logits) / T`` per row (``temperatures`` ``[B]``): the logits whose log-softmax is a
    request's distribution at its temperature. The sampler's ``logprobs_of`` of these is what a
    ``logprobs_mode="temperature"`` request reports; a trainer computing the same two steps gets
    those bits (``bi_core.train``)."""
    return logits.float() / temperatures.to(device=logits.device, dtype=torch.float32)[:, None]


def with_logprob_temperatures(sampler, out: SamplerOutput, logits: torch.Tensor, batch: SamplingBatch,
                              num_logprobs: int) -> SamplerOutput:
    """``out`` with the rows whose logprobs are not the raw distribution's computed again by
    ``sampler.logprobs_of``, top-N too: from ``at_temperature`` logits (a row's
    ``logprob_temperatures``), of the row's logits after its grammar's mask where it asks for the
    masked distribution (``masked_logprobs``: the mask, then the temperature)."""
    rows = [i for i in range(logits.shape[0]) if not batch.reports_raw(i)]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    chosen = logits[idx].float()
    for k, i in enumerate(rows):
        if batch.masked_logprobs is not None and batch.masked_logprobs[i]:
            chosen[k] = masked(chosen[k], batch.adjust_of(i).allowed)
    temps = batch.logprob_temperatures
    scaled = at_temperature(chosen, torch.tensor([temps[i] if temps else 1.0 for i in rows], dtype=torch.float32))
    again = sampler.logprobs_of(scaled, out.token_ids[idx], num_logprobs)
    logprobs, top_ids, top_lps = out.logprobs.clone(), out.top_ids.clone(), out.top_logprobs.clone()
    logprobs[idx], top_ids[idx], top_lps[idx] = again.logprobs, again.top_ids, again.top_logprobs
    return SamplerOutput(token_ids=out.token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps)


@attrs.define
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log p(token) under the raw distribution (or the row's other one)
    top_ids: torch.Tensor  # [B, N] int64
    top_logprobs: torch.Tensor  # [B, N] float32
    packed: torch.Tensor | None = None  # [B, 2] float64 (token, logprob) when the impl made it (N = 0)

    def to_host(self) -> torch.Tensor:
        """``[B, 2 + 2N]`` float64 on the host (token ids < 2**53 are exact): one transfer."""
        if self.packed is not None and self.top_ids.shape[1] == 0:
            return self.packed.cpu()
        return torch.cat([self.token_ids[:, None].double(), self.logprobs[:, None].double(),
                          self.top_ids.double(), self.top_logprobs.double()], dim=1).cpu()


class SamplerImpl(Protocol):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits [B, V]`` (any float dtype) -> one token per row."""

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
        """Scoring: the log-probabilities of given tokens (``token_ids [B]``) under the raw
        distribution of each row, with the arithmetic ``forward`` uses for a sampled token's (so a
        scored token's logprob equals, bitwise, the one reported when it was sampled from the same
        logits), plus the top-N of each row."""

    def sample_device(self, logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor,
                      masks: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy / plain-temperature sampling with per-row keys and temperatures already on the
        device (capturable in a CUDA graph): ``[B, 2]`` float64 rows (token, logprob), the same
        values ``forward`` gives for those rows without top-k/top-p or top-N logprobs. ``masks``:
        int32 ``[B, ceil(V / 32)]`` on the device, row i's grammar bitmask (token and raw logprob
        then as ``forward`` gives a mask-only row)."""


class SamplingBuilder(OpBuilder[SamplingSpec]):
    op = "sampling"


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed from (request seed, position): splitmix64, so neighbours are unrelated."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` (0..n-1) of a request with ``n`` samples: sample 0 uses the
    request's seed, sample i > 0 the seed mixed with i (splitmix64, as positions are). So sample
    0 equals the same request sent with n=1, sample i the request sent alone with this seed, and
    no two samples share a random stream."""
    return seed if sample == 0 else mix_seed(seed, sample)
