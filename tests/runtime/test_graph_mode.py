"""How steps are launched is the runtime's choice from ``graph.*`` and the device, not an op the
policy selects: eager steps without graphs; graph steps rerun on their static buffers where they
are not captured (``graph.capture: false``, or auto off a CUDA device), with the outputs of eager
steps; a setting that cannot hold, or would do nothing, is one error naming its key; the retired
``graph_runner`` op is refused by name in a config and in a plugin's backend."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, PluginError, SamplingParams, build_engine
from bi_core.config import GraphConfig
from bi_core.registry import Backend
from bi_core.runtime.build import explain
from bi_core.runtime.graphs import CudaGraphRunner, EagerRunner
from bi_core.runtime.graphs.mode import resolve_capture

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]  # 3 sequences: bucket 4, one padding row
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.8, seed=1)


def config(**graph) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(graph=graph))


def test_graphs_off_run_eager_steps():
    eng = build_engine(config())
    assert type(eng.runner.main_graphs) is EagerRunner


@pytest.mark.parametrize("capture", ["auto", False])
def test_graph_steps_off_cuda_rerun_without_capture_and_equal_eager(capture):
    eager = build_engine(config()).generate(PROMPTS, PARAMS)
    eng = build_engine(config(enabled=True, capture=capture))
    graphs = eng.runner.main_graphs
    assert type(graphs) is CudaGraphRunner and not graphs.capture and eng.runner.spec.capture is False
    out = eng.generate(PROMPTS, PARAMS)
    assert graphs.num_replays[1] > 0 and (1, 4) in graphs.graphs  # the graph path ran, padded to bucket 4
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    for o, e in zip(out, eager):  # the reference backend is not batch-invariant: padding rows move low bits
        torch.testing.assert_close(torch.tensor(o.token_logprobs), torch.tensor(e.token_logprobs))


def test_capture_resolution():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_capture(GraphConfig(enabled=True), cuda, {}) is True
    assert resolve_capture(GraphConfig(enabled=True, capture=False), cuda, {}) is False
    assert resolve_capture(GraphConfig(enabled=True), cpu, {}) is False
    assert resolve_capture(GraphConfig(), cuda, {}) is False
    # an impl a replay would not update: refused where it would be captured, rerun where asked
    refusals = {"reference": "reads host lists"}
    with pytest.raises(ConfigError, match=r"^graph.enabled: CUDA graphs cannot capture .*'reference': reads host"):
        resolve_capture(GraphConfig(enabled=True), cuda, refusals)
    with pytest.raises(ConfigError, match=r"^graph.capture: CUDA graphs cannot capture"):
        resolve_capture(GraphConfig(enabled=True, capture=True), cuda, refusals)
    assert resolve_capture(GraphConfig(enabled=True, capture=False), cuda, refusals) is False


@pytest.mark.parametrize("graph, match", [
    ({"capture": False}, "graph.capture: false would do nothing: it says how graph steps run, and graph.enabled"),
    ({"capture": True}, "graph.capture: true would do nothing"),
    ({"enabled": True, "capture": True}, "graph.capture: CUDA graphs need a CUDA device"),
])
def test_a_capture_setting_that_cannot_hold_or_does_nothing_is_refused(graph, match):
    with pytest.raises(ConfigError, match=match):
        build_engine(config(**graph))


def test_explain_says_how_steps_are_launched():
    assert "graphs: eager steps (graph.enabled: false)" in explain(config())
    text = explain(config(enabled=True))
    assert "graphs: graph steps rerun on their static buffers, not captured, per batch bucket" in text
    assert "graph_runner" not in text and "SELECTION FAILED" not in text


def test_the_retired_graph_runner_op_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"^policy.ops.graph_runner: no longer an op: .*graph.enabled"):
        EngineConfig.from_dict(tiny_config(policy={"ops": {"graph_runner": ["cuda_default"]}}))

    class OldGraphRunnerBuilder:
        op = "graph_runner"

    with pytest.raises(PluginError, match="builder for op 'graph_runner', which is no longer an op"):
        Backend(name="old", builders=(OldGraphRunnerBuilder(),))
