"""The vision tower between steps, within a budget: queued image requests are encoded image by
image (the tower's attention is per image: an image is the smallest piece), at most
``vision.max_num_encoder_input_tokens`` vision tokens a step (an image larger than that alone),
so a large image never stalls the decoding streams for longer than that; a request's prefill
waits until all its images are encoded (``Scheduler._admit``) while the others' steps go on.
Each image is one tower call whatever the schedule, so its rows are the same bits however its
encoding was spread over steps (``multimodal.encode_next``)."""

from __future__ import annotations

import itertools

import torch

from bi_core.runtime.multimodal import MultimodalPrompt, encode_next
from bi_core.runtime.scheduler import Scheduler


class VisionEncoder:
    """Encodes queued requests' images between steps, a budget of vision tokens a step."""

    def __init__(self, tower, device: torch.device, budget: int) -> None:
        self.tower, self.device, self.budget = tower, device, budget
        self.num_encoded = 0  # images and videos encoded so far

    def pending(self, scheduler: Scheduler) -> list[MultimodalPrompt]:
        """Prompts of queued requests with items still to encode, in queue order: among as many
        of the queue's first requests as there are free sequence slots (at least one), so a deep
        queue's embeddings are not held long before their requests can run."""
        look = max(1, scheduler.config.max_num_seqs - len(scheduler.running))
        out, seen = [], set()
        for seq in itertools.islice(scheduler.waiting, look):
            m = seq.mm
            if m is not None and m.embeds is None and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
        return out

    def step(self, scheduler: Scheduler) -> int:
        """Encode queued items in order until the next would pass the budget (the first always
        runs); returns how many were encoded."""
        if self.tower is None:  # (an engine without a tower refuses images at intake)
            return 0
        unit, left, n = self.tower.args.merge_unit, self.budget, 0
        for m in self.pending(scheduler):
            while m.embeds is None and (n == 0 or m.next_tokens(unit) <= left):
                left -= encode_next(self.tower, m, self.device)
                n += 1
            if m.embeds is None:
                break
        self.num_encoded += n
        return n
