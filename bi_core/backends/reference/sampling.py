from __future__ import annotations

import torch

from bi_core.backends.reference.common import check_dtype
from bi_core.ops.sampling import SamplerOutput, SamplingBatch, SamplingBuilder, SamplingSpec


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of one row; removed entries become -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def gumbel_noise(key: int, size: int, device: torch.device) -> torch.Tensor:
    """Noise that depends only on the row's key: its own generator, never a shared one."""
    gen = torch.Generator(device=device)
    gen.manual_seed(key)
    u = torch.rand(size, generator=gen, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))


class ReferenceSamplerImpl:
    def sample_device(self, logits, keys, temperatures) -> torch.Tensor:
        n = logits.shape[0]
        batch = SamplingBatch(temperatures=temperatures.tolist(), top_ks=[0] * n, top_ps=[1.0] * n,
                              keys=keys.tolist(), num_logprobs=0)
        return self.forward(logits, batch).to_host().to(logits.device)

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs_all, num_logprobs, dim=-1)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs_all.gather(1, token_ids[:, None])[:, 0],
                             top_ids=top.indices, top_logprobs=top.values)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        logprobs_all = torch.log_softmax(logits, dim=-1)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        temps, top_ks, top_ps = batch.temperatures, batch.top_ks, batch.top_ps
        for i in range(logits.shape[0]):
            if temps[i] == 0.0:
                tokens[i] = torch.argmax(logits[i])
                continue
            row = filter_logits(logits[i] / temps[i], top_ks[i], top_ps[i])
            noise = gumbel_noise(batch.keys[i], row.shape[0], row.device)
            tokens[i] = torch.argmax(row + noise)
        top = torch.topk(logprobs_all, batch.num_logprobs, dim=-1)
        return SamplerOutput(
            token_ids=tokens,
            logprobs=logprobs_all.gather(1, tokens[:, None])[:, 0],
            top_ids=top.indices,
            top_logprobs=top.values,
        )


class ReferenceSamplingBuilder(SamplingBuilder):
    def check(self, spec: SamplingSpec, policy) -> list[str]:
        return check_dtype(spec)

    def build(self, spec: SamplingSpec) -> ReferenceSamplerImpl:
        return ReferenceSamplerImpl()
