"""Graph runner: how a model step is launched (eagerly, or as captured CUDA graphs per batch bucket)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from bi_core.ops.base import OpBuilder, OpSpec
from bi_core.ops.context import ForwardContext

StepFn = Callable[[torch.Tensor, ForwardContext], torch.Tensor]


@attrs.frozen(kw_only=True)
class GraphRunnerSpec(OpSpec):
    use_graphs: bool
    max_batch_size: int


class GraphRunnerImpl(Protocol):
    def run(self, step: StepFn, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Run ``step(input_ids, ctx)`` (a full model forward), returning its output."""


class GraphRunnerBuilder(OpBuilder[GraphRunnerSpec]):
    op = "graph_runner"
