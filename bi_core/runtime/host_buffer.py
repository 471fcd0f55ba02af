"""Host memory for sleep level 1's copy of the weights: one buffer, page-locked once, kept.

Level 1 sleep (RL: a colocated trainer takes the GPU between rollouts) copies every weight to host
memory and back at wake. Pinning the host side is what costs: a pinned tensor per weight was slow
(``cudaHostAlloc`` zeroes and locks every page; dev/benchmarks-history.md), and torch's pinned
allocator rounds each block up to a power of two, so a model near half the host's memory could
ask for more than the host has. Here one plain allocation of exactly the weights' bytes is
registered with CUDA (``cudaHostRegister``) at the first sleep and kept for the next ones: only the
first sleep pays the pinning, later ones just copy. A level-2 sleep (weights dropped) lets go of
the buffer, as does the engine's end (the registration is undone when the buffer is collected)."""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)
ALIGN = 256  # every view starts on a 256-byte boundary (any dtype's alignment, DMA-friendly)


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostBuffer:
    """Host views shaped like ``tensors`` (one per tensor, same dtype and shape) in one buffer;
    page-locked when the tensors live on a CUDA device, so copies both ways are DMA transfers."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.layout = [(tuple(t.shape), t.dtype) for t in tensors]
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.nbytes = end
        self.buf = torch.empty(max(end, 1), dtype=torch.uint8)
        self.pinned = False
        if tensors and tensors[0].is_cuda:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
            self.pinned = int(err) == 0
            if self.pinned:
                weakref.finalize(self, _unregister, self.buf)
            else:  # works, slower: copies to pageable memory are staged by the driver
                log.warning("sleep: could not page-lock %.1f GiB of host memory (cudaHostRegister error %s); "
                            "weights go to pageable memory", end / 2**30, int(err))
        self.views = [self.buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                      for o, t in zip(offsets, tensors)]

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """True when ``tensors`` have the shapes and dtypes this buffer was laid out for."""
        return self.layout == [(tuple(t.shape), t.dtype) for t in tensors]

    def save(self, tensors: list[torch.Tensor]) -> None:
        """Copy the tensors in (asynchronous when page-locked; the caller synchronizes)."""
        for v, t in zip(self.views, tensors):
            v.copy_(t.detach(), non_blocking=self.pinned)

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Copy the saved values back into ``tensors`` (same order)."""
        for v, t in zip(self.views, tensors):
            t.copy_(v, non_blocking=self.pinned)
