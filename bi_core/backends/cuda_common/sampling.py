"""GPU sampler: one Triton program per (row, vocabulary chunk) then one per row (greedy or
Gumbel-max with Philox keyed by the row's key, reading the logits in their own dtype, over the
tokens the row's grammar mask allows where it has one: a structured output's rows ride the same
launch); rows with penalties, min_tokens' mask or min-p/top-k/top-p (a grammar's mask too, then)
get their logits prepared row by row first (``prepared_row``) and drawn again by the same kernel. Without top-N logprobs the
kernel writes the (token, logprob) pairs the host reads back in one transfer."""

from __future__ import annotations

import torch

from bi_core.backends.reference.sampling import prepared_row
from bi_core.ops.sampling import SamplerOutput, SamplingBatch, with_logprob_temperatures


class CudaSamplerImpl:
    def sample_device(self, logits, keys, temperatures, masks=None) -> torch.Tensor:
        from bi_core.kernels.sampling import sample

        return sample(logits, keys, temperatures.float(), masks)[2]

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
        from bi_core.kernels.sampling import sample

        rows = logits.shape[0]
        greedy = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        _, lse, _ = sample(logits, torch.zeros(rows, dtype=torch.int64, device=logits.device), greedy)
        # the sampled token's logprob is ``float(logit) - lse`` (kernel and ``forward`` alike)
        logits = logits.float()
        top = torch.topk(logits, num_logprobs, dim=-1)
        return SamplerOutput(token_ids=token_ids, logprobs=logits.gather(1, token_ids[:, None])[:, 0] - lse,
                             top_ids=top.indices, top_logprobs=top.values - lse[:, None])

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        from bi_core.kernels.sampling import sample

        dev = logits.device
        keys = torch.tensor(batch.keys, dtype=torch.int64).to(dev, non_blocking=True)
        temps = torch.tensor(batch.temperatures, dtype=torch.float32).to(dev, non_blocking=True)
        masks = mask_rows = None
        only = [i for i in range(logits.shape[0]) if batch.mask_only(i)]
        if only:  # rows whose only change is their grammar's mask: drawn with it by the same kernel
            masks = batch.grammar_masks(only).to(dev, non_blocking=True)
            at = [-1] * logits.shape[0]
            for k, i in enumerate(only):
                at[i] = k
            mask_rows = torch.tensor(at, dtype=torch.int32).to(dev, non_blocking=True)
        tokens, lse, packed = sample(logits, keys, temps, masks, mask_rows)
        prepared = [i for i in range(logits.shape[0]) if not batch.is_plain(i) and not batch.mask_only(i)]
        n = batch.num_logprobs
        if not prepared and n == 0 and batch.logprob_temperatures is None and batch.masked_logprobs is None:
            empty = torch.empty((logits.shape[0], 0), device=dev)
            return SamplerOutput(token_ids=tokens, logprobs=packed[:, 1].float(), top_ids=empty.long(),
                                 top_logprobs=empty, packed=packed)
        logits = logits.float()
        if prepared:
            # Row by row, so a row's filtering never runs a batched kernel whose shape depends on the
            # batch; drawn greedy (temperature 0) or at temperature 1 (prepared rows are divided by theirs)
            rows = torch.stack([prepared_row(logits[i], batch, i) for i in prepared])
            idx = torch.tensor(prepared, device=dev)
            temps = torch.tensor([0.0 if batch.temperatures[i] == 0.0 else 1.0 for i in prepared],
                                 dtype=torch.float32).to(dev, non_blocking=True)
            tokens[idx] = sample(rows, keys[idx], temps)[0]
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - lse  # raw: the sampled token under the model's distribution
        top = torch.topk(logits, n, dim=-1)
        out = SamplerOutput(token_ids=tokens, logprobs=logprobs, top_ids=top.indices,
                            top_logprobs=top.values - lse[:, None])
        return with_logprob_temperatures(self, out, logits, batch, n)
