from __future__ import annotations

import torch

from bi_core.backends.reference.dtypes import check_dtype
from bi_core.ops.sampling import (
    LogitsAdjust,
    SamplerOutput,
    SamplingBatch,
    SamplingBuilder,
    SamplingSpec,
    masked,
    with_logprob_temperatures,
)


def adjust_logits(row: torch.Tensor, adj: LogitsAdjust) -> torch.Tensor:
    """One float32 row's logits after its grammar's mask, min_tokens' mask and the penalties
    (``LogitsAdjust``): elementwise, from the row's own tokens, so a row's result never depends
    on its batch."""
    vocab, dev = row.shape[0], row.device
    if adj.allowed is not None:
        row = masked(row, adj.allowed)
    if adj.banned:
        row = row.index_fill(0, torch.tensor(adj.banned, device=dev), float("-inf"))
    if adj.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(adj.seen_ids, dtype=torch.long, device=dev)] = True
        r = adj.repetition_penalty
        scale = torch.where(row > 0, torch.tensor(1.0 / r, dtype=torch.float32, device=dev),
                            torch.tensor(r, dtype=torch.float32, device=dev))
        row = torch.where(seen, row * scale, row)
    if adj.frequency_penalty != 0.0 or adj.presence_penalty != 0.0:
        counts = torch.bincount(torch.tensor(adj.output_ids, dtype=torch.long, device=dev), minlength=vocab)
        if adj.frequency_penalty != 0.0:
            row = row - adj.frequency_penalty * counts.to(torch.float32)
        if adj.presence_penalty != 0.0:
            row = row - adj.presence_penalty * (counts > 0).to(torch.float32)
    return row


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Min-p, then top-k, then top-p (nucleus) filtering of one row (vLLM's order); removed
    entries become -inf."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < probs.max() * min_p, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def prepared_row(row: torch.Tensor, batch: SamplingBatch, i: int) -> torch.Tensor:
    """Row i's float32 logits as its draw reads them: adjusted (``adjust_logits``), then, when it
    samples at a temperature, divided by it and filtered (a greedy row takes the argmax of the
    adjusted logits; sampled ones draw Gumbel-max at temperature 1 from the result)."""
    adj = batch.adjust_of(i)
    if adj is not None:
        row = adjust_logits(row, adj)
    if batch.temperatures[i] == 0.0:
        return row
    return filter_logits(row / batch.temperatures[i], batch.top_ks[i], batch.top_ps[i], batch.min_p(i))


def gumbel_noise(key: int, size: int, device: torch.device) -> torch.Tensor:
    """Noise that depends only on the row's key: its own generator, never a shared one."""
    gen = torch.Generator(device=device)
    gen.manual_seed(key)
    u = torch.rand(size, generator=gen, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))


class ReferenceSamplerImpl:
    def sample_device(self, logits, keys, temperatures, masks=None) -> torch.Tensor:
        n = logits.shape[0]
        adjust = [LogitsAdjust(allowed=m) for m in masks.cpu()] if masks is not None else None
        batch = SamplingBatch(temperatures=temperatures.tolist(), top_ks=[0] * n, top_ps=[1.0] * n,
                              keys=keys.tolist(), num_logprobs=0, adjust=adjust)
        return self.forward(logits, batch).to_host().to(logits.device)

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs_all, num_logprobs, dim=-1)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs_all.gather(1, token_ids[:, None])[:, 0],
                             top_ids=top.indices, top_logprobs=top.values)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        logprobs_all = torch.log_softmax(logits, dim=-1)  # raw: what every row reports
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i in range(logits.shape[0]):
            row = prepared_row(logits[i], batch, i)
            if batch.temperatures[i] == 0.0:
                tokens[i] = torch.argmax(row)
                continue
            noise = gumbel_noise(batch.keys[i], row.shape[0], row.device)
            tokens[i] = torch.argmax(row + noise)
        top = torch.topk(logprobs_all, batch.num_logprobs, dim=-1)
        out = SamplerOutput(token_ids=tokens, logprobs=logprobs_all.gather(1, tokens[:, None])[:, 0],
                            top_ids=top.indices, top_logprobs=top.values)
        return with_logprob_temperatures(self, out, logits, batch, batch.num_logprobs)


class ReferenceSamplingBuilder(SamplingBuilder):
    def check(self, spec: SamplingSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: SamplingSpec) -> ReferenceSamplerImpl:
        return ReferenceSamplerImpl()
