from __future__ import annotations

from bi_core.ops.graph_runner import GraphRunnerBuilder, GraphRunnerSpec
from bi_core.runtime.batch import gather_ids, upload


class EagerRunnerImpl:
    def make_context(self, batch, device):
        return upload(batch, device)

    def capture_all(self, step, block_size, prepare=None, extra=None) -> int:
        return 0  # nothing to capture

    def wait_inputs(self) -> None:
        """Nothing is staged on the host past a launch."""

    def release(self) -> None:
        """Nothing captured, nothing to forget."""

    def run(self, step, input_ids, ctx, prepare=None, extra=None, ids_from=None):
        if ids_from is not None:
            gather_ids(input_ids, ids_from)
        if prepare is not None:
            prepare(ctx)
        return step(input_ids, ctx) if extra is None else step(input_ids, ctx, extra)


class ReferenceGraphRunnerBuilder(GraphRunnerBuilder):
    def check(self, spec: GraphRunnerSpec, policy) -> list[str]:
        if spec.use_graphs:
            return ["runs eagerly and cannot capture CUDA graphs (set graph.enabled: false)"]
        return []

    def build(self, spec: GraphRunnerSpec) -> EagerRunnerImpl:
        return EagerRunnerImpl()
