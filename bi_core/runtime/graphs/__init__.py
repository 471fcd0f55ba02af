"""How the model runner launches a step: eagerly (``eager.py``), or as CUDA graphs per batch bucket
(``cuda.py``, over the static buffers of ``static_batch.py``), which the rerun mode runs without
capture. Chosen from the config (``mode.py``), not selected as an op. Whatever the mode, a row's
result never depends on the padding beside it: padding rows write only the scratch KV page and
the scratch GDN state slot, which no sequence owns (``StaticBatch.padded``)."""

from __future__ import annotations

from bi_core.runtime.graphs.cuda import CudaGraphRunner
from bi_core.runtime.graphs.eager import EagerRunner
from bi_core.runtime.graphs.spec import GraphRunner, GraphRunnerSpec


def graph_runner(spec: GraphRunnerSpec) -> GraphRunner:
    """The runner ``spec`` asks for: eager without graphs, else CUDA graphs (or their rerun mode)."""
    return CudaGraphRunner(spec) if spec.use_graphs else EagerRunner(spec)


__all__ = ["CudaGraphRunner", "EagerRunner", "GraphRunner", "GraphRunnerSpec", "graph_runner"]
