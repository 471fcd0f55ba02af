"""Where MTP's drafts wait between the head that proposes them and the verify that reads them.

A chain's drafts stay on the device (``OnDevice``: the next verify gathers them there) while a
copy lands in host memory for the commit. Behind a verify they are a head program's static
output, which the same program's next replay writes over (``Lease``). A head program reads each
sequence's draft count from a tensor that must be the same every step (``DraftLimits``).
Benchmarks and audits force drafts over the head's on the device (``ForcedDrafts``)."""

from __future__ import annotations

import attrs
import torch

from bi_core.runtime.batch import to_device
from bi_core.runtime.step import Landing


@attrs.define
class Lease:
    """Whether a head program's static drafts still hold what one replay wrote: the next replay
    of the same program writes over them."""

    valid: bool = True


@attrs.frozen
class OnDevice:
    """A sequence's drafts still on the device: row ``row`` of a draft chain's [S, N] ids, whose
    host copy is ``landing``; ``lease``: where the ids are a head program's static output."""

    landing: Landing
    row: int
    lease: Lease | None = None

    @property
    def on_device(self) -> bool:
        """The device ids are still these drafts (a sequence that skipped a step may find its
        head program's output rewritten: its host copy, landed long since, stands in)."""
        return self.lease is None or self.lease.valid

    def host(self) -> list[int]:
        return self.landing.wait()[self.row].tolist()


class DraftLimits:
    """Per verify bucket: each sequence's draft count on the device, 0 for padding rows. A head
    program's input (the same tensor every step), uploaded only when the counts change."""

    def __init__(self) -> None:
        self._by_bucket: dict[int, tuple[torch.Tensor, list[int] | None]] = {}

    def of(self, counts: list[int], bucket: int, device: torch.device) -> torch.Tensor:
        values = counts + [0] * (bucket - len(counts))
        tensor, held = self._by_bucket.get(bucket) or (torch.zeros(bucket, dtype=torch.int64, device=device), None)
        if held != values:
            host = torch.tensor(values, dtype=torch.int64)
            tensor.copy_(host.pin_memory() if tensor.is_cuda else host, non_blocking=True)
        self._by_bucket[bucket] = (tensor, values)
        return tensor


class ForcedDrafts:
    """Forced drafts (a ``draft_override``'s: benchmarks, audits) written over the head's on the
    device. Every row forced: one copy from a page-locked staging buffer straight into the ids
    (the buffer is reused once its last copy is done), so the bench measures the engine, not its
    own hook (two uploads and an index copy cost the host more: dev/benchmarks-history.md). Some
    rows forced: the rows with a flag column, one upload and a select."""

    def __init__(self, num_spec: int, max_rows: int) -> None:
        self.num_spec, self.max_rows = num_spec, max_rows
        self._staging: torch.Tensor | None = None  # page-locked host rows
        self._staged: torch.cuda.Event | None = None  # the event of its last copy to the device

    def write(self, forced: list[list[int] | None], ids: torch.Tensor) -> None:
        """Row i of ``ids`` [S, N] becomes ``forced[i]`` (padded with 0s; None: left alone)."""
        n = self.num_spec
        if all(d is None for d in forced):
            return
        if all(d is not None for d in forced):
            stage = self._stage(len(forced), ids)
            stage.numpy()[:] = [(d + [0] * n)[:n] for d in forced]
            ids.copy_(stage, non_blocking=True)
            if self._staged is not None:
                self._staged.record()
            return
        rows = [[0] * (n + 1) if d is None else [1, *(d + [0] * n)[:n]] for d in forced]
        staged = to_device([t for r in rows for t in r], ids.device).view(len(rows), n + 1)
        torch.where(staged[:, :1].bool(), staged[:, 1:], ids, out=ids)

    def _stage(self, s: int, ids: torch.Tensor) -> torch.Tensor:
        """The first ``s`` rows of the staging buffer, free to write."""
        if self._staging is None or self._staging.shape[0] < s:
            pinned = ids.is_cuda
            self._staging = torch.empty((max(s, self.max_rows), self.num_spec), dtype=torch.int64, pin_memory=pinned)
            self._staged = torch.cuda.Event() if pinned else None
        elif self._staged is not None:
            self._staged.synchronize()  # its last copy has left (long since: a step ago)
        return self._staging[:s]
