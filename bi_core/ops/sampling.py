"""Sampling: greedy, temperature, top-k, top-p, with per-request (seed, position) randomness,
plus the log-probabilities of the model's raw distribution."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec


@attrs.frozen(kw_only=True)
class SamplingSpec(OpSpec):
    vocab_size: int


@attrs.define
class SamplingBatch:
    """Per-row parameters (host lists); row i's randomness comes only from ``keys[i]``, which is
    ``mix_seed(request seed, position of the token being sampled)``."""

    temperatures: list[float]  # 0 = greedy
    top_ks: list[int]  # 0 = off
    top_ps: list[float]  # 1 = off
    keys: list[int]
    num_logprobs: int  # top-N logprobs to return (0 = only the sampled token's)

    def needs_filter(self, i: int) -> bool:
        return needs_filter(self.temperatures[i], self.top_ks[i], self.top_ps[i])


def needs_filter(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether a row's sample needs top-k / top-p filtering (the row-by-row sampler, not the step's)."""
    return temperature > 0 and (top_k > 0 or top_p < 1.0)


def device_sampled(seqs) -> bool:
    """Whether a step's own device samples (greedy or plain temperature, token and its logprob)
    serve these requests: none wants top-k/top-p filtering or top-N logprobs."""
    return not any(s.params.logprobs or needs_filter(s.params.temperature, s.params.top_k, s.params.top_p)
                   for s in seqs)


@attrs.define
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log p(token) under the raw (temperature 1) distribution
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

    def sample_device(self, logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """Greedy / plain-temperature sampling with per-row keys and temperatures already on the
        device (capturable in a CUDA graph): ``[B, 2]`` float64 rows (token, logprob), the same
        values ``forward`` gives for those rows without top-k/top-p or top-N logprobs."""


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
