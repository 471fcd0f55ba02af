"""Grammar masks as a device input of the batched sampler (structured outputs).

A step's constrained rows are sampled on the device like plain rows, then drawn again with their
grammar's token bitmask (xgrammar's int32 layout) by the same sampler, reading the step's logits:
``DeviceMasks.apply`` fills the masks on the host, from grammar states that have every committed
token, while the device still runs the step's forward (a fresh step was just launched; a step
launched ahead runs while the previous one is committed), into a pinned staging buffer, copies
them without blocking into a persistent device buffer (fixed address, one row per logits row a
graph samples), and queues the masked draw behind the forward and before the samples' copy to
the host and any step launched ahead from them. A row's draw reads only its own logits, key and
mask, so its token and logprob are the ones ``SamplerImpl.forward`` gives a mask-only row (a
step whose other rows need the row-by-row sampler), alone or in any batch.

Not here: MTP verify rows (several logits rows a sequence, drafts before them: the row-by-row
sampler after the commit), rows with penalties, min_tokens, top-k/top-p/min-p or masked logprobs
(``masks_only``)."""

from __future__ import annotations

import attrs
import torch

from bi_core.ops.sampling import device_sampled, mix_seed
from bi_core.runtime.sequence import Status
from bi_core.runtime.step import Forward, StepOutput
from bi_core.structured.grammars import fill_rows

KEYS, TEMPS, ROWS = range(3)  # the staged int64 fields: key, temperature (float64 bits), flat row


class DeviceMasks:
    """The persistent mask buffers of one runner and the masked draw of a step's constrained rows."""

    def __init__(self, sampler, device: torch.device, max_rows: int, vocab_size: int) -> None:
        self.sampler, self.device, self.max_rows = sampler, device, max_rows
        self.words = (vocab_size + 31) // 32
        pinned = device.type == "cuda"
        self.host = torch.zeros((max_rows, self.words), dtype=torch.int32, pin_memory=pinned)
        self.host_meta = torch.zeros((3, max_rows), dtype=torch.int64, pin_memory=pinned)
        self.masks = torch.zeros((max_rows, self.words), dtype=torch.int32, device=device)
        self.meta = torch.zeros((3, max_rows), dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pinned else None
        self.num_rows = 0  # constrained rows drawn with their masks so far

    def wanted(self, fwd: Forward, out: StepOutput) -> bool:
        """Whether ``out``'s device samples serve its rows once the constrained ones are masked."""
        rows = [r for r in fwd.rows if r.sample]
        return (out.samples is not None and not out.masked and bool(rows)
                and any(r.seq.grammar is not None for r in rows)
                and len(rows) <= self.max_rows and all(len(r.logits_rows) == 1 for r in rows)
                and device_sampled([r.seq for r in rows], masked=True))

    def apply(self, fwd: Forward, out: StepOutput) -> StepOutput:
        """``out`` with its constrained rows' device samples drawn again with their masks (in
        place, on the device) and ``masked`` set; ``out`` itself where ``wanted`` is false."""
        if not self.wanted(fwd, out):
            return out
        todo = []  # (flat sample row, sequence, position)
        for k, r in enumerate(r for r in fwd.rows if r.sample):
            # a request that ended while the step flew keeps its unmasked row: its commit drops it
            if r.seq.grammar is not None and r.seq.status is Status.RUNNING:
                todo.append((k, r.seq, r.sample_positions[0]))
        if todo:
            self._draw(todo, out)
        return attrs.evolve(out, masked=True)

    def _draw(self, todo: list, out: StepOutput) -> None:
        n = len(todo)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy left the staging buffers (long since)
        rows = []
        for _, seq, pos in todo:
            generated = pos - len(seq.prompt_ids)  # output tokens before the one this row samples
            assert generated <= len(seq.output_ids), "mask_samples: a row ahead of its sequence's tokens"
            rows.append((seq.grammar, seq.output_ids[:generated]))
        fill_rows(rows, self.host)  # the host work, while the device runs the forward
        meta = self.host_meta.numpy()
        meta[KEYS, :n] = [mix_seed(seq.seed, pos) for _, seq, pos in todo]
        meta[TEMPS, :n] = torch.tensor([seq.params.temperature for _, seq, _ in todo],
                                       dtype=torch.float64).view(torch.int64).numpy()
        meta[ROWS, :n] = [k for k, _, _ in todo]
        self.masks[:n].copy_(self.host[:n], non_blocking=True)
        self.meta[:, :n].copy_(self.host_meta[:, :n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        idx = self.meta[ROWS, :n]
        drawn = self.sampler.sample_device(out.logits.index_select(0, idx), self.meta[KEYS, :n],
                                           self.meta[TEMPS, :n].view(torch.float64), self.masks[:n])
        out.samples.index_copy_(0, idx, drawn.to(out.samples.dtype))
        self.num_rows += n
