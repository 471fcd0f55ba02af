"""Eager steps (``graph.enabled: false``): every step packed into fresh device tensors and launched
kernel by kernel from the host."""

from __future__ import annotations

import torch

from bi_core.ops.context import ForwardContext, HostBatch
from bi_core.runtime.batch import gather_ids, upload
from bi_core.runtime.graphs.spec import GraphRunnerSpec, StepFn


class EagerRunner:
    """Launches each step as it comes; captures nothing."""

    def __init__(self, spec: GraphRunnerSpec) -> None:
        self.spec = spec
        # recorded after a step's host-staged inputs are queued, before it runs (``wait_inputs``)
        self._inputs = torch.cuda.Event() if spec.device.type == "cuda" else None

    def make_context(self, batch: HostBatch, device: torch.device) -> tuple[torch.Tensor, ForwardContext]:
        return upload(batch, device)

    def capture_all(self, step: StepFn, block_size: int, prepare=None, extra: torch.Tensor | None = None) -> int:
        return 0  # nothing to capture

    def run(self, step: StepFn, input_ids: torch.Tensor, ctx: ForwardContext, prepare=None,
            extra: torch.Tensor | None = None, ids_from: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if ids_from is not None:
            gather_ids(input_ids, ids_from)
        if prepare is not None:
            prepare(ctx)
        if self._inputs is not None:
            self._inputs.record()
        return step(input_ids, ctx) if extra is None else step(input_ids, ctx, extra)

    def wait_inputs(self) -> None:
        if self._inputs is not None:
            self._inputs.synchronize()

    def release(self) -> None:
        """Nothing captured, nothing to forget."""
